"""The tutorial line over a URL, its DataLoader workers forked against spawned, in one run.

    python -m bench.url_workers [--samples 2000] [--sample-kib 16] [--workers 2] [--rounds 3]

Starts a real S3 server on 127.0.0.1 (bench/s3server.py: rclone), uploads a tar pack, then in
interleaved rounds reads it with `open_dataset(url, cache_dir=..., map_style=True)` and a plain
`DataLoader(ds, batch_size=32, shuffle=True, num_workers=W, pin_memory=True)` started with
fork (each forked worker fetches through its helper process, storage/helper.py) and with
spawn (each worker imports torch and gpufeed): once with an empty cache (cold: open, first
batch, epoch), once with the cache filled (warm). Prints medians as spawn/fork ratios; this
is what `default_multiprocessing_context` is chosen by (docs/object-storage.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench.s3server import S3Server
from bench.streaming import make_pack

CONTEXTS = ("fork", "spawn")


def one_epoch(url: str, cache: Path, workers: int, context: str) -> tuple[float, float]:
    """(seconds from open_dataset to the first batch, seconds for the whole epoch)."""
    from torch.utils.data import DataLoader

    from gpufeed.data.open import open_dataset

    start = time.perf_counter()
    ds = open_dataset(url, cache_dir=cache, map_style=True)
    loader = DataLoader(
        ds,
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        pin_memory=True,
        multiprocessing_context=context,
    )
    first = None
    for _ in loader:
        first = first if first is not None else time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start


def run(args) -> dict[str, dict[str, list[float]]]:
    from gpufeed.storage import upload_pack

    times: dict[str, dict[str, list[float]]] = {
        f"{state} {what}": {c: [] for c in CONTEXTS}
        for state in ("cold", "warm")
        for what in ("first batch", "epoch")
    }
    with tempfile.TemporaryDirectory(prefix="gpufeed-urlworkers-") as tmp:
        work = Path(tmp)
        local = make_pack(work, args.samples, args.sample_kib)
        with S3Server("rclone", work / "s3data") as server:
            os.environ.update(server.env())
            server.make_bucket("bench")
            upload_pack(local, "s3://bench/pack")
            for r in range(args.rounds):
                for context in CONTEXTS if r % 2 == 0 else CONTEXTS[::-1]:
                    cache = work / f"cache-{context}-{r}"
                    for state in ("cold", "warm"):
                        first, total = one_epoch("s3://bench/pack", cache, args.workers, context)
                        times[f"{state} first batch"][context].append(first)
                        times[f"{state} epoch"][context].append(total)
                    shutil.rmtree(cache)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--sample-kib", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator on CPU hosts
    times = run(args)
    print(
        f"{args.samples} samples of {args.sample_kib} KiB, tar shards of 4 MiB, "
        f"DataLoader(batch_size=32, shuffle=True, num_workers={args.workers}, pin_memory=True), "
        f"medians of {args.rounds} interleaved rounds, seconds from open_dataset"
    )
    for row, by in times.items():
        fork, spawn = (statistics.median(by[c]) for c in CONTEXTS)
        print(f"  {row:17s} spawn / fork: {spawn / fork:5.2f}x   (fork {fork:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
