"""Datasets over packed formats: map-style (HDF5, LMDB, mmap, and tar via its index) and an
iterable one over tar shards.

Every dataset is safe to build in the parent and use in DataLoader workers under fork or
spawn: the storage handle is opened lazily in the process that reads (and reopened after a
fork), and pickling drops it. The per-sample index (labels, crc32, offsets) lives in numpy
arrays, never per-sample Python objects, so workers do not copy-on-read it page by page.

Items are (sample, label): sample a torch.Tensor (images: uint8 [3, H, W], CHW like
torchvision.io; arrays: their stored dtype and shape), label an int (-1 when unknown).

Batch reads: the DataLoader calls ``__getitems__(indices)`` with a whole batch; it returns a
:class:`Batch` (one stacked tensor + int64 labels) from one storage round trip. Pass
``collate_fn=gpufeed.collate`` to a plain DataLoader (``make_loader`` does it for you): torch's
default_collate would try to collate the Batch again.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

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

ON_ERROR = ("raise", "skip")


class Batch(NamedTuple):
    """A batch as read: samples [B, ...] stacked when shapes agree (else a list of tensors),
    labels int64 [B]."""

    samples: torch.Tensor | list[torch.Tensor]
    labels: torch.Tensor


def collate(data):
    """collate_fn for gpufeed datasets: a Batch passes through unchanged; a list of
    (sample, label) items (skipped ones are None) becomes a Batch; anything else goes to
    torch's default_collate."""
    if isinstance(data, Batch):
        return data
    if isinstance(data, list):
        data = [d for d in data if d is not None]
        if data and all(isinstance(d, tuple) and len(d) == 2 for d in data):
            samples = [d[0] for d in data]
            labels = torch.as_tensor([int(d[1]) for d in data], dtype=torch.int64)
            return Batch(_stack(samples), labels)
    return default_collate(data)


def _stack(samples: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    if not samples:
        return torch.empty(0)
    first = samples[0]
    if all(
        isinstance(s, torch.Tensor) and s.shape == first.shape and s.dtype == first.dtype
        for s in samples
    ):
        return torch.stack(samples)
    return samples


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
        """Decode + transform: (samples: stacked tensor or list, kept positions)."""
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
        return _stack(tensors), kept


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
    """Map-style dataset over any packed format (chosen by the manifest).

    transform: applied to each sample tensor. batch_transform: applied to the stacked
    samples of a batch in __getitems__. verify_crc: check each sample's crc32 on read (off by
    default for speed; decode errors are always raised). on_error: "raise" a
    CorruptSampleError naming file and sample, or "skip": drop the sample from its batch
    (__getitem__ returns None, which gpufeed.collate drops) and count it in ``skipped``
    (per process: each DataLoader worker counts its own). decode=False returns encoded samples
    as 1-D uint8 tensors (e.g. for GPU JPEG decoding); decode=a batch decoder, such as
    gpufeed.decoders.RandomResizedCrop(224), decodes and augments a batch in one pass (then
    transform, if given, runs on its output). Other keyword options go to the reader
    (hdf5: use_mmap, rdcc_mb; lmdb: readahead).
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

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx = as_index_array(indices, self.reader.count, self.path)
        ahead = getattr(indices, "ahead", None)
        if ahead:
            # reads of the batch after this one start now, while this one is copied
            self.reader.prefetch(as_index_array(ahead, self.reader.count, self.path))
        keep, payloads = self._read(idx)
        samples, kept = self._to_tensors(idx, keep, payloads)
        labels = torch.from_numpy(self.reader.labels[idx[kept]])
        if self.batch_transform is not None:
            samples = self.batch_transform(samples)
        return Batch(samples, labels)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.__getitems__(range(*index.indices(len(self))))
        if isinstance(index, (list, tuple, np.ndarray, torch.Tensor)):
            return self.__getitems__(index)
        idx = as_index_array([int(index)], self.reader.count, self.path)
        keep, payloads = self._read(idx)
        samples, kept = self._to_tensors(idx, keep, payloads)
        if len(kept) == 0:
            return None
        return samples[0], int(self.reader.labels[idx[0]])

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

    Call set_epoch(epoch) before each epoch for a new shard order and buffer seed.
    shuffle_buffer=0 yields in storage order (of this worker's shards).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        shuffle_shards: bool = True,
        transform: Callable | None = None,
        batch_transform: Callable | None = None,
        verify_crc: bool = False,
        on_error: str = "raise",
        decode: bool = True,
        read_size: int = 64,
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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def my_shards(self) -> list[int]:
        """Shard numbers this rank and worker read this epoch."""
        from gpufeed.distributed import split_shards

        return split_shards(
            list(range(len(self.reader.shards))),
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle_shards,
        )

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all its workers together)."""
        from gpufeed.distributed import split_shards

        shards = split_shards(
            list(range(len(self.reader.shards))),
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle_shards,
            worker_id=0,
            num_workers=1,
        )
        start = self.reader.shard_start
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

    def _batch(self, idx: np.ndarray, payloads) -> Batch:
        samples, kept = self._to_tensors(idx, np.arange(len(idx)), payloads)
        return Batch(samples, torch.from_numpy(self.reader.labels[idx[kept]]))

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        """This rank's and worker's samples as Batches of ``batch_size`` (the last one shorter
        unless ``drop_last``), read in runs of consecutive samples (one read each), decoded a
        batch at a time. Shuffled through a buffer: a batch goes out only while at least
        ``shuffle_buffer`` samples stay behind, drawn uniformly from all held. make_loader
        iterates this; ``iter()`` yields the same kind of stream sample by sample."""
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

        for idx, payloads in self._chunks(shards, max(self.read_size, batch_size)):
            pool.put(idx, payloads)
            while pool.size >= keep_back + batch_size:
                yield self._batch(*pool.take(draw(batch_size)))
        while pool.size >= batch_size or (pool.size and not drop_last):
            yield self._batch(*pool.take(draw(min(batch_size, pool.size))))

    def __iter__(self):
        for samples, labels in self.iter_batches(self.read_size):
            yield from zip(samples, labels.tolist(), strict=True)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sources"] = None
        return state

    def __repr__(self) -> str:
        return f"TarShardDataset({self.path!r}, {len(self.reader.shards)} shards)"


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
