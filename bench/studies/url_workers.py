"""The tutorial line over a URL, its DataLoader workers forked against spawned, in one run.

    python -m bench.studies.url_workers [--samples 2000] [--sample-kib 16] [--workers 2]
                                        [--rounds 3] [--quick] [--out DIR] [--json FILE]

Starts a real S3 server on 127.0.0.1 (bench/s3server.py: rclone), uploads a tar pack, then in
interleaved rounds reads it with `open_dataset(url, cache_dir=..., map_style=True)` and a plain
`DataLoader(ds, batch_size=32, shuffle=True, num_workers=W, pin_memory=True)` started with
fork (each forked worker fetches through its helper process, storage/helper.py) and with
spawn (each worker imports torch and gpufeed): once with an empty cache (cold: open, first
batch, epoch), once with the cache filled (warm). Prints medians as spawn/fork ratios; this
is what `default_multiprocessing_context` is chosen by (docs/object-storage.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

from bench.s3server import S3Server
from bench.studies import common
from bench.studies.streaming import make_pack

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


def cold_then_warm(work: Path, context: str, workers: int) -> dict[str, float]:
    """One candidate's turn: an epoch into an empty cache, then one from the filled cache."""
    cache = work / f"cache-{context}"
    out = {}
    for state in ("cold", "warm"):
        first, total = one_epoch("s3://bench/pack", cache, workers, context)
        out[f"{state} first batch"], out[f"{state} epoch"] = first, total
    shutil.rmtree(cache)
    return out


def run(args) -> dict[str, list[dict[str, float]]]:
    """Each context's turns, one a round (the order rotated): seconds from open_dataset."""
    from gpufeed.storage import upload_pack

    with tempfile.TemporaryDirectory(prefix="gpufeed-urlworkers-") as tmp:
        work = Path(tmp)
        local = make_pack(work, args.samples, args.sample_kib)
        with S3Server("rclone", work / "s3data") as server:
            os.environ.update(server.env())
            server.make_bucket("bench")
            upload_pack(local, "s3://bench/pack")
            turns = {c: partial(cold_then_warm, work, c, args.workers) for c in CONTEXTS}
            return common.interleaved(turns, args.rounds)


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--samples", type=int, default=2000, help="(quick: 200)")
    p.add_argument("--sample-kib", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 200, 1
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # no accelerator on CPU hosts
    turns = run(args)
    head = (
        f"{args.samples} samples of {args.sample_kib} KiB, tar shards of 4 MiB, "
        f"DataLoader(batch_size=32, shuffle=True, num_workers={args.workers}, pin_memory=True), "
        f"medians of {args.rounds} interleaved rounds, seconds from open_dataset"
    )
    medians = {
        what: {c: common.median([t[what] for t in turns[c]]) for c in CONTEXTS}
        for what in turns[CONTEXTS[0]][0]
    }
    tables = [common.ratio_table(m, "fork", "seconds", title=what) for what, m in medians.items()]
    common.write(
        args, "url_workers", {"args": vars(args), "turns": turns}, "\n\n".join([head, *tables])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
