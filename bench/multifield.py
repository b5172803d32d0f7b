"""Multi-field samples (issue 14): reading in place, field compression, conversion speed.

    python -m bench.multifield inplace      [--n 5000] [--reps 5]
    python -m bench.multifield compression  [--n 5000] [--reps 5]
    python -m bench.multifield convert      [--n 10000] [--workers 2] [--reps 3]

- ``inplace``: the same samples (a 64x64 JPEG, a 32-token int32 caption, a class) written by
  webdataset's ShardWriter and read in place through gpufeed's cached member index, against
  gpufeed's own tar pack of them (gpufeed.Writer): every sample in a shuffled order, batches
  of 256 through ``get_batch``, with and without decoding the JPEGs.
- ``compression``: a 2 KiB text, a smooth float32 [64, 64] array, 512 int32 token ids per
  sample, each stored plain and with ``"compression": "zstd"``: bytes on disk, and reading
  every sample.
- ``convert``: the same samples written by ``gpufeed.pack(fn, inputs, workers=W)``,
  ``litdata.optimize(num_workers=W)``, MosaicML's ``MDSWriter`` and webdataset's
  ``ShardWriter`` (both single-process writers: fed by a pool of W processes making the samples,
  as their docs do), for two sample kinds: a JPEG + a 32-token caption, and a raw float32
  array. A peer that is not installed is reported as such. The same as ``python -m
  bench.convert`` (bench/convert.py: its flags, the folder path, CPU seconds, peak RSS).

The passes are interleaved (pass 1 of every candidate, then pass 2, ...) so the machine's
noise falls on all alike; the best pass counts, and ratios are printed side by side.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "app" / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import gpufeed  # noqa: E402

BATCH = 256


def jpeg(i: int, size: int = 64) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    base = rng.integers(0, 255, (size // 8, size // 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((size, size), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def caption_sample(i: int) -> dict:
    return {"image": jpeg(i), "tokens": np.arange(32, dtype=np.int32) + i, "label": i % 10}


def raw_sample(i: int) -> dict:
    return {"x": np.full((3, 32, 32), i % 251, dtype=np.float32), "label": i % 10}


def best_rates(candidates: dict, reps: int, n: int) -> dict[str, float]:
    """samples/s of each candidate's best pass, passes interleaved."""
    best = {name: 0.0 for name in candidates}
    for _ in range(reps):
        for name, run in candidates.items():
            t = time.perf_counter()
            run()
            best[name] = max(best[name], n / (time.perf_counter() - t))
    return best


def read_all(ds, n: int, seed: int = 0) -> None:
    order = np.random.default_rng(seed).permutation(n)
    for lo in range(0, n, BATCH):
        ds.get_batch(order[lo : lo + BATCH])


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def run_inplace(root: Path, n: int, reps: int) -> None:
    import webdataset as wds

    (root / "wds").mkdir()
    samples = [caption_sample(i) for i in range(n)]
    with wds.ShardWriter(str(root / "wds" / "s-%04d.tar"), maxcount=2000, verbose=0) as sink:
        for i, s in enumerate(samples):
            sink.write({"__key__": f"{i:08d}", "jpg": s["image"], "tokens.npy": s["tokens"],
                        "cls": s["label"]})  # fmt: skip
    schema = {"image": "jpeg", "tokens": "int32[-1]", "label": "int"}
    with gpufeed.Writer(root / "own", format="tar", schema=schema, shard_size=2000) as w:
        for s in samples:
            w.write(s)
    t = time.perf_counter()
    gpufeed.open_dataset(root / "wds", index_dir=root / "idx")
    index_s = time.perf_counter() - t
    rows = []
    for decode in (False, True):
        wds_ds = gpufeed.open_dataset(root / "wds", index_dir=root / "idx", decode=decode)
        own = gpufeed.open_dataset(root / "own", map_style=True, decode=decode)
        rates = best_rates(
            {"webdataset in place": lambda d=wds_ds: read_all(d, n),
             "gpufeed tar": lambda d=own: read_all(d, n)},
            reps, n,
        )  # fmt: skip
        rows.append((decode, rates))
    print(f"inplace: {n} samples (64x64 JPEG + 32 int32 tokens + class); index built in "
          f"{index_s:.2f}s ({n / index_s:,.0f} samples/s), cached after")  # fmt: skip
    for decode, r in rows:
        a, b = r["webdataset in place"], r["gpufeed tar"]
        print(f"  decode={decode!s:5}  webdataset in place {a:9,.0f}/s  gpufeed tar {b:9,.0f}/s"
              f"  in place / own = {a / b:.2f}x")  # fmt: skip


def run_compression(root: Path, n: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    words = np.array("the a of cat dog runs over under quickly slowly red blue".split())
    texts = [" ".join(rng.choice(words, 400)) for _ in range(64)]
    # smooth arrays (a sensor field, a depth map), and token ids (int32, a 50k vocabulary)
    smooth = np.cumsum(rng.standard_normal((64, 64, 64)), axis=2).astype(np.float32)
    tokens = rng.zipf(1.3, (64, 512)).clip(0, 50_000).astype(np.int32)
    kinds = {
        "text (2 KiB)": ("str", None, lambda i: texts[i % 64]),
        "float32 64x64 smooth array": ("array", ("float32", [64, 64]), lambda i: smooth[i % 64]),
        "int32 tokens (512)": ("ragged", ("int32", [-1]), lambda i: tokens[i % 64]),
    }
    print(f"compression: {n} samples of one field, lmdb")
    for what, (kind, arr, make) in kinds.items():
        packs = {}
        for comp in (None, "zstd"):
            field = {"type": kind, "compression": comp}
            if arr:
                field.update(dtype=arr[0], shape=arr[1])
            dest = root / f"c-{kind}-{comp}"
            with gpufeed.Writer(dest, format="lmdb", schema={"v": field}) as w:
                for i in range(n):
                    w.write({"v": make(i)})
            packs[comp or "none"] = (dir_bytes(dest), gpufeed.open_dataset(dest))
        rates = best_rates({k: (lambda d=v[1]: read_all(d, n)) for k, v in packs.items()}, reps, n)
        size = packs["zstd"][0] / packs["none"][0]
        speed = rates["zstd"] / rates["none"]
        print(f"  {what:28} bytes zstd/none {size:.2f}x   read zstd/none {speed:.2f}x "
              f"({rates['none']:,.0f}/s plain)")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["inplace", "compression", "convert"])
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gpufeed-multifield-"))
    try:
        if args.what == "inplace":
            run_inplace(root, args.n or 5000, args.reps or 5)
        elif args.what == "compression":
            run_compression(root, args.n or 5000, args.reps or 5)
        else:
            from bench.convert import run_convert

            run_convert(root, args.n or 10000, args.workers, args.reps or 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
