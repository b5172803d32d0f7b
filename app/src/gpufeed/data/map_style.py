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
fork), and pickling drops it. A pack read by URL is the exception under fork: object
storage's runtime does not survive one, so make_loader spawns its workers
(:mod:`gpufeed.storage.store`). The per-sample index (labels, crc32, offsets) lives in numpy
arrays, never per-sample Python objects, so workers do not copy-on-read it page by page.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from gpufeed.batch import Batch, stack_images, to_batch, to_samples
from gpufeed.data.reading import PythonIndexing, SampleReading, as_index_array
from gpufeed.errors import UsageError
from gpufeed.pagecache.copy import set_copy_threads
from gpufeed.pagecache.plan import BatchReadAhead
from gpufeed.storage.packs import open_reader_at

__all__ = [
    "HDF5Dataset",
    "LMDBDataset",
    "MmapDataset",
    "PackedDataset",
    "TarIndexedDataset",
]


class PackedDataset(PythonIndexing, SampleReading, Dataset):
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
    pad (multi-field packs): ragged field -> fill value; get_batch pads those fields and adds
    NAME_mask (gpufeed.batch.collate_fields); others come as lists. A multi-field read is
    decoded a batch at a time (gpufeed.data.fields.decode_batch): get_batch hands out the
    collated FieldBatch without making a dict per sample; __getitems__ splits it into them.
    decode=False returns encoded samples as 1-D uint8 tensors (e.g. for GPU JPEG decoding);
    decode=a batch decoder, such as gpufeed.RandomResizedCrop(224), decodes and
    augments a batch in one pass (then transform, if given, runs on its output); in a
    multi-field pack it decodes the image fields. Other
    keyword options go to the reader (hdf5: use_mmap, rdcc_mb; lmdb: readahead) and, for a
    pack in object storage (``path`` a URL), to its cache (cache_dir, cache_limit: see
    :func:`gpufeed.storage.packs.open_reader_at`).
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
        pad: dict[str, Any] | None = None,
        **reader_options: Any,
    ):
        make = reader_options.pop("reader", None)  # an in-place reader class (open_dataset)
        reader = make(path, **reader_options) if make else open_reader_at(path, **reader_options)
        if self.format_name and reader.format_name != self.format_name:
            raise UsageError(
                f"{path}: is a {reader.format_name} dataset, not {self.format_name}; "
                "use gpufeed.open_dataset to pick the right class"
            )
        self.path = str(path)
        self._reader_options = dict(reader_options)
        self._init_reading(reader, transform, batch_transform, verify_crc, on_error, decode, pad)

    def _read_options(self) -> dict[str, Any]:
        return self._reader_options

    @property
    def preferred_block_size(self) -> int:
        """The reader's unit of I/O in samples where it has one (Parquet: a row group), for
        make_loader's block shuffle; an AttributeError where it has none (the default)."""
        return self.reader.preferred_block_size

    def __len__(self) -> int:
        return self.reader.count

    def _read_samples(self, indices) -> tuple[Any, np.ndarray, np.ndarray]:
        """One storage round trip for ``indices``: (samples of the kept positions, their
        labels, the kept positions), ``batch_transform`` applied."""
        idx = as_index_array(indices, self.reader.count, self.path)
        if get_worker_info() is not None:  # a plain DataLoader's worker (make_loader's: set)
            set_copy_threads(1)
        hints = getattr(indices, "read_ahead", None)  # a LookaheadBatch's (make_loader's plan)
        if hints is not None:
            # the reads of a later batch, or of whole blocks of the order, start now, while
            # this batch is copied
            self.reader.read_ahead_batch(self._checked(hints))
        keep, payloads = self._read(idx)
        samples, kept = self._to_tensors(idx, keep, payloads)
        if self.batch_transform is not None:
            samples = self.batch_transform(stack_images(samples, self.path))
        return samples, self.reader.labels[idx[kept]], kept

    def _checked(self, hints: BatchReadAhead) -> BatchReadAhead:
        """``hints`` with their later batch's indices checked as this batch's are."""
        if not hints.ahead:
            return hints
        return replace(hints, ahead=as_index_array(hints.ahead, self.reader.count, self.path))

    def get_batch(self, indices: Sequence[int]) -> Batch:
        """The fast path: the samples at ``indices`` read in one storage round trip and handed
        out as one :class:`~gpufeed.batch.Batch` (samples stacked, labels int64), skipped
        samples left out. ``make_loader`` calls it for each batch."""
        samples, labels, _ = self._read_samples(indices)
        return to_batch(samples, labels, self.pad, self.path)

    def __getitems__(self, indices: Sequence[int]) -> list:
        """PyTorch's batched fetch: the list of what ``self[i]`` returns for each index (a
        skipped sample is ``None``), read in one storage round trip."""
        samples, labels, kept = self._read_samples(indices)
        return to_samples(self._samples_of(samples), labels, kept, len(indices), self.path)

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sources"] = None
        return state

    def __repr__(self) -> str:
        what = self.reader.spec.describe()
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
