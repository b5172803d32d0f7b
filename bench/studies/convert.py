"""Converting with several processes: gpufeed parts + merge against the peers and the disk.

    python -m bench.studies.convert [--n 1000000] [--jpegs 100000] [--procs 1,2,4]
                                    [--formats tar] [--kinds raw,jpeg] [--only NAME,...]
                                    [--rounds 3] [--quick] [--dir DIR] [--out DIR] [--json FILE]

Two cases: ``raw``, N samples of a 1 KiB uint8 array and an int class; ``jpeg``, JPEGS
samples of a 64x64 JPEG (~2-3 KiB, its bytes stored as they are) and a class. Each is
converted by P processes, each writing its slice:

- gpufeed: one ``gpufeed.Writer`` per process writing a part (``write`` a sample at a
  time, and for raw also ``write_batch`` of 4,096-sample columns), then ``gpufeed.merge``
  makes one pack of the parts (hard links: no sample copied);
- MDS: one ``MDSWriter`` per process into its own folder, then
  ``streaming.base.util.merge_index`` (mosaicml-streaming's recipe for partitions);
- LitData: ``litdata.optimize(fn, chunks, num_workers=P)`` (it starts its own workers);
- WebDataset: one ``ShardWriter`` per process.

A peer whose package is missing is a row saying "not run" and why. Every pass runs in a fresh
forked process (its imports done before the clock starts); the timed span is the writing
processes and the merge. Per pass: samples/s, MiB/s of the files written (what the disk
took: tar pads each member to 512 bytes) and of the samples' own bytes (payload), the peak
resident memory of each writing process (the largest ``ru_maxrss`` of the pass's child
processes, and its growth: that less what a process forked from the pass starts with, the
pages it shares with the parent, torch's among them) and the P / 1 process ratio. The
physical bound is ``dd``: as many bytes written to the same disk, fsynced, in 1 MiB blocks;
a candidate's written bytes/s over dd's is its share of the disk. Passes are
interleaved round by round (bench/studies/common.py); the best pass of each is reported.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from bench.studies import common
from gpufeed.write.merge import merge
from gpufeed.write.writer import Writer  # imported before any clock, as the peers' are

RAW_BYTES = 1024
BATCH = 4096  # write_batch's columns
JPEGS = 64  # distinct pictures the jpeg case cycles through
SCHEMAS = {
    "raw": {"x": f"uint8[{RAW_BYTES}]", "label": "int"},
    "jpeg": {"image": "jpeg", "label": "int"},
}


# --------------------------------------------------------------------------- the samples
def _pool(kind: str) -> list:
    """The values the samples cycle through (made once, before any clock starts)."""
    if kind == "raw":
        return [
            np.full(RAW_BYTES, k, np.uint8) + np.arange(RAW_BYTES, dtype=np.uint8)
            for k in range(256)
        ]
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(JPEGS):
        pic = (rng.random((8, 8, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pic).resize((64, 64), Image.BILINEAR).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _slice(n: int, procs: int, k: int) -> range:
    per = -(-n // procs)
    return range(k * per, min(n, (k + 1) * per))


def _payload(kind: str, pool: list, n: int) -> int:
    """The samples' own bytes (value + an 8-byte class)."""
    each = [len(v) if isinstance(v, bytes) else v.nbytes for v in pool]
    return sum(each[i % len(pool)] for i in range(min(n, len(pool)))) * (n // len(pool)) + 8 * n


# --------------------------------------------------------------------------- the writers
def _gpufeed(kind: str, pool: list, dest: str, items: range, fmt: str, batch: bool) -> None:
    field = "x" if kind == "raw" else "image"
    with Writer(dest, format=fmt, schema=SCHEMAS[kind]) as w:
        if not batch:
            m = len(pool)
            for i in items:
                w.write({field: pool[i % m], "label": i % 1000})
            return
        block = np.stack([pool[j % len(pool)] for j in range(BATCH)])  # 4096 = 16 x 256
        for a in range(items.start, items.stop, BATCH):
            b = min(items.stop, a + BATCH)
            w.write_batch({field: block[: b - a], "label": np.arange(a, b) % 1000})


def _mds(kind: str, pool: list, dest: str, items: range) -> None:
    from streaming import MDSWriter

    field = "x" if kind == "raw" else "image"
    columns = {field: f"ndarray:uint8:{RAW_BYTES}" if kind == "raw" else "bytes", "label": "int"}
    m = len(pool)
    with MDSWriter(out=dest, columns=columns, size_limit=64 << 20) as w:
        for i in items:
            w.write({field: pool[i % m], "label": i % 1000})


def _wds(kind: str, pool: list, dest: str, items: range) -> None:
    import webdataset as wds

    os.makedirs(dest, exist_ok=True)
    ext = "x.npy" if kind == "raw" else "jpg"  # an array is saved by its .npy encoder
    m = len(pool)
    pattern = os.path.join(dest, "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=10**6, maxsize=64 << 20, verbose=0) as w:
        for i in items:
            w.write({"__key__": f"{i:09d}", ext: pool[i % m], "cls": i % 1000})


class _LitSlice:
    """litdata.optimize's fn: a chunk of item numbers -> its samples (yielded)."""

    def __init__(self, kind: str, pool: list):
        self.field, self.pool = ("x" if kind == "raw" else "image"), pool

    def __call__(self, chunk: tuple[int, int]):
        m = len(self.pool)
        for i in range(*chunk):
            yield {self.field: self.pool[i % m], "label": i % 1000}


# --------------------------------------------------------------------------- one pass
def _parts(work: Callable, root: Path, n: int, procs: int) -> list[str]:
    """`procs` forked processes, each writing its slice to root/part-k."""
    dests = [str(root / f"part-{k}") for k in range(procs)]
    jobs = [(work, d, _slice(n, procs, k)) for k, d in enumerate(dests)]
    with mp.get_context("fork").Pool(procs) as pool:
        pool.map(_run_job, jobs)
    return dests


def _run_job(job) -> None:
    work, dest, items = job
    work(dest, items)


def _convert(tool: str, kind: str, pool: list, root: Path, n: int, procs: int) -> None:
    """One conversion, parts and merge included."""
    if tool.startswith("gpufeed"):
        fmt, batch = tool.split()[1], "write_batch" in tool
        dests = _parts(partial(_gpufeed, kind, pool, fmt=fmt, batch=batch), root, n, procs)
        merge(dests, root / "pack")
    elif tool == "MDS":
        from streaming.base.util import merge_index

        _parts(partial(_mds, kind, pool), root, n, procs)
        merge_index(str(root), keep_local=True)
    elif tool == "WebDataset":
        _parts(partial(_wds, kind, pool), root, n, procs)
    elif tool == "LitData":
        from litdata import optimize

        step = max(1, n // (64 * procs))
        chunks = [(a, min(n, a + step)) for a in range(0, n, step)]
        optimize(
            fn=_LitSlice(kind, pool),
            inputs=chunks,
            output_dir=str(root / "out"),
            num_workers=procs,
            chunk_bytes="64MB",
        )
    else:
        raise ValueError(tool)


def _child(tool, kind, pool, root, n, procs, conn) -> None:
    """A pass in a fresh process: its seconds, the bytes it wrote and its writing
    processes' peak RSS (the children it waited for), sent back."""
    try:
        import contextlib

        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        start_rss = _rss()
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            _convert(tool, kind, pool, root, n, procs)
        seconds = time.perf_counter() - t
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
        if tool.startswith("gpufeed"):  # the merged pack's files are the parts' (hard links)
            size = sum(f.stat().st_size for f in (root / "pack").rglob("*") if f.is_file())
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        conn.send({"seconds": seconds, "bytes": size, "peak_rss": peak, "start_rss": start_rss})
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rss() -> int:
    """This process's resident bytes now (what a process forked from it starts with)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pass(tool: str, kind: str, pool: list, root: Path, n: int, procs: int) -> dict:
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(tool, kind, pool, root, n, procs, send))
    p.start()
    got = recv.recv()
    p.join()
    said = got.get("error") or f"{n / got['seconds']:,.0f} samples/s, {got['bytes']:,} bytes"
    common.logger()(f"{tool}, {procs} proc ({kind}): {said}")  # as it goes: a long run's record
    return got


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


# --------------------------------------------------------------------------- the study
def available() -> dict[str, str | None]:
    """Each peer: None where it runs, else why not."""
    why = {}
    for tool, module in (
        ("MDS", "streaming"),
        ("LitData", "litdata"),
        ("WebDataset", "webdataset"),
    ):
        try:
            __import__(module)
            why[tool] = None
        except Exception as e:  # noqa: BLE001 - any import failure: the row says it
            why[tool] = f"{module} not importable ({type(e).__name__}: {e})"
    return why


def tools(kind: str, formats: list[str]) -> list[str]:
    names = [f"gpufeed {f} write" for f in formats]
    if kind == "raw":
        names += [f"gpufeed {f} write_batch" for f in formats]
    return [*names, "MDS", "LitData", "WebDataset"]


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n", type=int, default=1_000_000, help="raw samples (default 1,000,000)")
    ap.add_argument("--jpegs", type=int, default=100_000, help="JPEG samples (default 100,000)")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--formats", default="tar", help="gpufeed formats, e.g. tar,lmdb")
    ap.add_argument("--kinds", default="raw,jpeg")
    ap.add_argument("--only", default="", help="candidates to run (names as in the table)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    quick = args.quick
    counts = {"raw": args.n, "jpeg": args.jpegs}
    if quick:  # at most this many: that everything runs
        counts = {"raw": min(args.n, 20_000), "jpeg": min(args.jpegs, 2_000)}
    rounds = 1 if quick else args.rounds
    procs = [int(p) for p in args.procs.split(",")]
    formats = args.formats.split(",")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    log = common.logger()
    missing = available()
    tmp = Path(tempfile.mkdtemp(prefix="convert-", dir=args.dir))
    results: dict = {"procs": procs, "formats": formats, "missing": missing, "cases": {}}
    sections = []
    try:
        for kind in args.kinds.split(","):
            n, pool = counts[kind], _pool(kind)
            names = [t for t in tools(kind, formats) if not only or t in only]
            run = [t for t in names if not missing.get(t)]
            candidates = {
                f"{t}, {p} proc": partial(_pass, t, kind, pool, tmp / "c", n, p)
                for t in run
                for p in procs
            }
            runs = common.interleaved(candidates, rounds, log)
            best = {}
            for name, passes in runs.items():
                ok = [r for r in passes if "error" not in r]
                best[name] = min(ok, key=lambda r: r["seconds"]) if ok else passes[0]
            written = max((b.get("bytes", 0) for b in best.values()), default=0)
            dd = common.best([_dd(tmp, max(written, 256 << 20)) for _ in range(rounds)])
            payload = _payload(kind, pool, n)
            results["cases"][kind] = {
                "n": n,
                "payload_bytes": payload,
                "dd_bytes_per_s": dd,
                "runs": runs,
            }
            sections.append(_table(kind, n, payload, dd, names, procs, best, missing))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    common.write(args, "convert", results, "\n\n".join(sections))


def _table(kind, n, payload, dd, names, procs, best, missing) -> str:
    """One case's markdown: a row per candidate and process count."""
    what = f"{RAW_BYTES} B uint8 + class" if kind == "raw" else "64x64 JPEG + class"
    lines = [
        f"## {n:,} samples of {what}, {payload / n:,.0f} B each (parts + merge where the tool "
        "has it)",
        "",
        f"dd bound: {dd / 2**20:,.0f} MiB/s to the same disk (fsynced, 1 MiB blocks); "
        f"{os.cpu_count()} CPUs (more processes than CPUs oversubscribe)",
        "",
        "| candidate | procs | samples/s | vs gpufeed write, same procs | written MiB/s "
        "| share of dd | payload MiB/s | peak RSS / process, growth (MiB) | P / 1 proc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tool in names:
        if missing.get(tool):
            lines.append(f"| {tool} | | not run: {missing[tool]} | | | | | | |")
            continue
        for p in procs:
            b = best[f"{tool}, {p} proc"]
            if "error" in b:
                lines.append(f"| {tool} | {p} | failed: {b['error'][:120]} | | | | | | |")
                continue
            rate = n / b["seconds"]
            ref = best.get(f"{names[0]}, {p} proc", {})
            vs = f"{rate * ref['seconds'] / n:.2f}x" if "seconds" in ref else ""
            one = best.get(f"{tool}, {procs[0]} proc", {})
            scale = f"{one['seconds'] / b['seconds']:.2f}x" if "seconds" in one else ""
            mbps, rss = b["bytes"] / b["seconds"] / 2**20, b["peak_rss"] / 2**20
            grown = (b["peak_rss"] - b["start_rss"]) / 2**20
            lines.append(
                f"| {tool} | {p} | {rate:,.0f} | {vs} | {mbps:,.1f} | {mbps * 2**20 / dd:.2f} "
                f"| {payload / b['seconds'] / 2**20:,.1f} | {rss:,.0f}, +{grown:,.0f} | {scale} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
