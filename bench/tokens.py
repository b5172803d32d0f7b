"""Token windows: gpufeed's open_dataset(block_size=) against nanoGPT's np.memmap loop and
the peers (LitData TokensLoader, MosaicML Streaming).

Windows of --block tokens (default 2,048) in random order, batches of --batch, from a uint16
token pack of --gb GB (default 1; documents of random lengths, the mmap format; two packs
of its halves for the mixture) and the same
stream as one flat .bin file (nanoGPT's train.bin). Conditions: cold (every file's pages
evicted with posix_fadvise(DONTNEED) before each pass) and warm; gpufeed through the plain
DataLoader with 0 and 2 workers. Rows, side by side in one run, rounds interleaved
(studies.common.interleaved):

- memmap (nanoGPT): nanoGPT's get_batch: np.memmap each batch, torch.stack of
  torch.from_numpy(data[i:i+B].copy()) (the tokens kept uint16, as gpufeed hands them out),
  in the training process;
- memmap Dataset w2: the same slices as a map-style Dataset (one np.memmap a process) in
  DataLoader(num_workers=2): what any loader pays to hand batches over from workers, the
  like-for-like baseline of the worker rows;
- gpufeed w0 / w2: DataLoader(open_dataset(pack, block_size=B), batch_size, shuffle=True,
  num_workers=0 / 2);
- make_loader auto / w2: gpufeed.make_loader(dataset, batch, shuffle=True) with its measured
  worker plan (num_workers="auto", the default) and with 2 workers (its block shuffle:
  random blocks of windows);
- mixture w0 / w2: mix([a, b], [0.7, 0.3]) of two packs of the stream's halves (the goal:
  within 5% of gpufeed at the same worker count);
- LitData w0 / w2, MDS w0 / w2 (bench/peers/token_windows.py: how each is written and read),
  where their packages are (the bench image), else skipped with the reason;
- read bound: the same windows' bytes read by os.pread from the .bin file (no tensors).

Each pass reads --batches batches; windows/s (the loaders' from their first batch on: the
workers' start left out) are reported with ratios to the memmap loop and, for the rows
with workers, to the memmap Dataset through the same workers.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from studies import common  # noqa: E402  (puts the repo and app/src on sys.path)

import gpufeed  # noqa: E402
from bench.pagecache import NOT_COLD, resident_fraction  # noqa: E402
from bench.peers import token_windows as peers  # noqa: E402
from gpufeed.pagecache.maps import forget_maps  # noqa: E402

DOC_MEAN = 4096  # tokens a document on average


def make_data(root: Path, gb: float, log) -> tuple[list[Path], Path]:
    """The token pack of the whole stream, two packs of its halves (for the mixture) and the
    .bin of the stream, made once."""
    packs = [root / "whole", root / "half0", root / "half1"]
    flat = root / "train.bin"
    if all((p / "manifest.json").exists() for p in packs) and flat.exists():
        return packs, flat
    tokens = int(gb * 1e9 / 2)
    rng = np.random.default_rng(0)
    log(f"writing {tokens:,} tokens: three mmap packs and {flat.name}")
    schema = {"tokens": "uint16[-1]"}
    with (
        open(flat, "wb") as out,
        gpufeed.Writer(packs[0], "mmap", schema=schema, quiet=True) as whole,
    ):
        for p, half in zip(packs[1:], (tokens // 2, tokens - tokens // 2), strict=True):
            left = half
            with gpufeed.Writer(p, "mmap", schema=schema, quiet=True) as w:
                while left > 0:
                    n = min(left, int(rng.integers(1, 2 * DOC_MEAN)))
                    doc = rng.integers(0, 50257, n, dtype=np.uint16)
                    w.write({"tokens": doc})
                    whole.write({"tokens": doc})
                    out.write(doc.tobytes())
                    left -= n
    return packs, flat


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a copy written in this run) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_of(packs: list[Path], flat: Path) -> list[Path]:
    return [flat] + [f for p in packs for f in p.iterdir() if f.is_file()]


def memmap_pass(flat: Path, order: np.ndarray, B: int, batch: int):
    import torch

    for lo in range(0, len(order), batch):
        data = np.memmap(flat, dtype=np.uint16, mode="r")  # nanoGPT: a new map each batch
        rows = [torch.from_numpy(data[i * B : (i + 1) * B].copy()) for i in order[lo : lo + batch]]
        x = torch.stack(rows)
        assert x.shape[1] == B


class MemmapWindows:
    """nanoGPT's slices as a map-style Dataset: window i of the .bin file, one np.memmap a
    process (opened in the worker, not pickled)."""

    def __init__(self, flat: Path, block: int):
        self.flat, self.block, self.data = str(flat), block, None

    def __len__(self) -> int:
        return os.path.getsize(self.flat) // (2 * self.block)

    def __getitem__(self, i: int):
        import torch

        if self.data is None:
            self.data = np.memmap(self.flat, dtype=np.uint16, mode="r")
        B = self.block
        return torch.from_numpy(self.data[i * B : (i + 1) * B].copy())

    def __getstate__(self):
        return {**self.__dict__, "data": None}


def read_bound_pass(flat: Path, order: np.ndarray, B: int, batch: int):
    fd = os.open(flat, os.O_RDONLY)
    try:
        for i in order.tolist():
            assert len(os.pread(fd, 2 * B, 2 * B * i)) == 2 * B
    finally:
        os.close(fd)


def loader_pass(dataset, workers: int, batch: int, batches: int, seed: int) -> float:
    """Windows/s from the first batch on (the workers' start left out: warm, it is most of
    a short pass on 2 CPUs; the memmap loop has none)."""
    import torch
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    dl = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, generator=g)
    t = None
    for k, _ in enumerate(dl):
        if k == 0:
            t = time.perf_counter()
        if k + 1 >= batches:
            break
    return (batches - 1) * batch / (time.perf_counter() - t)


def make_loader_pass(dataset, batch: int, batches: int, seed: int, workers, plans) -> float:
    """gpufeed.make_loader's block shuffle with ``workers`` ("auto": measured; the choice is
    kept in ``plans``): windows/s from the first batch on."""
    loader = gpufeed.make_loader(dataset, batch, shuffle=True, seed=seed, num_workers=workers)
    plans.append(loader.plan.num_workers)
    return timed_batches(loader, batch, batches)


def timed_batches(loader, batch: int, batches: int) -> float:
    """Windows/s of ``loader`` from its first batch on (``batches`` batches in all)."""
    t = None
    for k, _ in enumerate(loader):
        if k == 0:
            t = time.perf_counter()
        if k + 1 >= batches:
            break
    if t is None or k + 1 < batches:
        raise RuntimeError(f"the loader gave {k + 1} batches, {batches} wanted")
    return (batches - 1) * batch / (time.perf_counter() - t)


def peer_rows(args, root: Path, flat: Path, starts: np.ndarray, log) -> tuple[dict, list]:
    """LitData and MDS rows (their data written once under ``root``) and their files; each
    peer missing here is skipped, the reason printed."""
    B, batch, n = args.block, args.batch, args.batches
    rows: dict = {}
    files: list[Path] = []
    for peer in ("litdata", "mds"):
        why = peers.unavailable(peer)
        if why is not None:
            print(f"{peer} rows skipped: {why}", file=sys.stderr)
            continue
        out = root / f"{peer}-{B}"
        if not out.exists():
            log(f"writing the {peer} copy of the stream")
            tmp = root / f"{peer}-{B}.partial"
            if peer == "litdata":
                peers.write_litdata(tmp, flat, starts)
            else:
                peers.write_mds(tmp, flat, B)
            tmp.rename(out)
        files += [f for f in out.rglob("*") if f.is_file()]
        name = "LitData TokensLoader" if peer == "litdata" else "MDS"
        for w in (0, 2):
            if peer == "litdata":
                make = lambda k, w=w, out=out: peers.litdata_loader(out, B, batch, w, k)  # noqa: E731
            else:
                make = lambda k, w=w, out=out: peers.mds_loader(out, batch, w, k)  # noqa: E731
            rows[f"{name} w{w}"] = lambda o, k, make=make: timed_batches(make(k), batch, n)
    return rows, files


class Timed:
    """One pass of a row: a fresh random order of ``n`` windows, the files evicted first
    when cold (the datasets closed first: pages a process maps are not evicted); returns
    windows/s, NaN when the eviction left more than NOT_COLD of the files cached."""

    def __init__(self, fn, windows: int, n: int, evicted: list[Path] | None, datasets):
        self.fn, self.windows, self.n, self.evicted = fn, windows, n, evicted
        self.datasets = datasets
        self.rng = np.random.default_rng(1)
        self.k = 0

    def __call__(self) -> float:
        order = self.rng.choice(self.windows, self.n, replace=False)
        self.k += 1
        if self.evicted:
            gc.collect()  # the loaders of earlier passes (a peer's maps) gone
            for ds in self.datasets:
                ds.close()
            forget_maps()  # the maps this process keeps across readers
            evict(self.evicted)
            if resident_fraction([str(f) for f in self.evicted]) > NOT_COLD:
                return float("nan")
        t = time.perf_counter()
        rate = self.fn(order, self.k)
        return self.n / (time.perf_counter() - t) if rate is None else rate


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--gb", type=float, default=1.0, help="token data size (default 1 GB)")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=500, help="batches a pass")
    ap.add_argument("--data", type=Path, default=Path("/tmp/gpufeed-bench-tokens"))
    ap.add_argument("--rows", default=None, help="a regular expression: only the rows it finds")
    ap.add_argument("--conditions", default="cold,warm", help="cold, warm or both (default)")
    args = ap.parse_args()
    if args.quick:
        args.gb, args.batches, args.rounds = 0.02, 10, 1
    log = common.logger()
    args.data.mkdir(parents=True, exist_ok=True)
    packs, flat = make_data(args.data, args.gb, log)
    B, batch, n = args.block, args.batch, args.batch * args.batches
    whole = gpufeed.open_dataset(packs[0], block_size=B)
    halves = [gpufeed.open_dataset(p, block_size=B) for p in packs[1:]]
    mixture = gpufeed.mix(halves, [0.7, 0.3])
    datasets = [whole, mixture]
    windows = flat.stat().st_size // (2 * B)
    files = files_of(packs, flat)
    mm_dataset = MemmapWindows(flat, B)
    plans: list = []  # make_loader auto's worker counts
    rows = {
        "memmap (nanoGPT)": lambda o, k: memmap_pass(flat, o, B, batch),
        "memmap Dataset w2": lambda o, k: loader_pass(mm_dataset, 2, batch, args.batches, k),
        "gpufeed w0": lambda o, k: loader_pass(whole, 0, batch, args.batches, k),
        "gpufeed w2": lambda o, k: loader_pass(whole, 2, batch, args.batches, k),
        "make_loader auto": lambda o, k: make_loader_pass(
            whole, batch, args.batches, k, "auto", plans
        ),
        "make_loader w2": lambda o, k: make_loader_pass(whole, batch, args.batches, k, 2, []),
        "mixture 0.7/0.3 w0": lambda o, k: loader_pass(mixture, 0, batch, args.batches, k),
        "mixture 0.7/0.3 w2": lambda o, k: loader_pass(mixture, 2, batch, args.batches, k),
    }
    more, peer_files = peer_rows(args, args.data, flat, whole.starts, log)
    rows.update(more)
    rows["read bound (pread)"] = lambda o, k: read_bound_pass(flat, o, B, batch)
    files += peer_files
    if args.rows:
        rows = {k: v for k, v in rows.items() if re.search(args.rows, k)}
    results: dict = {}
    conditions = args.conditions.split(",")
    for cold in [c == "cold" for c in ("cold", "warm") if c in conditions]:
        if not cold:  # warm: every file read once before the passes
            for f in files:
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass
        evicted = files if cold else None
        timed = {name: Timed(fn, windows, n, evicted, datasets) for name, fn in rows.items()}
        got = common.interleaved(timed, args.rounds, log)
        results["cold" if cold else "warm"] = {k: common.best(v) for k, v in got.items()}
    results["make_loader auto workers"] = sorted(set(plans))
    md = [
        f"Token windows of {B} tokens, batches of {batch}, random order, "
        f"{flat.stat().st_size / 1e9:.2f} GB uint16 stream, {os.cpu_count()} CPUs, "
        f"best of {args.rounds} rounds; make_loader auto chose num_workers={sorted(set(plans))}",
        "",
        table(results),
    ]
    common.write(args, "tokens", results, "\n".join(md))


def table(results: dict) -> str:
    """One markdown table: each row's windows/s cold and warm, against the memmap loop and,
    for rows through workers (" w2"), the memmap Dataset through the same workers."""
    conds = [c for c in ("cold", "warm") if c in results]
    head = "| candidate | " + " | ".join(
        f"{c} windows/s | {c} vs memmap loop | {c} vs memmap Dataset w2" for c in conds
    )
    lines = [head + " |", "|---|" + "---|---|---|" * len(conds)]
    for name in results[conds[0]]:
        cells = []
        for c in conds:
            v = results[c].get(name)
            loop, w2 = results[c].get("memmap (nanoGPT)"), results[c].get("memmap Dataset w2")
            like = f"{v / w2:.2f}x" if name.endswith(" w2") and w2 else ""
            cells += [f"{v:,.0f}", f"{v / loop:.2f}x" if loop else "", like]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
