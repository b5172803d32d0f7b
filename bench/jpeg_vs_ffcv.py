"""JPEG decode + RandomResizedCrop + flip against FFCV, interleaved in one process.

    python -m bench.jpeg_vs_ffcv --data DIR [--rounds 3] [--cap 2] [--cold]

On a shared machine the load changes between the suite's rows (each runs all its passes in
turn), so a row measured at a busy moment looks slow against one measured at a quiet one.
Here each round runs one FFCV pass, then for each gpufeed format one pass in-process (the
native decoder on all the loader's CPUs) and one with 2 workers (the CPUs shared), and every
gpufeed pass is divided by that round's FFCV pass. Prints the per-round ratios and their
medians. Needs the suite's stored jpeg case (``python -m bench.suite --cases jpeg --rows
'gpufeed|ffcv'`` once, same ``--data``) and the bench image (FFCV).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

from bench import data as bdata
from bench import peers as bpeers
from bench import suite

FORMATS = ("lmdb", "hdf5", "tar", "mmap")
WORKERS = (0, 2)


def gpufeed_pass(case, fmt: str, workers: int, seed: int, cap: float, cold: bool) -> float:
    import gpufeed
    from gpufeed.tools.timing import stop_workers, time_batches

    path = suite.store_dir(case, f"gpufeed:{fmt}")
    if cold:
        suite.evict(suite.data_files(path))
    opts = {"decode": gpufeed.RandomResizedCrop(case.crop)}
    if fmt == "tar":
        opts.update(
            map_style=False,  # streamed whole shards, as the suite's tar row
            shuffle_buffer=bdata.shuffle_buffer(case),
            shuffle_shards=True,
            seed=seed,
        )
    ds = gpufeed.open_dataset(path, **opts)
    loader = gpufeed.make_loader(ds, 256, shuffle=True, seed=seed, num_workers=workers)
    try:
        return time_batches(loader, max_samples=case.count, max_seconds=cap).samples_per_s
    finally:
        stop_workers(loader)
        (getattr(ds, "close", None) or ds.reader.close)()


def ffcv_pass(case, seed: int, cap: float, cold: bool) -> float:
    from gpufeed.tools.timing import time_batches

    path = suite.store_dir(case, "peer:ffcv")
    if cold:
        suite.evict(suite.data_files(path))
    batches = bpeers.load("ffcv").batches(
        case, path, shuffle=True, workers=2, batch_size=256, seed=seed
    )
    rate = time_batches(batches, max_samples=case.count, max_seconds=cap).samples_per_s
    batches.close()
    del batches
    gc.collect()
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="/tmp/gpufeed-bench", help="the suite's data folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap", type=float, default=2.0, help="seconds per pass")
    ap.add_argument("--cold", action="store_true", help="evict the files before each pass")
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args(argv)
    case = next(c for c in bdata.cases(Path(args.data) / "full", False) if c.name == "jpeg")
    formats = args.formats.split(",")
    ffcv_pass(case, 0, args.cap, args.cold)  # FFCV compiles its pipeline at its first loader
    ratios: dict[str, list[float]] = {f"{f}:w{w}": [] for f in formats for w in WORKERS}
    for rnd in range(args.rounds):
        base = ffcv_pass(case, rnd + 1, args.cap, args.cold)
        line = [f"round {rnd}: ffcv {base:,.0f}/s"]
        for fmt in formats:
            for w in WORKERS:
                rate = gpufeed_pass(case, fmt, w, rnd + 1, args.cap, args.cold)
                ratios[f"{fmt}:w{w}"].append(rate / base)
                line.append(f"{fmt} w{w} {rate:,.0f}/s {rate / base:.2f}x")
        print("; ".join(line), flush=True)
    print("median ratio to the same round's FFCV pass:")
    for key, values in ratios.items():
        print(f"  {key}: {statistics.median(values):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
