"""Datasets over packed formats: map-style (HDF5, LMDB, mmap, and tar via its index) and an
iterable one over tar shards.

Every dataset honours PyTorch's Dataset contract, so tutorial code works unchanged:
``DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4, pin_memory=True)``, a custom
``collate_fn``, ``Subset``, ``random_split``, ``ConcatDataset``, ``DistributedSampler``.

- ``dataset[i]`` (an int, a numpy integer or a 0-d integer tensor; negatives count from the
  end, as in Python) is one sample, ``(image, label)`` (see :mod:`gpufeed.batch`); out of range
  raises ``IndexError``. A slice, list, tuple or 1-d array/tensor of indices gives the list of
  those samples (as ``__getitems__``; torch's ``Subset`` indexes with lists the same way).
- ``__getitems__(indices)``, which the DataLoader calls with a whole batch of indices, returns
  the list of samples ``dataset[i]`` returns for each: read in one storage round trip, decoded
  as a batch, then split into per-sample views (no copy) for ``collate_fn`` to combine.
- ``get_batch(indices)`` is the fast path: the same read, handed out as one
  :class:`~gpufeed.batch.Batch` (one stacked tensor + int64 labels), so there is nothing left
  to collate and worker processes pass one shared-memory segment per batch.
  :func:`gpufeed.make_loader` uses it; call it yourself in a loop of your own.

Every dataset is safe to build in the parent and use in DataLoader workers under fork or
spawn: the storage handle is opened lazily in the process that reads (and reopened after a
fork), and pickling drops it. The per-sample index (labels, crc32, offsets) lives in numpy
arrays, never per-sample Python objects, so workers do not copy-on-read it page by page.
"""

from __future__ import annotations

import copy
import hashlib
import json
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from gpufeed.batch import Batch, collate, stack, to_batch, to_samples
from gpufeed.decoders import array_to_tensor, decode_bytes, raw_bytes_tensor
from gpufeed.formats import open_reader
from gpufeed.formats.common import (
    CorruptSampleError,
    Reader,
    UsageError,
    as_index_array,
    crc32,
    row_crcs,
    take_rows,
)

__all__ = [
    "Batch",
    "HDF5Dataset",
    "LMDBDataset",
    "MmapDataset",
    "PackedDataset",
    "TarIndexedDataset",
    "TarShardDataset",
    "collate",
    "open_dataset",
]

ON_ERROR = ("raise", "skip")


def _one_index(index) -> int:
    """An index as Python takes one: int, numpy integer, 0-d integer tensor."""
    if isinstance(index, torch.Tensor) and (index.dim() != 0 or index.is_floating_point()):
        raise TypeError(f"dataset index must be an integer or a 0-d integer tensor, got {index!r}")
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(
            f"dataset indices must be integers, slices or sequences of integers, not "
            f"{type(index).__name__}"
        ) from None


def _many_indices(index) -> bool:
    if isinstance(index, (list, tuple, range)):
        return True
    return isinstance(index, (np.ndarray, torch.Tensor)) and index.ndim == 1


class _SamplePool:
    """The samples read and not yet handed out, held as references, not copies: which chunk
    (as read) and which row in it. ``take`` gathers from each chunk its positions point
    into, once, straight into the batch: one copy per sample. A chunk is dropped when no
    position points into it any more."""

    def __init__(self) -> None:
        self.chunk = np.empty(0, dtype=np.int64)
        self.row = np.empty(0, dtype=np.int64)
        self.chunks: dict[int, list] = {}  # id -> [indices, payloads, torch rows, live]
        self._next = 0

    @property
    def size(self) -> int:
        return len(self.chunk)

    def put(self, idx: np.ndarray, payloads) -> None:
        cid, self._next = self._next, self._next + 1
        rows = None
        if isinstance(payloads, np.ndarray) and not payloads.flags.c_contiguous:
            # members at a fixed stride in a read-only map: torch's index_select reads such
            # rows in place, where np.take would first copy the whole chunk
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "not writable": only read
                rows = torch.from_numpy(payloads.reshape(len(idx), -1).view(np.uint8))
        self.chunks[cid] = [idx, payloads, rows, len(idx)]
        self.chunk = np.concatenate([self.chunk, np.full(len(idx), cid, dtype=np.int64)])
        self.row = np.concatenate([self.row, np.arange(len(idx), dtype=np.int64)])

    def take(self, positions: np.ndarray):
        """(indices, payloads) at ``positions``, removed from the pool, grouped by the chunk
        they were read in (storage order when ``positions`` is sorted)."""
        chunk_of, rows = self.chunk[positions], self.row[positions]
        order = np.argsort(chunk_of, kind="stable")
        chunk_of, rows = chunk_of[order], rows[order]
        keep = np.ones(self.size, dtype=bool)
        keep[positions] = False
        self.chunk, self.row = self.chunk[keep], self.row[keep]
        ids, starts, counts = np.unique(chunk_of, return_index=True, return_counts=True)
        n = len(positions)
        out_idx = np.empty(n, dtype=np.int64)
        first = self.chunks[int(ids[0])][1]
        if isinstance(first, np.ndarray):
            out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
            out_rows = torch.from_numpy(out.reshape(n, -1).view(np.uint8))
        else:
            out = [None] * n
        for cid, a, k in zip(ids.tolist(), starts.tolist(), counts.tolist(), strict=True):
            entry = self.chunks[cid]
            r = rows[a : a + k]
            out_idx[a : a + k] = entry[0][r]
            if entry[2] is not None:
                torch.index_select(entry[2], 0, torch.from_numpy(r), out=out_rows[a : a + k])
            elif isinstance(out, np.ndarray):
                take_rows(entry[1], r, out[a : a + k])
            else:
                out[a : a + k] = [entry[1][i] for i in r.tolist()]
            entry[3] -= k
            if entry[3] == 0:
                del self.chunks[cid]
        return out_idx, out


class _SampleReading:
    """What map-style and iterable datasets share: turning stored bytes into checked tensors."""

    reader: Reader
    transform: Callable | None
    verify_crc: bool
    on_error: str
    decode: bool | Callable

    def _init_reading(self, reader, transform, batch_transform, verify_crc, on_error, decode):
        if on_error not in ON_ERROR:
            raise UsageError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.reader = reader
        self.transform = transform
        self.batch_transform = batch_transform
        self.verify_crc = bool(verify_crc)
        self.on_error = on_error
        if callable(decode) and reader.spec.kind != "encoded":
            raise UsageError(
                f"{reader.root}: decode={decode!r} decodes encoded images, but this pack holds "
                f"{reader.spec.kind} samples"
            )
        # True, False or a batch decoder (gpufeed.decoders.RandomResizedCrop)
        self.decode = decode if callable(decode) else bool(decode)
        self.skipped = 0
        self._sources: list[str] | None = None

    def fingerprint(self) -> str:
        """What loading cost depends on: the pack (path and manifest) and how it is read
        (transforms, decode, crc, reader or stream options; not the seed). make_loader
        measures its worker plan once per fingerprint and batch size in a process, so a
        loader rebuilt over the same pack read the same way (each epoch, each evaluation)
        does not measure again (and its probe does not warm the page cache each time)."""
        manifest = json.dumps(self.reader.manifest, sort_keys=True, default=str)
        parts = [
            os.path.realpath(self.path),
            hashlib.sha1(manifest.encode()).hexdigest(),
            _describe(self.transform),
            _describe(self.batch_transform),
            f"decode={self.decode}",
            f"verify_crc={self.verify_crc}",
            repr(sorted(self._read_options().items())),
        ]
        return "|".join(parts)

    def _read_options(self) -> dict[str, Any]:
        return {}

    # the source list is read only to word an error message
    def _source_of(self, index: int) -> str | None:
        if self._sources is None:
            try:
                self._sources = self.reader.sources() or []
            except OSError:
                self._sources = []
        return self._sources[index] if index < len(self._sources) else None

    def _corrupt(self, index: int, problem: str) -> CorruptSampleError:
        return CorruptSampleError(
            self.reader.location(index), index, problem, self._source_of(index)
        )

    def _fail(self, err: CorruptSampleError) -> None:
        """Raise, or count a skip (on_error="skip")."""
        if self.on_error == "raise":
            raise err
        if self.skipped == 0:
            warnings.warn(f"skipping corrupt samples; first: {err}", stacklevel=3)
        self.skipped += 1

    @property
    def labels(self) -> np.ndarray:
        return self.reader.labels

    @property
    def classes(self) -> list[str] | None:
        return self.reader.manifest.get("classes")

    @property
    def manifest(self) -> dict[str, Any]:
        return self.reader.manifest

    def _read(self, idx: np.ndarray):
        """Stored payloads for idx, with on_error applied: (kept positions, payloads)."""
        try:
            payloads = self.reader.read_batch(idx)
            keep = np.arange(len(idx))
        except Exception:  # noqa: BLE001 - narrowed below to the sample(s) at fault
            keep_list, payloads_list = [], []
            for j, i in enumerate(idx.tolist()):
                try:
                    payloads_list.append(self.reader.read_batch(np.array([i], dtype=np.int64))[0])
                    keep_list.append(j)
                except CorruptSampleError as e:
                    self._fail(self._corrupt(i, e.problem))
                except Exception as e:  # noqa: BLE001
                    self._fail(self._corrupt(i, f"read failed: {type(e).__name__}: {e}"))
            keep = np.asarray(keep_list, dtype=np.int64)
            if self.reader.spec.kind == "array":
                shape = (len(keep), *self.reader.spec.shape)
                payloads = (
                    np.stack(payloads_list)
                    if payloads_list
                    else np.empty(shape, dtype=self.reader.spec.dtype)
                )
            else:
                payloads = payloads_list
        if self.verify_crc and len(keep):
            want = self.reader.crc32[idx[keep]]
            if isinstance(payloads, np.ndarray):
                got = row_crcs(payloads)
            else:
                got = np.fromiter((crc32(p) for p in payloads), np.uint32, len(payloads))
            bad = np.flatnonzero(got != want)
            if len(bad):
                for b in bad.tolist():
                    i = int(idx[keep[b]])
                    self._fail(
                        self._corrupt(
                            i, f"crc32 mismatch (stored {want[b]:08x}, read {got[b]:08x})"
                        )
                    )
                good = np.setdiff1d(np.arange(len(keep)), bad)
                keep = keep[good]
                if isinstance(payloads, np.ndarray):
                    payloads = payloads[good]
                else:
                    payloads = [payloads[g] for g in good.tolist()]
        return keep, payloads

    def _to_tensors(self, idx: np.ndarray, keep: np.ndarray, payloads):
        """Decode + transform: (samples, kept positions). The samples are one tensor where
        they were read or decoded as one (fixed-shape arrays, a batch decoder), else a list:
        stacking is left to whoever needs a stacked batch (get_batch), so the per-sample
        path (__getitems__) never copies a sample only to split it again."""
        if isinstance(payloads, np.ndarray):
            samples = array_to_tensor(payloads)
            if self.transform is None:
                return samples, keep
            tensors = list(samples.unbind(0))
            kept = keep
        elif callable(self.decode):
            batch, positions, failed = self.decode(payloads)
            for j, problem in failed:
                self._fail(self._corrupt(int(idx[keep[j]]), problem))
            kept = keep[np.asarray(positions, dtype=np.int64)]
            if self.transform is None:
                return batch, kept
            tensors = list(batch.unbind(0))
        else:
            tensors, kept_list = [], []
            for j, payload in zip(keep.tolist(), payloads, strict=True):
                if not self.decode:
                    tensors.append(raw_bytes_tensor(payload))
                    kept_list.append(j)
                    continue
                try:
                    tensors.append(decode_bytes(payload))
                    kept_list.append(j)
                except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt sample
                    self._fail(self._corrupt(int(idx[j]), f"cannot decode: {e}"))
            kept = np.asarray(kept_list, dtype=np.int64)
        if self.transform is not None:
            tensors = [self.transform(t) for t in tensors]
        return tensors, kept


def _describe(fn) -> str:
    """A transform by what it does: its repr when that names its settings (torchvision's
    transforms do), else its type or function name; never an object address."""
    if fn is None:
        return "None"
    text = repr(fn)
    if " at 0x" not in text and len(text) < 2000:
        return text
    return getattr(fn, "__qualname__", None) or f"{type(fn).__module__}.{type(fn).__qualname__}"


class PackedDataset(_SampleReading, Dataset):
    """Map-style dataset over any packed format (chosen by the manifest). Indexing and
    ``__getitems__`` follow PyTorch's contract; ``get_batch`` is the fast path (see the module
    docstring).

    transform: applied to each sample tensor. batch_transform: applied to the samples of each
    read as one stacked batch [B, ...]: in ``get_batch``, in ``__getitems__`` (then split into
    samples) and in ``dataset[i]`` (a batch of one), so all three give the same values.
    verify_crc: check each sample's crc32 on read (off by default for speed; decode errors are
    always raised). on_error: "raise" a CorruptSampleError naming file and sample, or "skip":
    count it in ``skipped`` (per process: each DataLoader worker counts its own) and leave it
    out: ``dataset[i]`` and its place in ``__getitems__`` are ``None`` (pass
    ``collate_fn=gpufeed.collate`` to a plain DataLoader, which drops them; torch's
    default_collate cannot), ``get_batch`` and ``make_loader`` give a shorter batch.
    decode=False returns encoded samples as 1-D uint8 tensors (e.g. for GPU JPEG decoding);
    decode=a batch decoder, such as gpufeed.decoders.RandomResizedCrop(224), decodes and
    augments a batch in one pass (then transform, if given, runs on its output). Other
    keyword options go to the reader (hdf5: use_mmap, rdcc_mb; lmdb: readahead).
    """

    format_name: str | None = None

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        transform: Callable | None = None,
        batch_transform: Callable | None = None,
        verify_crc: bool = False,
        on_error: str = "raise",
        decode: bool = True,
        **reader_options: Any,
    ):
        reader = open_reader(path, **reader_options)
        if self.format_name and reader.format_name != self.format_name:
            raise UsageError(
                f"{path}: is a {reader.format_name} dataset, not {self.format_name}; "
                "use gpufeed.open_dataset to pick the right class"
            )
        self.path = str(path)
        self._reader_options = dict(reader_options)
        self._init_reading(reader, transform, batch_transform, verify_crc, on_error, decode)

    def _read_options(self) -> dict[str, Any]:
        return self._reader_options

    def __len__(self) -> int:
        return self.reader.count

    def _read_samples(self, indices) -> tuple[Any, np.ndarray, np.ndarray]:
        """One storage round trip for ``indices``: (samples of the kept positions, their
        labels, the kept positions), ``batch_transform`` applied."""
        idx = as_index_array(indices, self.reader.count, self.path)
        ahead = getattr(indices, "ahead", None)
        if ahead:
            # reads of the batch after this one start now, while this one is copied
            self.reader.prefetch(as_index_array(ahead, self.reader.count, self.path))
        keep, payloads = self._read(idx)
        samples, kept = self._to_tensors(idx, keep, payloads)
        if self.batch_transform is not None:
            if not isinstance(samples, torch.Tensor):
                samples = stack(samples)
            samples = self.batch_transform(samples)
        return samples, self.reader.labels[idx[kept]], kept

    def get_batch(self, indices: Sequence[int]) -> Batch:
        """The fast path: the samples at ``indices`` read in one storage round trip and handed
        out as one :class:`~gpufeed.batch.Batch` (samples stacked, labels int64), skipped
        samples left out. ``make_loader`` calls it for each batch."""
        samples, labels, _ = self._read_samples(indices)
        return to_batch(samples, labels)

    def __getitems__(self, indices: Sequence[int]) -> list:
        """PyTorch's batched fetch: the list of what ``self[i]`` returns for each index (a
        skipped sample is ``None``), read in one storage round trip."""
        samples, labels, kept = self._read_samples(indices)
        return to_samples(samples, labels, kept, len(indices))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.__getitems__(range(*index.indices(len(self))))
        if _many_indices(index):
            return self.__getitems__(index)
        return self.__getitems__([_one_index(index)])[0]

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sources"] = None
        return state

    def __repr__(self) -> str:
        spec = self.reader.spec
        what = f"{spec.dtype}{list(spec.shape)}" if spec.kind == "array" else "encoded"
        return f"{type(self).__name__}({self.path!r}, {len(self)} samples, {what})"


class HDF5Dataset(PackedDataset):
    format_name = "hdf5"


class LMDBDataset(PackedDataset):
    format_name = "lmdb"


class MmapDataset(PackedDataset):
    format_name = "mmap"


class TarIndexedDataset(PackedDataset):
    """Random access into tar shards through their index (slower than streaming them)."""

    format_name = "tar"


class TarShardDataset(_SampleReading, IterableDataset):
    """Streams tar shards: each rank and DataLoader worker reads its own shards
    (gpufeed.distributed.split_shards) sequentially, through a seeded shuffle buffer.

    Iterating yields samples, ``(image, label)`` as ``dataset[i]`` of the map-style datasets,
    so a plain ``DataLoader(dataset, batch_size=32, num_workers=4)`` works: its workers split
    the shards, every sample is read once. (``shuffle=True`` is PyTorch's error for any
    IterableDataset: this one shuffles itself, through ``shuffle_buffer`` and
    ``shuffle_shards``.) ``iter_batches`` is the fast path that make_loader uses.

    The rank and world size come from ``rank``/``world_size`` when given, else from
    ``torch.distributed`` or env ``RANK``/``WORLD_SIZE`` when iterating
    (:func:`gpufeed.distributed.rank_and_world`). Call set_epoch(epoch) before each epoch for
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
    ):
        reader = open_reader(path)
        if reader.format_name != "tar":
            raise UsageError(f"{path}: is a {reader.format_name} dataset, not tar shards")
        if batch_transform is not None:
            raise UsageError("batch_transform applies to map-style datasets; use transform")
        self.path = str(path)
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.shuffle_shards = bool(shuffle_shards)
        self.read_size = int(read_size)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._init_reading(reader, transform, None, verify_crc, on_error, decode)

    @property
    def shards(self) -> list[str]:
        return list(self.reader.shards)

    def _read_options(self) -> dict[str, Any]:
        return {
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle_shards": self.shuffle_shards,
            "read_size": self.read_size,
        }

    def replace(self, **changes: Any) -> TarShardDataset:
        """A copy with some options changed (``rank``, ``world_size``, ``shuffle_buffer``,
        ``shuffle_shards``, ``seed``, ``read_size``); this dataset stays as it is.
        make_loader uses it to apply its ``rank``/``world_size`` and ``shuffle`` arguments."""
        allowed = {"rank", "world_size", "shuffle_buffer", "shuffle_shards", "seed", "read_size"}
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise TypeError(f"replace() cannot change {', '.join(unknown)}")
        clone = copy.copy(self)
        for key, value in changes.items():
            setattr(clone, key, value)
        return clone

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _split(self, **worker) -> list[int]:
        from gpufeed.distributed import split_shards

        return split_shards(
            list(range(len(self.reader.shards))),
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle_shards,
            rank=self.rank,
            world_size=self.world_size,
            **worker,
        )

    def my_shards(self) -> list[int]:
        """Shard numbers this rank and worker read this epoch."""
        return self._split()

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all its workers together)."""
        start = self.reader.shard_start
        shards = self._split(worker_id=0, num_workers=1)
        return int(sum(start[s + 1] - start[s] for s in shards))

    def _chunks(self, shards: list[int], size: int):
        """(indices, payloads) of up to ``size`` consecutive samples of one shard, each chunk
        one read."""
        for s in shards:
            lo, hi = self.reader.shard_range(s)
            for a in range(lo, hi, size):
                idx = np.arange(a, min(a + size, hi), dtype=np.int64)
                keep, payloads = self._read(idx)
                if len(keep):
                    yield idx[keep], payloads

    def _stream(self, batch_size: int, drop_last: bool):
        """(samples, labels, kept positions) of each batch of this rank's and worker's
        stream (see iter_batches)."""
        shards = self.my_shards()
        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = np.random.default_rng([self.seed, self.epoch, worker, *shards[:4]])
        shuffle = self.shuffle_buffer > 1
        keep_back = self.shuffle_buffer if shuffle else 0
        pool = _SamplePool()

        def draw(k: int) -> np.ndarray:
            if shuffle:
                return rng.choice(pool.size, k, replace=False)
            return np.arange(k)

        def decoded(idx: np.ndarray, payloads):
            samples, kept = self._to_tensors(idx, np.arange(len(idx)), payloads)
            return samples, self.reader.labels[idx[kept]], kept

        for idx, payloads in self._chunks(shards, max(self.read_size, batch_size)):
            pool.put(idx, payloads)
            while pool.size >= keep_back + batch_size:
                yield decoded(*pool.take(draw(batch_size)))
        while pool.size >= batch_size or (pool.size and not drop_last):
            yield decoded(*pool.take(draw(min(batch_size, pool.size))))

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        """The fast path: this rank's and worker's samples as Batches of ``batch_size`` (the
        last one shorter unless ``drop_last``), read in runs of consecutive samples (one read
        each), decoded a batch at a time. Shuffled through a buffer: a batch goes out only
        while at least ``shuffle_buffer`` samples stay behind, drawn uniformly from all held.
        make_loader iterates this; ``iter()`` yields the same kind of stream sample by
        sample."""
        for samples, labels, _ in self._stream(batch_size, drop_last):
            yield to_batch(samples, labels)

    def __iter__(self):
        for samples, labels, kept in self._stream(self.read_size, False):
            yield from to_samples(samples, labels, np.arange(len(kept)), len(kept))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sources"] = None
        return state

    def __repr__(self) -> str:
        where = "" if self.rank is None else f", rank {self.rank} of {self.world_size}"
        return f"TarShardDataset({self.path!r}, {len(self.reader.shards)} shards{where})"


def open_dataset(path: str | os.PathLike, **options: Any):
    """The dataset for a finished pack, by its manifest's format: HDF5Dataset, LMDBDataset,
    MmapDataset, or TarShardDataset (iterable; pass map_style=True for TarIndexedDataset).
    A folder without manifest.json (an unfinished pack) raises NotPackedError."""
    from gpufeed.manifest import read_manifest

    map_style = options.pop("map_style", None)
    fmt = read_manifest(path)["format"]
    if fmt == "tar" and not map_style:
        return TarShardDataset(path, **options)
    cls = {
        "hdf5": HDF5Dataset,
        "lmdb": LMDBDataset,
        "mmap": MmapDataset,
        "tar": TarIndexedDataset,
    }[fmt]
    return cls(Path(path), **options)
