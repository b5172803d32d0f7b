"""Conversion speed (``python -m bench.multifield convert``): the same samples written by
gpufeed and by the three peers, the same number of worker processes.

Sources are files on disk, as a user's are: N JPEGs (64x64) with a 32-token caption each, and
N .npy float32 [3, 32, 32] arrays. Each candidate runs the same ``make_*`` function per input
(read the file, build the sample dict) and writes:

- ``gpufeed.pack(fn, paths, dest, format="tar", workers=W)`` (and format="lmdb");
- ``litdata.optimize(fn, paths, out, chunk_bytes="64MB", num_workers=W)``;
- MosaicML Streaming's ``MDSWriter`` and webdataset's ``ShardWriter``: single-process writers,
  fed by ``multiprocessing.Pool(W).imap(fn, paths, chunksize=64)`` (their docs' pattern).

MosaicML Streaming's package imports its vision datasets (and so torchvision) on import; the
host has no CPU torchvision build of torch's version, so ``streaming.vision`` is pre-registered
as an empty module: MDSWriter itself (streaming.base) is what runs.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np

import gpufeed

CAPTION = 32


def make_caption(path: str) -> dict:
    i = int(Path(path).stem)
    return {
        "image": Path(path).read_bytes(),
        "tokens": (np.arange(CAPTION, dtype=np.int32) * 7 + i) % 50_000,
        "label": i % 10,
    }


def make_raw(path: str) -> dict:
    return {"x": np.load(path), "label": int(Path(path).stem) % 10}


KINDS = {
    "jpeg + caption": (make_caption, {"image": "jpeg", "tokens": "int32[-1]", "label": "int"}),
    "raw float32 3x32x32": (make_raw, {"x": "float32[3,32,32]", "label": "int"}),
}


def sources(root: Path, n: int) -> dict[str, list[str]]:
    from bench.multifield import jpeg

    (root / "jpg").mkdir()
    (root / "npy").mkdir()
    jpgs, npys = [], []
    for i in range(n):
        p = root / "jpg" / f"{i:07d}.jpg"
        p.write_bytes(jpeg(i))
        jpgs.append(str(p))
        q = root / "npy" / f"{i:07d}.npy"
        np.save(q, np.full((3, 32, 32), i % 251, np.float32))
        npys.append(str(q))
    return {"jpeg + caption": jpgs, "raw float32 3x32x32": npys}


def _gpufeed(fmt):
    def run(make, schema, paths, out, workers):
        gpufeed.pack(make, paths, out, format=fmt, schema=schema, workers=workers, quiet=True)

    return run


def _litdata(make, schema, paths, out, workers):
    import litdata

    litdata.optimize(
        fn=make, inputs=paths, output_dir=str(out), chunk_bytes="64MB", num_workers=workers
    )


def _mds(make, schema, paths, out, workers):
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    from streaming import MDSWriter

    columns = {"label": "int"}
    columns.update({"image": "bytes", "tokens": "ndarray:int32"} if "image" in schema else
                   {"x": "ndarray:float32"})  # fmt: skip
    with (
        mp.get_context("fork").Pool(workers) as pool,
        MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w,
    ):
        for sample in pool.imap(make, paths, chunksize=64):
            w.write(sample)


def _wds(make, schema, paths, out, workers):
    import webdataset as wds

    out.mkdir()
    with (
        mp.get_context("fork").Pool(workers) as pool,
        wds.ShardWriter(str(out / "s-%05d.tar"), maxcount=10_000, verbose=0) as sink,
    ):
        for i, s in enumerate(pool.imap(make, paths, chunksize=64)):
            if "image" in s:
                sink.write({"__key__": f"{i:08d}", "jpg": s["image"], "tokens.npy": s["tokens"],
                            "cls": s["label"]})  # fmt: skip
            else:
                sink.write({"__key__": f"{i:08d}", "x.npy": s["x"], "cls": s["label"]})


CANDIDATES = {
    "gpufeed tar": _gpufeed("tar"),
    "gpufeed lmdb": _gpufeed("lmdb"),
    "litdata.optimize": _litdata,
    "MDSWriter": _mds,
    "wds ShardWriter": _wds,
}


def _available(name: str) -> bool:
    module = {"litdata.optimize": "litdata", "MDSWriter": "streaming", "wds ShardWriter":
              "webdataset"}.get(name)  # fmt: skip
    if module is None:
        return True
    if module == "streaming":
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure: the peer is reported missing
        print(f"  {name}: not available ({type(e).__name__}: {e})")
        return False
    return True


def run_convert(root: Path, n: int, workers: int, reps: int) -> None:
    paths = sources(root, n)
    names = [c for c in CANDIDATES if _available(c)]
    print(f"convert: {n} samples per kind, {workers} worker processes each, best of {reps}")
    for kind, (make, schema) in KINDS.items():
        best = {c: float("inf") for c in names}
        for rep in range(reps):
            # each pass in a rotated order: no candidate always runs first (cold) or right
            # after a given peer (whose processes may still be exiting)
            for c in names[rep % len(names) :] + names[: rep % len(names)]:
                out = root / f"out-{rep}-{c.replace(' ', '_')}"
                t = time.perf_counter()
                CANDIDATES[c](make, schema, paths[kind], out, workers)
                best[c] = min(best[c], time.perf_counter() - t)
                shutil.rmtree(out, ignore_errors=True)
        base = best["gpufeed tar"]
        print(f"  {kind}:")
        for c in names:
            print(f"    {c:18} {n / best[c]:9,.0f} samples/s   time / gpufeed tar's "
                  f"{best[c] / base:.2f}x")  # fmt: skip
