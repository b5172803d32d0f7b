"""Streaming tar shards: each rank and DataLoader worker reads its own equal share of the
samples in runs of consecutive samples (the next ones read ahead), through a seeded shuffle
buffer (gpufeed.data.shuffle_buffer)."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from gpufeed.batch import to_batch, to_samples
from gpufeed.data import distributed
from gpufeed.data.reading import SampleReading
from gpufeed.data.shuffle_buffer import SamplePool, make_pool
from gpufeed.errors import ShardSplitWarning, UsageError
from gpufeed.pagecache.copy import set_copy_threads
from gpufeed.storage.packs import open_reader_at

__all__ = ["SamplePool", "TarShardDataset"]  # SamplePool: gpufeed.data.shuffle_buffer

# concurrent downloads per reading process (a DataLoader worker) of a remote pack's shards
FETCH_WORKERS = 4
# how a stream's samples are split across ranks and workers (TarShardDataset's ``split``)
SPLITS = ("samples", "shards")
# the options replace() may change
REPLACEABLE = frozenset(
    ("rank", "world_size", "shuffle_buffer", "shuffle_shards", "seed", "read_size", "split")
)
# bytes of the runs to come that a stream has populated ahead of the one it reads (a local
# pack, cold: the read-ahead threads keep the disk busy while the pool is drawn from)
STREAM_AHEAD_BYTES = 16 << 20


class TarShardDataset(SampleReading, IterableDataset):
    """Streams tar shards: each rank and DataLoader worker reads its own share of the
    samples sequentially, through a seeded shuffle buffer.

    ``split="samples"`` (the default): every rank reads the same number of samples, so the
    same number of batches, and each worker of a rank as many as that worker on every other
    rank (gpufeed.data.distributed.split_samples): contiguous shares of the epoch's shard
    order, whole shards but at the shares' edges, and the last ``len % world_size`` samples
    (fewer than the ranks) skipped that epoch. ``split="shards"``: whole shards per rank and
    worker (split_shards), every sample read, but ranks whose counts differ leave DDP waiting
    at a collective: a ShardSplitWarning says so.

    Iterating yields samples, ``(image, label)`` as ``dataset[i]`` of the map-style datasets,
    so a plain ``DataLoader(dataset, batch_size=32, num_workers=4)`` works: its workers split
    the rank's share, every sample is read at most once. (``shuffle=True`` is PyTorch's error
    for any IterableDataset: this one shuffles itself, through ``shuffle_buffer`` and
    ``shuffle_shards``.) ``iter_batches`` is the fast path that make_loader uses.

    The rank and world size come from ``rank``/``world_size`` when given, else from
    ``torch.distributed`` or env ``RANK``/``WORLD_SIZE`` when iterating
    (:func:`gpufeed.data.distributed.rank_and_world`). Call set_epoch(epoch) before each epoch for
    a new shard order and buffer seed. shuffle_buffer=0 yields in storage order (of this
    worker's shards).
    """

    DEFAULT_SHUFFLE_BUFFER = 1000

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        seed: int = 0,
        shuffle_shards: bool = True,
        transform: Callable | None = None,
        batch_transform: Callable | None = None,
        verify_crc: bool = False,
        on_error: str = "raise",
        decode: bool = True,
        read_size: int = 64,
        rank: int | None = None,
        world_size: int | None = None,
        pad: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit: int | str | None = None,
        fetch_ahead: int = 2,
        split: str = "samples",
    ):
        reader = open_reader_at(path, cache_dir=cache_dir, cache_limit=cache_limit)
        if reader.format_name != "tar":
            raise UsageError(f"{path}: is a {reader.format_name} dataset, not tar shards")
        if split not in SPLITS:
            raise UsageError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
        if batch_transform is not None:
            raise UsageError("batch_transform applies to map-style datasets; use transform")
        self.path = str(path)
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.shuffle_shards = bool(shuffle_shards)
        self.read_size = int(read_size)
        self.fetch_ahead = int(fetch_ahead)
        self.rank, self.world_size = rank, world_size
        self.split = split
        self.epoch = 0
        self._init_reading(reader, transform, None, verify_crc, on_error, decode, pad)

    @property
    def shards(self) -> list[str]:
        return list(self.reader.shards)

    def _read_options(self) -> dict[str, Any]:
        return {
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle_shards": self.shuffle_shards,
            "read_size": self.read_size,
            "split": self.split,
        }

    def replace(self, **changes: Any) -> TarShardDataset:
        """A copy with some options changed (``rank``, ``world_size``, ``shuffle_buffer``,
        ``shuffle_shards``, ``seed``, ``read_size``, ``split``); this dataset stays as it is.
        make_loader uses it to apply its ``rank``/``world_size`` and ``shuffle`` arguments."""
        unknown = sorted(set(changes) - REPLACEABLE)
        if unknown:
            raise TypeError(f"replace() cannot change {', '.join(unknown)}")
        clone = copy.copy(self)
        for key, value in changes.items():
            setattr(clone, key, value)
        return clone

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _split(self, **worker) -> list[tuple[int, int, int]]:
        """This rank's and worker's ``(shard, first, stop)`` runs this epoch, ``first`` and
        ``stop`` sample numbers of the pack (see ``split``)."""
        start = self.reader.shard_start
        sizes = np.diff(start)
        common = dict(seed=self.seed, epoch=self.epoch, shuffle=self.shuffle_shards)
        place = dict(rank=self.rank, world_size=self.world_size, **worker)
        if self.split == "samples":
            runs = distributed.split_samples(sizes, **common, **place)
            return [(s, int(start[s]) + a, int(start[s]) + b) for s, a, b in runs]
        self._warn_uneven(sizes, common, worker)
        shards = distributed.split_shards(list(range(len(sizes))), **common, **place)
        return [(s, *self.reader.shard_range(s)) for s in shards]

    def _warn_uneven(self, sizes: np.ndarray, common: dict, worker: dict) -> None:
        """split="shards": a ShardSplitWarning (rank 0's first worker) when the ranks' sample
        counts differ this epoch, naming them."""
        rank, world = distributed.rank_and_world(self.rank, self.world_size)
        if rank != 0 or distributed.worker_and_count(**worker)[0] != 0:
            return
        counts = distributed.rank_counts_by_shards(sizes, world_size=world, **common)
        if len(set(counts)) > 1:
            warnings.warn(
                f"{self.path}: split='shards' gives the {world} ranks {counts} samples in "
                f"epoch {self.epoch}: the ranks that run out first stop while the others wait "
                f"at their next collective, and DDP hangs unless your loop handles it (Join); "
                f"the default split='samples' gives every rank the same number",
                ShardSplitWarning,
                stacklevel=3,
            )

    def my_shards(self) -> list[int]:
        """Shard numbers this rank and worker read this epoch, in reading order."""
        return [s for s, _, _ in self._split()]

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all its workers together)."""
        return sum(b - a for _, a, b in self._split(worker_id=0, num_workers=1))

    def _chunks(self, ranges: list[tuple[int, int, int]], size: int):
        """(indices, payloads) of up to ``size`` consecutive samples of one shard, each chunk
        one read, over ``ranges`` (shard, first, stop). A remote pack's shards are fetched
        ahead, in this order (fetch_ahead); a local pack's next runs are read ahead,
        STREAM_AHEAD_BYTES of them (_runs_ahead)."""
        shards = [s for s, _, _ in ranges]
        ranges = [(lo, hi) for _, lo, hi in ranges]
        runs = [(a, min(a + size, hi)) for lo, hi in ranges for a in range(lo, hi, size)]
        ahead = self._runs_ahead(runs)
        with self._fetch_ahead(shards) as fetched, contextlib.closing(ahead):
            for lo, hi in ranges:
                pin = next(fetched, None)
                for a in range(lo, hi, size):
                    next(ahead)
                    idx = np.arange(a, min(a + size, hi), dtype=np.int64)
                    keep, payloads = self._read(idx)
                    if len(keep):
                        yield idx[keep], payloads
                if pin is not None:
                    pin.release()  # the reader holds its own pin while the shard is open

    def _runs_ahead(self, runs: list[tuple[int, int]]):
        """A generator advanced once before each run is read: it announces the runs after
        it, up to STREAM_AHEAD_BYTES, to the reader's read-ahead threads
        (TarReader.read_runs_ahead); closed, it forgets those not read (a stream stopped
        early leaves no job behind)."""
        reader, k = self.reader, 0
        sizes = [reader.run_bytes(a, b) for a, b in runs]
        end, window = 1, 0  # runs k+1..end-1 are announced; window: their bytes
        try:
            for k in range(len(runs)):
                if 0 < k < end:
                    window -= sizes[k]
                end = max(end, k + 1)
                start = end
                while end < len(runs) and window < STREAM_AHEAD_BYTES:
                    window += sizes[end]
                    end += 1
                if end > start:
                    reader.read_runs_ahead(runs[start:end])
                yield
        finally:
            reader.ahead.forget([a for a, _ in runs[k:end]])

    def _fetch_ahead(self, shards: list[int]):
        """The shards' cached copies, fetched by a bounded pool ``fetch_ahead`` shards ahead
        of the one read (a remote pack); a local pack: nothing to fetch."""
        source = self.reader.source
        if source is None or not shards:
            return contextlib.nullcontext(iter(()))
        names = [self.reader.shards[s] for s in shards]
        ahead = max(1, self.fetch_ahead)
        return source.fetch_ahead(names, workers=min(ahead, FETCH_WORKERS), ahead=ahead)

    def _stream(self, batch_size: int, drop_last: bool):
        """(samples, labels, kept positions) of each batch of this rank's and worker's
        stream (see iter_batches)."""
        ranges = self._split()
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:  # a plain DataLoader's worker: the workers are the parallelism
            set_copy_threads(1)
        rng = np.random.default_rng([self.seed, self.epoch, worker, *(r[1] for r in ranges[:4])])
        shuffle = self.shuffle_buffer > 1
        keep_back = self.shuffle_buffer if shuffle else 0
        pool = None

        def draw(k: int) -> np.ndarray:
            if shuffle:
                return rng.choice(pool.size, k, replace=False)
            return np.arange(k)

        def decoded(idx: np.ndarray, payloads):
            samples, kept = self._to_tensors(idx, np.arange(len(idx)), payloads)
            return samples, self.reader.labels[idx[kept]], kept

        size = max(self.read_size, batch_size)
        gather = self._gather()
        for idx, payloads in self._chunks(ranges, size):
            if pool is None:
                pool = make_pool(payloads, keep_back + batch_size + size, shuffle, gather)
            pool.put(idx, payloads)
            while pool.size >= keep_back + batch_size:
                yield decoded(*pool.take(draw(batch_size)))
        while pool is not None and (pool.size >= batch_size or (pool.size and not drop_last)):
            yield decoded(*pool.take(draw(min(batch_size, pool.size))))

    def _gather(self):
        """How a shuffled stream gathers its batches from what it has read: the reader's
        own gather from its kept shard maps (TarReader.read_batch: read_rows) where the
        pack's samples sit at one stride a shard (a local pack of fixed-shape samples), so
        the buffer holds indices only; else None (the buffer copies or references the
        runs)."""
        reader = self.reader
        if getattr(reader, "strides", None) is None:
            return None
        return reader.read_batch

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        """The fast path: this rank's and worker's samples as Batches of ``batch_size`` (the
        last one shorter unless ``drop_last``), read in runs of consecutive samples (one read
        each), decoded a batch at a time. Shuffled through a buffer: a batch goes out only
        while at least ``shuffle_buffer`` samples stay behind, drawn uniformly from all held.
        make_loader iterates this; ``iter()`` yields the same kind of stream sample by
        sample."""
        for samples, labels, _ in self._stream(batch_size, drop_last):
            yield to_batch(samples, labels, self.pad, self.path)

    def __iter__(self):
        for samples, labels, kept in self._stream(self.read_size, False):
            yield from to_samples(
                self._samples_of(samples), labels, np.arange(len(kept)), len(kept)
            )

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sources"] = None
        return state

    def __repr__(self) -> str:
        where = "" if self.rank is None else f", rank {self.rank} of {self.world_size}"
        return f"TarShardDataset({self.path!r}, {len(self.reader.shards)} shards{where})"
