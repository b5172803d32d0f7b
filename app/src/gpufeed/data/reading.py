"""What every gpufeed dataset shares: indices checked as Python checks them, and stored bytes
turned into checked tensors (checksums, decoding, on_error, transforms).

Datasets read a batch at a time and build either samples or a Batch from what they read
(gpufeed.batch); a new kind of sample is a change there, not in every dataset.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gpufeed.batch import FieldBatch
from gpufeed.data.boxes import crop_plan
from gpufeed.data.decoders import array_to_tensor, decode_bytes, raw_bytes_tensor
from gpufeed.data.fields import decode_batch, field_rows
from gpufeed.errors import (
    ChecksumError,
    CorruptSampleError,
    StalePackError,
    StorageError,
    UsageError,
)
from gpufeed.formats.base import Reader
from gpufeed.formats.checksums import crc32, row_crcs

__all__ = [
    "ON_ERROR",
    "PythonIndexing",
    "SampleReading",
    "as_index_array",
    "describe",
    "many_indices",
    "one_index",
]

ON_ERROR = ("raise", "skip")


def as_index_array(indices: Sequence[int] | np.ndarray, count: int, path: str) -> np.ndarray:
    """Indices as int64, negatives wrapped, range checked with an error naming the dataset."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < -count or idx.max() >= count):
        bad = int(idx[(idx < -count) | (idx >= count)][0])
        raise IndexError(f"{path}: sample {bad} out of range for {count} samples")
    return np.where(idx < 0, idx + count, idx)


def one_index(index) -> int:
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


def many_indices(index) -> bool:
    if isinstance(index, (list, tuple, range)):
        return True
    return isinstance(index, (np.ndarray, torch.Tensor)) and index.ndim == 1


class PythonIndexing:
    """``dataset[i]`` as Python indexes (an int, a negative one, a slice, a sequence of
    ints), all through the class's ``__getitems__`` (one batched read): the one rule every
    map-style gpufeed dataset follows."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.__getitems__(range(*index.indices(len(self))))
        if many_indices(index):
            return self.__getitems__(index)
        return self.__getitems__([one_index(index)])[0]


class SampleReading:
    """What map-style and iterable datasets share: turning stored bytes into checked tensors."""

    reader: Reader
    transform: Callable | None
    verify_crc: bool
    on_error: str
    decode: bool | Callable

    def _init_reading(
        self, reader, transform, batch_transform, verify_crc, on_error, decode, pad=None
    ):
        if on_error not in ON_ERROR:
            raise UsageError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.reader = reader
        self.transform = transform
        self.batch_transform = batch_transform
        self.verify_crc = bool(verify_crc)
        self.on_error = on_error
        if callable(decode) and not _holds_images(reader.spec):
            raise UsageError(
                f"{reader.root}: decode={decode!r} decodes encoded images, but this pack holds "
                f"{reader.spec.kind} samples ({reader.spec.describe()})"
            )
        if verify_crc and not getattr(reader, "checksums", True):
            raise UsageError(
                f"{reader.root}: verify_crc=True, but data read in place ({reader.format_name}) "
                "stores no checksums; pack it (gpufeed pack) to have them"
            )
        if batch_transform is not None and reader.spec.kind == "fields":
            raise UsageError(
                f"{reader.root}: batch_transform takes one stacked tensor; this pack's samples "
                "are field dicts: use transform (one dict) or a collate_fn"
            )
        # True, False or a batch decoder (gpufeed.data.decoders.RandomResizedCrop)
        self.decode = decode if callable(decode) else bool(decode)
        if callable(decode) and reader.spec.kind == "fields":
            # box options checked, and unnamed boxes warned of, at open, naming the pack
            crop_plan(reader.spec.schema, decode, where=str(reader.root))
        # multi-field packs: ragged field -> fill value, padded in get_batch (batch.py)
        self.pad = _check_pad(reader, pad)
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
            describe(self.transform),
            describe(self.batch_transform),
            f"decode={self.decode}",
            f"pad={self.pad}",
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
        """The class names, label i is classes[i] (an image folder's subfolders, a Writer's
        classes=); None where the pack has none."""
        return self.reader.manifest.get("classes")

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """Class name -> label, as torchvision's ImageFolder has it; None without classes."""
        classes = self.classes
        return None if classes is None else {c: i for i, c in enumerate(classes)}

    @property
    def manifest(self) -> dict[str, Any]:
        return self.reader.manifest

    def _read(self, idx: np.ndarray):
        """Stored payloads for idx, with on_error applied: (kept positions, payloads)."""
        try:
            payloads = self.reader.read_batch(idx)
            keep = np.arange(len(idx))
        # the store, a fetched file or a file replaced since the open: not a sample's fault
        except (StorageError, ChecksumError, StalePackError):
            raise
        except Exception:  # noqa: BLE001 - narrowed below to the sample(s) at fault
            keep_list, payloads_list = [], []
            for j, i in enumerate(idx.tolist()):
                try:
                    payloads_list.append(self.reader.read_batch(np.array([i], dtype=np.int64))[0])
                    keep_list.append(j)
                except CorruptSampleError as e:
                    self._fail(self._corrupt(i, e.problem))
                except (StorageError, StalePackError):  # not the sample's: never skipped
                    raise
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
        path (__getitems__) never copies a sample only to split it again. A multi-field
        pack's samples are one FieldBatch (see _fields_to_tensors)."""
        if self.reader.spec.kind == "fields":
            return self._fields_to_tensors(idx, keep, payloads)
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

    def _fields_to_tensors(self, idx: np.ndarray, keep: np.ndarray, payloads):
        """A multi-field read, decoded as a batch (gpufeed.data.fields.decode_batch): the
        FieldBatch (ragged fields as lists: get_batch pads them), or with a transform, the
        sample dicts it made, each transformed."""
        schema = self.reader.spec.schema
        batch, rows, failed = decode_batch(schema, payloads, self.decode)
        for j, problem in failed:
            self._fail(self._corrupt(int(idx[keep[j]]), problem))
        kept = keep[rows]
        if self.transform is None:
            return batch, kept
        return [self.transform(s) for s in field_rows(schema, batch)], kept

    def _samples_of(self, samples):
        """What the per-sample path hands out: a FieldBatch split into its sample dicts."""
        if isinstance(samples, FieldBatch):
            return field_rows(self.reader.spec.schema, samples)
        return samples


def _holds_images(spec) -> bool:
    if spec.kind == "fields":
        return any(f.type == "image" for f in spec.schema.fields)
    return spec.kind == "encoded"


def _check_pad(reader: Reader, pad) -> dict[str, Any] | None:
    if not pad:
        return None
    schema = reader.spec.schema
    ragged = [f.name for f in schema.fields if f.ragged] if schema is not None else []
    wrong = [name for name in pad if name not in ragged]
    if wrong:
        raise UsageError(
            f"{reader.root}: pad={pad!r}: {wrong} are not ragged fields of this pack "
            f"(ragged fields: {ragged or 'none'})"
        )
    return dict(pad)


def describe(fn) -> str:
    """A transform by what it does: its repr when that names its settings (torchvision's
    transforms do), else its type or function name; never an object address."""
    if fn is None:
        return "None"
    text = repr(fn)
    if " at 0x" not in text and len(text) < 2000:
        return text
    return getattr(fn, "__qualname__", None) or f"{type(fn).__module__}.{type(fn).__qualname__}"
