"""Token windows: a pack of token documents read as fixed windows of one token stream.

A token pack is a multi-field pack whose samples hold a ragged 1-D integer field (the
document's token ids; ``field=`` names it when the schema has several such fields). The
stream is the documents concatenated in pack order, ``eos`` appended after each document
when given. :class:`TokenWindows` is a map-style Dataset over it:

- ``boundaries=False`` (the default): item ``i`` is ``stream[i * B : (i + 1) * B]``, a 1-D
  tensor of the stored dtype (uint16 stays uint16: no int64 conversion, do
  ``x.long()`` on the GPU), ``len = total_tokens // B`` (the last partial window is left
  out). A window spanning documents is gathered from consecutive samples.
- ``boundaries=True``: windows start at document starts. Each document (with its ``eos``)
  is cut into windows of ``B`` tokens from its first token; a document's last window is
  padded to ``B`` with ``pad_id``. Item ``i`` is ``{"tokens": [B], "mask": [B] bool}``
  (mask False on padding); ``len = sum(ceil(len_d / B))`` (an empty document gives none).

Document lengths are read once when the dataset is made: from the record spans of the
index where the format keeps them (mmap, HDF5: no data read) and the field is the
record's only one, uncompressed; otherwise by reading every record once, a batch at a time
(LMDB, tar, several fields, zstd). Pickled to workers, the lengths go with the dataset
(numpy arrays: no copy-on-read growth).

``__getitems__`` (what the DataLoader and make_loader call with a batch of window indices)
reads every document the batch touches in one ``read_batch`` and slices the windows out.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpufeed.data.reading import as_index_array, many_indices, one_index
from gpufeed.errors import CorruptSampleError, UsageError
from gpufeed.formats.record import plain_bytes, split_records
from gpufeed.storage.packs import open_reader_at

__all__ = ["TokenWindows", "token_field"]

# documents read per round trip while measuring lengths
LENGTH_BATCH = 4096
_SHAPE_BYTES = 8  # a ragged 1-D field's bytes start with its int64 length


def token_field(path, spec, field: str | None):
    """(index, Field) of the pack's token field: ``field`` or the one ragged 1-D integer
    field; a UsageError naming the pack otherwise."""
    if spec.kind != "fields":
        raise UsageError(
            f"{path}: block_size= reads token documents: samples holding a ragged integer "
            f"field (schema={{'tokens': 'uint16[-1]'}}); this pack holds {spec.describe()}"
        )
    fields = spec.schema.fields
    fit = [
        k
        for k, f in enumerate(fields)
        if f.type == "ragged" and len(f.shape) == 1 and np.dtype(f.dtype).kind in "iu"
    ]
    if field is not None:
        names = [f.name for f in fields]
        if field not in names:
            raise UsageError(f"{path}: field={field!r} is not a field of this pack: {names}")
        k = names.index(field)
        if k not in fit:
            raise UsageError(
                f"{path}: field {field!r} is {fields[k].describe()}; token windows need a "
                "ragged 1-D integer field, e.g. uint16[*]"
            )
        return k, fields[k]
    if len(fit) != 1:
        found = [fields[k].name for k in fit]
        what = "none" if not fit else f"several: {found}; name one with field="
        raise UsageError(
            f"{path}: token windows need one ragged 1-D integer field (uint16[*]); found {what}"
        )
    return fit[0], fields[fit[0]]


class TokenWindows(Dataset):
    """Fixed windows of a token pack's stream (module docstring). Build it with
    ``gpufeed.open_dataset(path, block_size=B, field=None, eos=None, boundaries=False)``."""

    def __init__(
        self,
        path: str | os.PathLike,
        block_size: int,
        *,
        field: str | None = None,
        eos: int | None = None,
        boundaries: bool = False,
        pad_id: int = 0,
        **reader_options: Any,
    ):
        self.path = str(path)
        self.reader = open_reader_at(path, **reader_options)
        self.block_size = _positive(self.path, "block_size", block_size)
        self.field_index, self.field = token_field(self.path, self.reader.spec, field)
        self.dtype = np.dtype(self.field.dtype).newbyteorder("=")
        self.eos = None if eos is None else self._fits("eos", eos)
        self.pad_id = self._fits("pad_id", pad_id)
        self.boundaries = bool(boundaries)
        lengths = document_lengths(self.reader, self.field_index, self.field)
        self.lengths = lengths + (0 if self.eos is None else 1)  # tokens per document
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))  # [N + 1] in the stream
        self.total_tokens = int(self.starts[-1])
        if self.boundaries:
            per_doc = -(-self.lengths // self.block_size)
            # window w: document doc_of[w], from token first[w] of it
            self.doc_of = np.repeat(np.arange(len(per_doc), dtype=np.int64), per_doc)
            first_window = np.concatenate(([0], np.cumsum(per_doc)))[:-1]
            self.first = (np.arange(len(self.doc_of)) - first_window[self.doc_of]) * block_size

    def _fits(self, name: str, value) -> int:
        value = int(value)
        info = np.iinfo(self.dtype)
        if not int(info.min) <= value <= int(info.max):
            raise UsageError(
                f"{self.path}: {name}={value} does not fit the token field's {self.dtype.name}"
            )
        return value

    def __len__(self) -> int:
        if self.boundaries:
            return len(self.doc_of)
        return self.total_tokens // self.block_size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.__getitems__(range(*index.indices(len(self))))
        if many_indices(index):
            return self.__getitems__(index)
        return self.__getitems__([one_index(index)])[0]

    def __getitems__(self, indices) -> list:
        """The windows at ``indices``: every document they touch read in one read_batch."""
        idx = as_index_array(indices, len(self), self.path)
        B = self.block_size
        if self.boundaries:
            docs = self.doc_of[idx]
            lo, hi = self.starts[docs] + self.first[idx], self.starts[docs + 1]
            hi = np.minimum(hi, lo + B)
        else:
            lo = idx * B
            hi = lo + B
        first = np.searchsorted(self.starts, lo, side="right") - 1
        last = np.searchsorted(self.starts, np.maximum(hi - 1, lo), side="right") - 1
        flat, where = self._gather(_ranges(first, last))
        out = []
        at = where(first) + lo - self.starts[first]  # each window's first token in flat
        for a, b in zip(at.tolist(), (hi - lo).tolist(), strict=True):
            window = torch.from_numpy(flat[a : a + b])
            out.append(self._padded(window) if self.boundaries else window)
        return out

    def _padded(self, window: torch.Tensor) -> dict[str, torch.Tensor]:
        n, B = len(window), self.block_size
        tokens = torch.full((B,), self.pad_id, dtype=window.dtype)
        tokens[:n] = window
        mask = torch.zeros(B, dtype=torch.bool)
        mask[:n] = True
        return {"tokens": tokens, "mask": mask}

    def _gather(self, docs: np.ndarray):
        """The documents ``docs`` (sorted, distinct) read in one round trip and joined (each
        followed by eos): (tokens, doc index array -> its first token's place in them)."""
        records = self.reader.read_batch(docs)
        parts = document_tokens(self.reader, self.field_index, self.field, records, docs)
        self._check_lengths(parts, docs)
        if self.eos is not None:
            sep = np.array([self.eos], dtype=self.dtype)
            parts = [x for p in parts for x in (p, sep)]
        flat = np.concatenate(parts) if parts else np.empty(0, self.dtype)
        place = np.concatenate(([0], np.cumsum(self.lengths[docs])))
        return flat, lambda d: place[np.searchsorted(docs, d)]

    def _check_lengths(self, parts: list[np.ndarray], docs: np.ndarray) -> None:
        """A document read must hold the tokens counted when the dataset was made: else the
        windows would shift silently."""
        want = self.lengths[docs] - (0 if self.eos is None else 1)
        for j, (p, n) in enumerate(zip(parts, want.tolist(), strict=True)):
            if len(p) != n:
                doc = int(docs[j])
                raise CorruptSampleError(
                    self.reader.location(doc),
                    doc,
                    f"holds {len(p)} tokens, {n} when the dataset was opened: the pack "
                    "changed or is damaged (open it again; check it with gpufeed verify)",
                )

    def __repr__(self) -> str:
        how = ", boundaries" if self.boundaries else ""
        return (
            f"TokenWindows({self.path!r}, {len(self)} windows of {self.block_size} "
            f"{self.dtype.name} tokens{how}, {len(self.lengths)} documents)"
        )


def _positive(path: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise UsageError(f"{path}: {name} must be a positive integer, got {value!r}")
    return int(value)


def _ranges(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """The distinct integers of the ranges [first[j], last[j]], sorted."""
    counts = last - first + 1
    starts = np.repeat(first - np.concatenate(([0], np.cumsum(counts)))[:-1], counts)
    return np.unique(starts + np.arange(int(counts.sum())))


def document_tokens(reader, k: int, field, records, docs: np.ndarray) -> list[np.ndarray]:
    """The token arrays of ``records`` (field ``k``; ``docs``: their sample numbers, for
    errors): views of the read bytes where uncompressed; a CorruptSampleError naming the
    file and sample where a record does not split or its stored length disagrees."""
    split = split_records(reader.spec.schema, records)
    if split.bad:
        j, why = next(iter(split.bad.items()))
        raise CorruptSampleError(reader.location(int(docs[j])), int(docs[j]), why)
    col = split.column(k)
    dtype = np.dtype(field.dtype)
    out = []
    for j, (a, n) in enumerate(zip(col.starts.tolist(), col.sizes.tolist(), strict=True)):
        data = col.buf[a : a + n]
        if field.compression:
            try:
                data = np.frombuffer(plain_bytes(field, data), np.uint8)
            except ValueError as e:
                doc = int(docs[j])
                raise CorruptSampleError(reader.location(doc), doc, str(e)) from None
        out.append(_tokens_of(reader, int(docs[j]), field, data, dtype))
    return out


def _tokens_of(reader, doc: int, field, data: np.ndarray, dtype: np.dtype) -> np.ndarray:
    body = len(data) - _SHAPE_BYTES
    n = int(data[:_SHAPE_BYTES].view("<i8")[0]) if body >= 0 else -1
    if body < 0 or n < 0 or n * dtype.itemsize != body:
        raise CorruptSampleError(
            reader.location(doc),
            doc,
            f"field {field.name!r}: {len(data)} stored bytes do not hold a {dtype.name} "
            f"document of the length they record ({n}); re-pack it",
        )
    tokens = data[_SHAPE_BYTES:].view(dtype)
    return tokens if dtype.isnative else tokens.astype(dtype.newbyteorder("="))


def document_lengths(reader, k: int, field) -> np.ndarray:
    """Tokens in each document of the pack, int64 [count]."""
    spans = getattr(reader, "offsets", None)
    only = len(reader.spec.schema.fields) == 1 and not field.compression
    if only and isinstance(spans, np.ndarray) and len(spans) == reader.count + 1:
        # a record is its field size (int64), the length (int64), then the tokens
        body = np.diff(spans) - 8 - _SHAPE_BYTES
        itemsize = np.dtype(field.dtype).itemsize
        if (body >= 0).all() and (body % itemsize == 0).all():
            return body // itemsize
    lengths = np.empty(reader.count, dtype=np.int64)
    for lo in range(0, reader.count, LENGTH_BATCH):
        docs = np.arange(lo, min(lo + LENGTH_BATCH, reader.count), dtype=np.int64)
        parts = document_tokens(reader, k, field, reader.read_batch(docs), docs)
        lengths[lo : lo + len(docs)] = [len(p) for p in parts]
    return lengths
