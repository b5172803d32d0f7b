"""Conversion speed: the same samples written by gpufeed and by the three peers, the same
number of worker processes, each candidate in a process of its own.

    python -m bench.convert [--n 10000] [--workers 2] [--reps 2] [--kinds jpeg,raw]
                            [--only "gpufeed tar,MDSWriter"] [--data DIR]
    python -m bench.multifield convert ...      (the same, with multifield's defaults)

--n: samples per kind (the issue's scale is 100000); --workers: worker processes of every
candidate; --reps: passes (interleaved, the order rotated each pass; the best pass counts);
--kinds: jpeg (a 64x64 JPEG + 32-token caption + class) and/or raw (a float32 [3, 32, 32]
array + class); --only: a comma-separated subset of the candidates below; --data: where the
sources and outputs go (default: a temporary folder; the sources are kept there and reused
when --data is given again).

Sources are files on disk, as a user's are: N JPEGs and N .npy arrays in 10 class folders.
The candidates:

- ``gpufeed tar`` / ``gpufeed lmdb``: ``gpufeed.pack(fn, paths, dest, format=..., workers=W)``,
  the Python-function path, running the same ``make_*`` function as the peers;
- ``gpufeed tar folder`` / ``gpufeed lmdb folder``: ``gpufeed.pack(FOLDER, dest, ...)``, the
  folder path: (image, class) or (array, class) samples, no caption; every JPEG is checked
  by a decode (at 1/8 scale where gpufeed-jpeg is installed: a corrupt file fails the pack,
  not the training run);
- ``litdata.optimize(fn, paths, out, chunk_bytes="64MB", num_workers=W)``;
- MosaicML Streaming's ``MDSWriter`` and webdataset's ``ShardWriter``: single-process
  writers, fed by ``multiprocessing.Pool(W).imap(fn, paths, chunksize=64)`` (their docs'
  pattern).

Each run is a fresh ``python`` process; the clock starts after the candidate's imports
(litdata and MosaicML Streaming import torch: seconds a user pays once, not per sample).
Printed per candidate: samples/s, time against gpufeed tar's, CPU seconds of the whole process
tree during the conversion (user + system: what the run costs on a shared machine, where wall
time is noisy), and the peak RSS of the whole process tree (sampled every 50 ms from /proc,
imports included: memory the user needs) against gpufeed tar's.

MosaicML Streaming's package imports its vision datasets (and so torchvision) on import;
``streaming.vision`` is pre-registered as an empty module: MDSWriter itself (streaming.base)
is what runs.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

CAPTION = 32
CLASSES = 10


def make_caption(path: str) -> dict:
    i = int(Path(path).stem)
    return {
        "image": Path(path).read_bytes(),
        "tokens": (np.arange(CAPTION, dtype=np.int32) * 7 + i) % 50_000,
        "label": i % CLASSES,
    }


def make_raw(path: str) -> dict:
    return {"x": np.load(path), "label": int(Path(path).stem) % CLASSES}


KINDS = {  # kind: (title, fn, schema)
    "jpeg": ("jpeg + caption", make_caption, {"image": "jpeg", "tokens": "int32[-1]",
                                              "label": "int"}),
    "raw": ("raw float32 3x32x32", make_raw, {"x": "float32[3,32,32]", "label": "int"}),
}  # fmt: skip
FOLDER = {"jpeg": "jpg", "raw": "npy"}


UNIQUE_JPEGS = 1000


def sources(root: Path, n: int) -> dict[str, list[str]]:
    """N JPEGs and N .npy arrays under root/jpg and root/npy, sample i in class folder
    c{i % 10} (made once: a second run with the same root and n reuses them). The JPEGs are
    UNIQUE_JPEGS different images, repeated (encoding 100,000 took longer than converting
    them); the arrays are written with one .npy header (np.save per file cost as much)."""
    from bench.multifield import jpeg

    done = root / f"sources-{n}.json"
    if done.exists():
        return json.loads(done.read_text())
    images = [jpeg(i) for i in range(min(n, UNIQUE_JPEGS))]
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 32, 32), np.float32))
    header = buf.getvalue()[: -3 * 32 * 32 * 4]
    paths = {"jpeg": [], "raw": []}
    for i in range(n):
        c = f"c{i % CLASSES}"
        p = root / "jpg" / c / f"{i:07d}.jpg"
        q = root / "npy" / c / f"{i:07d}.npy"
        if i < CLASSES:
            p.parent.mkdir(parents=True, exist_ok=True)
            q.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(images[i % len(images)])
        q.write_bytes(header + np.full((3, 32, 32), i % 251, np.float32).tobytes())
        paths["jpeg"].append(str(p))
        paths["raw"].append(str(q))
    done.write_text(json.dumps(paths))
    return paths


# -- the candidates (each run in a process of its own: run_one) -----------------------------
def _gpufeed(fmt):
    def run(kind, paths, out, workers):
        import gpufeed

        _, make, schema = KINDS[kind]
        gpufeed.pack(make, paths, out, format=fmt, schema=schema, workers=workers, quiet=True)

    return run


def _gpufeed_folder(fmt):
    def run(kind, paths, out, workers):
        import gpufeed

        folder = Path(paths[0]).parent.parent
        gpufeed.pack(str(folder), out, format=fmt, workers=workers, quiet=True)

    return run


def _litdata(kind, paths, out, workers):
    import litdata

    litdata.optimize(
        fn=KINDS[kind][1], inputs=paths, output_dir=str(out), chunk_bytes="64MB",
        num_workers=workers,
    )  # fmt: skip


def _mds(kind, paths, out, workers):
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    from streaming import MDSWriter

    columns = {"label": "int"}
    columns.update({"image": "bytes", "tokens": "ndarray:int32"} if kind == "jpeg" else
                   {"x": "ndarray:float32"})  # fmt: skip
    with (
        mp.get_context("fork").Pool(workers) as pool,
        MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w,
    ):
        for sample in pool.imap(KINDS[kind][1], paths, chunksize=64):
            w.write(sample)


def _wds(kind, paths, out, workers):
    import webdataset as wds

    out.mkdir()
    with (
        mp.get_context("fork").Pool(workers) as pool,
        wds.ShardWriter(str(out / "s-%05d.tar"), maxcount=10_000, verbose=0) as sink,
    ):
        for i, s in enumerate(pool.imap(KINDS[kind][1], paths, chunksize=64)):
            if kind == "jpeg":
                sink.write({"__key__": f"{i:08d}", "jpg": s["image"], "tokens.npy": s["tokens"],
                            "cls": s["label"]})  # fmt: skip
            else:
                sink.write({"__key__": f"{i:08d}", "x.npy": s["x"], "cls": s["label"]})


CANDIDATES = {
    "gpufeed tar": _gpufeed("tar"),
    "gpufeed lmdb": _gpufeed("lmdb"),
    "gpufeed tar folder": _gpufeed_folder("tar"),
    "gpufeed lmdb folder": _gpufeed_folder("lmdb"),
    "litdata.optimize": _litdata,
    "MDSWriter": _mds,
    "wds ShardWriter": _wds,
}
PEER_MODULES = {"litdata.optimize": "litdata", "MDSWriter": "streaming", "wds ShardWriter":
                "webdataset"}  # fmt: skip


def _available(name: str) -> bool:
    module = PEER_MODULES.get(name)
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


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its children that have exited."""
    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF),
                  resource.getrusage(resource.RUSAGE_CHILDREN))
    )  # fmt: skip


def _import(name: str) -> None:
    """What the candidate imports, before the clock starts (a user pays it once)."""
    if name.startswith("gpufeed"):
        import gpufeed
        import gpufeed.write.convert  # noqa: F401 - pack(fn)'s module, imported lazily
    else:
        _available(name)


def run_one(name: str, kind: str, paths_file: str, out: str, workers: int) -> None:
    """In the candidate's own process: its imports, then the conversion, timed: print its
    wall time and CPU seconds (of the conversion: the imports left out)."""
    paths = json.loads(Path(paths_file).read_text())[kind]
    _import(name)
    cpu, t = _cpu_seconds(), time.perf_counter()
    CANDIDATES[name](kind, paths, Path(out), workers)
    wall = time.perf_counter() - t
    print(json.dumps({"wall": wall, "cpu": _cpu_seconds() - cpu}))


# -- measuring a run from outside ------------------------------------------------------------
def _tree_rss(root_pid: int) -> int:
    """The resident bytes of root_pid and every process under it, now (from /proc)."""
    parent, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
        except (OSError, ValueError):
            continue
        parent[int(entry)] = int(fields[1])
        rss[int(entry)] = int(fields[21]) * page
    total = 0
    for pid in rss:
        p = pid
        while p and p != root_pid:
            p = parent.get(p, 0)
        total += rss[pid] if p == root_pid else 0
    return total


def measure(name: str, kind: str, paths_file: Path, out: Path, workers: int) -> dict:
    """Run one candidate in a fresh process: wall, CPU seconds, peak tree RSS."""
    cmd = [sys.executable, "-m", "bench.convert", "--one", name, "--kind", kind,
           "--paths", str(paths_file), "--out", str(out), "--workers", str(workers)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.05)
    result = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} ({kind}) failed with exit code {proc.returncode}")
    return {**json.loads(result.strip().splitlines()[-1]), "rss": peak}


def run_convert(
    root: Path, n: int, workers: int, reps: int, kinds=("jpeg", "raw"), only=None
) -> None:
    paths = sources(root, n)
    paths_file = root / f"sources-{n}.json"
    names = [c for c in CANDIDATES if (only is None or c in only) and _available(c)]
    print(f"convert: {n} samples per kind, {workers} worker processes each, best of {reps}")
    for kind in kinds:
        best: dict[str, dict] = {}
        for rep in range(reps):
            # each pass in a rotated order: no candidate always runs first (cold) or right
            # after a given peer (whose processes may still be exiting)
            for c in names[rep % len(names) :] + names[: rep % len(names)]:
                out = root / f"out-{c.replace(' ', '_')}"
                _remove(out)
                r = measure(c, kind, paths_file, out, workers)
                _remove(out)
                if c not in best or r["wall"] < best[c]["wall"]:
                    best[c] = r
        _report(KINDS[kind][0], n, names, best)
    del paths


def _remove(out: Path) -> None:
    """A candidate's output, and what a stopped gpufeed run leaves beside it."""
    for path in (out, out.with_name(out.name + ".partial")):
        shutil.rmtree(path, ignore_errors=True)


def _report(title: str, n: int, names: list[str], best: dict[str, dict]) -> None:
    ref = "gpufeed tar" if "gpufeed tar" in best else names[0]
    base = best[ref]
    print(f"  {title}:  (time, CPU and peak RSS / {ref}'s)")
    for c in names:
        r = best[c]
        mib = r["rss"] / 2**20
        print(f"    {c:20} {n / r['wall']:8,.0f} samples/s  time {r['wall'] / base['wall']:5.2f}x"
              f"  cpu {r['cpu']:6.1f} s ({r['cpu'] / base['cpu']:4.2f}x)"
              f"  peak RSS {mib:6,.0f} MiB ({r['rss'] / base['rss']:4.2f}x)")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--kinds", default="jpeg,raw")
    p.add_argument("--only", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    p.add_argument("--paths", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        run_one(args.one, args.kind, args.paths, args.out, args.workers)
        return 0
    only = [c.strip() for c in args.only.split(",")] if args.only else None
    unknown = [c for c in only or [] if c not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidates {unknown}; choose from {list(CANDIDATES)}")
    root = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="gpufeed-convert-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        run_convert(root, args.n, args.workers, args.reps, args.kinds.split(","), only)
    finally:
        if not args.data:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
