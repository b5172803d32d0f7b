"""A pack streamed from object storage against the same pack on local disk, in one run.

    python -m bench.streaming [--samples 4000] [--sample-kib 16] [--rounds 3]

Starts a real S3 server on 127.0.0.1 (bench/s3server.py: rclone), packs synthetic array
samples into tar shards, uploads them, then reads them through make_loader (in-process, so
only the data path is measured): a cold first epoch from the store into an empty cache, then
rounds that alternate a second epoch from the cache with an epoch of the same pack on local
disk (both warm in the page cache). Prints samples/s, bytes fetched, time to first batch and
peak cache size, and the cache epoch's rate as a ratio to local disk (goal: within 10%).

Ratios only: the machine is shared and noisy. LitData and MosaicML Streaming are not in this
run yet (docs/object-storage.md says what is missing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.s3server import S3Server


def make_pack(work: Path, samples: int, sample_kib: int) -> Path:
    from gpufeed.write.pack import pack

    src = work / "src"
    rng = np.random.default_rng(0)
    for i in range(samples):
        folder = src / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i:06d}.npy", rng.integers(0, 255, sample_kib << 10, dtype=np.uint8))
    dest = work / "pack"
    pack(src, dest, "tar", shard_bytes=4 << 20, quiet=True)
    return dest


def epoch(dataset, epoch_no: int) -> tuple[float, float, int]:
    """(samples/s, seconds to the first batch, samples) of one pass through make_loader."""
    from gpufeed.loading.make import make_loader

    dataset.set_epoch(epoch_no)
    loader = make_loader(dataset, 256, num_workers=0, check_shm=False)
    loader.set_epoch(epoch_no)
    start = time.perf_counter()
    first = None
    n = 0
    for batch in loader:
        first = first if first is not None else time.perf_counter() - start
        n += len(batch.labels)
    return n / (time.perf_counter() - start), first or 0.0, n


def cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "objects").rglob("*") if p.is_file())


def run(args) -> dict:
    from gpufeed.data.open import open_dataset
    from gpufeed.storage import upload_pack

    with tempfile.TemporaryDirectory(prefix="gpufeed-stream-") as tmp:
        work = Path(tmp)
        local = make_pack(work, args.samples, args.sample_kib)
        with S3Server("rclone", work / "s3data") as server:
            os.environ.update(server.env())
            server.make_bucket("bench")
            upload_pack(local, "s3://bench/pack")
            cache = work / "cache"
            remote = open_dataset(
                "s3://bench/pack", cache_dir=cache, map_style=False, shuffle_buffer=0
            )
            cold_rate, cold_first, n = epoch(remote, 0)
            stats = remote.reader.source.stats.as_dict()
            peak = cache_bytes(cache)
            disk = open_dataset(local, map_style=False, shuffle_buffer=0)
            epoch(disk, 0)  # warm the page cache as the cold epoch warmed the cache's files
            rates = {"cache": [], "local": []}
            for r in range(args.rounds):
                order = ("cache", "local") if r % 2 == 0 else ("local", "cache")
                for which in order:
                    ds = remote if which == "cache" else disk
                    rates[which].append(epoch(ds, 1 + r)[0])
            fetched_after = remote.reader.source.stats.bytes_fetched
    return {
        "samples": n,
        "cold_rate": cold_rate,
        "cold_first_batch_s": cold_first,
        "bytes_fetched_cold": stats["bytes_fetched"],
        "bytes_fetched_later": fetched_after - stats["bytes_fetched"],
        "peak_cache_bytes": peak,
        "cache_rate": statistics.median(rates["cache"]),
        "local_rate": statistics.median(rates["local"]),
        "rounds": rates,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--sample-kib", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    r = run(p.parse_args(argv))
    ratio = r["cache_rate"] / r["local_rate"]
    cold = r["cold_rate"] / r["local_rate"]
    rounds = {k: [round(x) for x in v] for k, v in r["rounds"].items()}
    lines = [
        f"{r['samples']} samples, tar shards of 4 MiB, make_loader in-process, round medians",
        f"  cold epoch from the store / local disk, samples/s: {cold:.2f}x",
        f"  time to first batch, cold: {r['cold_first_batch_s'] * 1000:.0f} ms",
        f"  bytes fetched, cold epoch: {r['bytes_fetched_cold']:,}",
        f"  bytes fetched, later epochs: {r['bytes_fetched_later']:,}",
        f"  peak cache size: {r['peak_cache_bytes']:,} bytes",
        f"  second epoch from the cache / local disk, samples/s: {ratio:.2f}x (goal >= 0.90)",
        f"  samples/s per round: {rounds}",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
