"""Converting with several processes: parts + gpufeed.merge against one process and the disk.

    python -m bench.studies.convert [--n 1000000] [--procs 1,2,4] [--format tar] [--rounds 3]
                                    [--quick] [--out DIR] [--json FILE]

N small raw samples (64 bytes of uint8 and a class) are converted by P processes, each
writing its slice as a part (gpufeed.Writer), then ``gpufeed.merge`` makes one pack of the
parts (hard links: no sample copied); the timed span is the processes and the merge.
Side by side, where installed: WebDataset's ``ShardWriter`` per process (the same samples
as .x.npy + .cls members). MDS (``MDSWriter`` + ``merge_index``) and LitData
(``optimize``) are named "not run" when their packages are absent.

The physical bound is ``dd``: the pack's bytes written to the same disk, fsynced, in 1 MiB
blocks; a candidate's bytes/s over dd's is its share of the disk. Each row reports
samples/s (best pass of interleaved rounds, bench/studies/common.py), the peak resident
memory of its writing processes, its ratio to one process, and its share of the dd bound.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

import gpufeed  # noqa: I001 - after common, which puts gpufeed's sources on the path
from bench.studies import common
from gpufeed.write.merge import merge

SCHEMA = {"x": "uint8[64]", "label": "int"}


def _slice(n: int, procs: int, k: int) -> range:
    per = -(-n // procs)
    return range(k * per, min(n, (k + 1) * per))


def _rows(items: range):
    base = np.arange(64, dtype=np.uint8)
    for i in items:
        yield (base + i % 256).astype(np.uint8), i % 1000


def _gpufeed_part(args) -> int:
    dest, fmt, items = args
    with gpufeed.Writer(dest, format=fmt, schema=SCHEMA) as w:
        for x, label in _rows(items):
            w.write({"x": x, "label": label})
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _wds_part(args) -> int:
    import io

    import webdataset as wds

    dest, _, items = args
    os.makedirs(dest, exist_ok=True)
    with wds.ShardWriter(os.path.join(dest, "shard-%06d.tar"), maxcount=10**6, verbose=0) as w:
        for x, label in _rows(items):
            buf = io.BytesIO()
            np.save(buf, x)
            w.write({"__key__": f"{items.start:09d}", "x.npy": buf.getvalue(), "cls": label})
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run(work, root: Path, fmt: str, n: int, procs: int, merged: bool) -> dict:
    """One pass: `procs` processes (forked) write their slices, then the parts are merged."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    jobs = [(str(root / f"part-{k}"), fmt, _slice(n, procs, k)) for k in range(procs)]
    t = time.perf_counter()
    with mp.get_context("fork").Pool(procs) as pool:
        peaks = pool.map(work, jobs)
    if merged:
        merge([j[0] for j in jobs], root / "pack")
    seconds = time.perf_counter() - t
    size = sum(f.stat().st_size for j in jobs for f in Path(j[0]).rglob("*") if f.is_file())
    return {"seconds": seconds, "peak_rss": max(peaks), "bytes": size}  # the parts' bytes


def _dd(root: Path, nbytes: int) -> float:
    """Bytes per second dd writes to `root`'s disk (fsynced), 1 MiB blocks."""
    count = max(1, nbytes >> 20)
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={root / 'dd.bin'}", "bs=1M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t
    (root / "dd.bin").unlink()
    return (count << 20) / seconds


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--format", default="tar", choices=("tar", "mmap", "hdf5", "lmdb"))
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    n = 20_000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    procs = [int(p) for p in args.procs.split(",")]
    log = common.logger()
    try:
        import webdataset  # noqa: F401

        have_wds = True
    except ImportError:
        have_wds = False
    tmp = Path(tempfile.mkdtemp(prefix="convert-", dir=args.dir))
    candidates = {}
    for p in procs:
        candidates[f"gpufeed parts+merge, {p} proc"] = lambda p=p: _run(
            _gpufeed_part, tmp / "g", args.format, n, p, True
        )
        if have_wds:
            candidates[f"webdataset ShardWriter, {p} proc"] = lambda p=p: _run(
                _wds_part, tmp / "w", args.format, n, p, False
            )
    try:
        runs = common.interleaved(candidates, rounds, log)
        best = {name: min(r, key=lambda x: x["seconds"]) for name, r in runs.items()}
        pack_bytes = best[f"gpufeed parts+merge, {procs[0]} proc"]["bytes"]
        dd = common.best([_dd(tmp, max(pack_bytes, 64 << 20)) for _ in range(rounds)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rates = {name: n / b["seconds"] for name, b in best.items()}
    rates["MDS MDSWriter + merge_index"] = None  # mosaicml-streaming is not installed
    rates["LitData optimize"] = None  # litdata is not installed
    lines = [
        common.ratio_table(
            rates,
            f"gpufeed parts+merge, {procs[0]} proc",
            title=f"## Convert {n:,} samples of 64 B ({args.format}), parts + merge",
        ),
        "",
        f"dd bound: {dd / 2**20:,.0f} MiB/s to the same disk (fsynced)",
        "",
        "| candidate | peak RSS per process (MiB) | MiB/s written | share of dd |",
        "|---|---|---|---|",
    ]
    for name, b in best.items():
        mbps = b["bytes"] / b["seconds"]
        lines.append(
            f"| {name} | {b['peak_rss'] / 2**20:,.0f} | {mbps / 2**20:,.1f} | {mbps / dd:.2f} |"
        )
    for tool in ("gpufeed parts+merge", "webdataset ShardWriter"):
        first, last = f"{tool}, {procs[0]} proc", f"{tool}, {procs[-1]} proc"
        if first in rates and last in rates:
            lines.append(
                f"\n{tool}: {procs[-1]} procs / {procs[0]} proc = {rates[last] / rates[first]:.2f}x"
            )
    results = {"n": n, "format": args.format, "dd_bytes_per_s": dd, "runs": runs}
    common.write(args, "convert", results, "\n".join(lines))


if __name__ == "__main__":
    main()
