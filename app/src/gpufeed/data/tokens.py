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

Document lengths are known when the dataset is made: from the record spans of the index
where the format keeps them (mmap, HDF5: no data read) and the field is the record's only
one, uncompressed; otherwise by reading every record once, a batch at a time (LMDB, tar,
several fields, zstd), cached in the index folder of data read in place
($GPUFEED_INDEX_DIR, else ~/.cache/gpufeed/index) for the very files they were read from.
Pickled to workers, the lengths go with the dataset (numpy arrays: no copy-on-read growth).

``__getitems__`` (what the DataLoader and make_loader call with a batch of window indices)
reads every document the batch touches in one ``read_batch`` and slices the windows out.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpufeed.data.reading import PythonIndexing, as_index_array
from gpufeed.errors import CorruptSampleError, UsageError
from gpufeed.formats.inplace.webdataset import cached_index, in_place_identity, index_folder
from gpufeed.formats.record import plain_bytes, split_records
from gpufeed.pagecache.advise import advise_willneed, looks_cached
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


class TokenWindows(PythonIndexing, Dataset):
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
        self.stored = lengths  # tokens stored per document (no eos)
        self._map = None
        self._maps = self._mappable()
        if self._maps:  # where each document's tokens start, counted in tokens
            self.token_at = (self.reader.offsets[:-1] + 16) // self.dtype.itemsize
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

    def _spans(self, indices):
        """(stream start, stream end, first document, last document) of each window."""
        idx = as_index_array(indices, len(self), self.path)
        if self.boundaries:
            docs = self.doc_of[idx]
            lo = self.starts[docs] + self.first[idx]
            hi = np.minimum(self.starts[docs + 1], lo + self.block_size)
        else:
            lo = idx * self.block_size
            hi = lo + self.block_size
        first = np.searchsorted(self.starts, lo, side="right") - 1
        last = np.searchsorted(self.starts, np.maximum(hi - 1, lo), side="right") - 1
        return lo, hi, first, last

    def read_ahead(self, indices) -> None:
        """Start reading the windows at ``indices`` into the page cache without waiting (a
        hint: a mixture asks each of its sources before it reads any)."""
        lo, hi, first, last = self._spans(indices)
        flat = self._mapped()
        if flat is not None:
            self._read_ahead(flat, *self._pieces(lo, hi, first, last)[1:4])
        elif callable(getattr(self.reader, "read_ahead", None)):
            self.reader.read_ahead(_ranges(first, last))

    def __getitems__(self, indices) -> list:
        """The windows at ``indices``: every document they touch read in one read_batch,
        copied once into a [len(indices), B] array whose rows are handed out. make_loader's
        batches name the batch after them (``ahead``): its reads start now."""
        ahead = getattr(indices, "ahead", None)
        if ahead:
            self.read_ahead(ahead)
        lo, hi, first, last = self._spans(indices)
        B = self.block_size
        flat = self._mapped()
        if flat is not None:
            out = self._gather_mapped(flat, lo, hi, first, last)
        else:
            docs = _ranges(first, last)
            tokens = self._read(docs)
            out = np.full((len(lo), B), self.pad_id, dtype=self.dtype)
            # per document touched: its tokens, where it starts in the stream, its length
            stream = (tokens, self.starts[docs].tolist(), self.lengths[docs].tolist())
            at = np.searchsorted(docs, first).tolist()
            for w, (a, b, j) in enumerate(zip(lo.tolist(), hi.tolist(), at, strict=True)):
                self._fill(out[w], a, b, j, stream)
        rows = list(torch.from_numpy(out))
        if not self.boundaries:
            return rows
        mask = torch.from_numpy(np.arange(B) < (hi - lo)[:, None])
        return [{"tokens": t, "mask": m} for t, m in zip(rows, mask, strict=True)]

    def _fill(self, row: np.ndarray, a: int, b: int, j: int, stream) -> None:
        """Stream tokens [a, b), starting in the j-th document read, into ``row``."""
        tokens, starts, lengths = stream
        filled = 0
        while a < b:
            doc = tokens[j]
            off = a - starts[j]
            take = min(b - a, lengths[j] - off)
            body = min(take, max(0, len(doc) - off))  # tokens of the document; then its eos
            row[filled : filled + body] = doc[off : off + body]
            if take > body:
                row[filled + body] = self.eos
            filled, a, j = filled + take, a + take, j + 1

    def _read(self, docs: np.ndarray) -> list[np.ndarray]:
        """The token arrays of documents ``docs`` (sorted, distinct): one read_batch."""
        records = self.reader.read_batch(docs)
        parts = document_tokens(self.reader, self.field_index, self.field, records, docs)
        self._check_lengths(parts, docs)
        return parts

    def _mappable(self) -> bool:
        """An mmap pack of one uncompressed native-order field whose records all start at a
        multiple of the token size: its windows are slices of the map (_gather_mapped)."""
        offsets = getattr(self.reader, "offsets", None)
        return (
            self.reader.format_name == "mmap"
            and len(self.reader.spec.schema.fields) == 1
            and not self.field.compression
            and np.dtype(self.field.dtype).isnative
            and isinstance(offsets, np.ndarray)
            and bool((offsets % self.dtype.itemsize == 0).all())
        )

    def _mapped(self) -> np.ndarray | None:
        """The mmap pack's record bytes as one plain uint8 array (slicing a np.memmap costs
        more than the copy of a window), or None where the records are no such map."""
        if not self._maps:
            return None
        handle = self.reader.handle  # opened (again) in this process, checked by the reader
        if self._map is None or self._map[0] is not handle:
            self._map = (handle, np.asarray(handle).reshape(-1).view(np.uint8))
        return self._map[1]

    def _pieces(self, lo, hi, first, last):
        """Each window's pieces, one a document it touches: (window, document, first token
        in the file's tokens, tokens to copy, whether the eos follows, place in the window)."""
        counts = last - first + 1
        win = np.repeat(np.arange(len(lo)), counts)
        doc = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        doc += first[win]
        begin = self.starts[doc]
        start = np.maximum(lo[win], begin)
        a = start - begin  # within the document
        b = np.minimum(hi[win], self.starts[doc + 1]) - begin
        n = np.maximum(np.minimum(b, self.stored[doc]) - a, 0)
        return win, doc, self.token_at[doc] + a, n, b > self.stored[doc], start - lo[win]

    def _gather_mapped(self, flat, lo, hi, first, last) -> np.ndarray:
        """The windows of an mmap pack, [W, B]: each piece one slice copy out of the map."""
        B = self.block_size
        win, doc, src, n, eos, at = self._pieces(lo, hi, first, last)
        self._read_ahead(flat, doc, src, n)
        self._check_heads(flat, doc)
        dst = win * B + at
        out = np.full(len(lo) * B, self.pad_id, dtype=self.dtype)
        tokens = flat.view(self.dtype)
        for d, a, k in zip(dst.tolist(), src.tolist(), n.tolist(), strict=True):
            out[d : d + k] = tokens[a : a + k]
        if self.eos is not None:
            out[(dst + n)[eos]] = self.eos
        return out.reshape(len(lo), B)

    def _read_ahead(self, flat, doc, src, n) -> None:
        """WILLNEED for every piece's bytes and its document's head, unless the first
        piece looks cached: the reads then run together, not one page fault after another."""
        itemsize, base = self.dtype.itemsize, flat.ctypes.data
        if not len(src) or looks_cached(base + int(src[0]) * itemsize, int(n[0]) * itemsize):
            return
        head = self.reader.offsets[doc]
        starts = np.concatenate((head, src * itemsize)).tolist()
        sizes = np.concatenate((np.full(len(head), 16), n * itemsize)).tolist()
        advise_willneed((base + a, k) for a, k in zip(starts, sizes, strict=True) if k)

    def _check_heads(self, flat: np.ndarray, docs: np.ndarray) -> None:
        """Every record's two int64 heads (the field size, the length) checked at once
        against the lengths counted at open: a record that disagrees is an error."""
        begin = self.reader.offsets[docs]
        heads = flat[begin[:, None] + np.arange(16)].view("<i8").reshape(-1, 2)
        n = self.stored[docs]
        bad = (heads[:, 0] != self.reader.offsets[docs + 1] - begin - 8) | (heads[:, 1] != n)
        if bad.any():
            j = int(np.argmax(bad))
            doc = int(docs[j])
            raise CorruptSampleError(
                self.reader.location(doc),
                doc,
                f"field {self.field.name!r}: its record heads {heads[j].tolist()} do not hold "
                f"a document of {int(n[j])} tokens: re-pack it",
            )

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

    def close(self) -> None:
        """Close the reader and drop this process's map (its pages can then be evicted)."""
        self._map = None
        self.reader.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_map"] = None  # the map is this process's (the reader opens its own)
        return state

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
    dtype = np.dtype(field.dtype)
    if len(reader.spec.schema.fields) == 1 and not field.compression:
        # the record is the field's size, then the field: no split needed, no copy
        return [
            _tokens_of(reader, int(doc), field, _one_field(reader, int(doc), rec), dtype)
            for doc, rec in zip(docs.tolist(), records, strict=True)
        ]
    split = split_records(reader.spec.schema, records)
    if split.bad:
        j, why = next(iter(split.bad.items()))
        raise CorruptSampleError(reader.location(int(docs[j])), int(docs[j]), why)
    col = split.column(k)
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


def _one_field(reader, doc: int, record) -> np.ndarray:
    """A one-field record's field bytes (uint8, a view): after its int64 size, which must
    be the rest of the record."""
    rec = np.frombuffer(record, np.uint8)
    size = int(rec[:8].view("<i8")[0]) if len(rec) >= 8 else -1
    if size != len(rec) - 8:
        raise CorruptSampleError(
            reader.location(doc), doc, f"record of {len(rec)} bytes says its field holds {size}"
        )
    return rec[8:]


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
    """Tokens in each document of the pack, int64 [count]: from the record spans where the
    index has them, else read once and cached (lengths_cache)."""
    spans = getattr(reader, "offsets", None)
    only = len(reader.spec.schema.fields) == 1 and not field.compression
    if only and isinstance(spans, np.ndarray) and len(spans) == reader.count + 1:
        # a record is its field size (int64), the length (int64), then the tokens
        body = np.diff(spans) - 8 - _SHAPE_BYTES
        itemsize = np.dtype(field.dtype).itemsize
        if (body >= 0).all() and (body % itemsize == 0).all():
            return body // itemsize
    path, identity = lengths_cache(reader, field)

    def fresh(cached) -> bool:
        lengths = cached["lengths"]
        return (
            str(cached["identity"]) == identity
            and lengths.dtype == np.int64
            and lengths.shape == (reader.count,)
            and bool((lengths >= 0).all())
        )

    def build() -> dict[str, np.ndarray]:
        return {"identity": np.array(identity), "lengths": read_lengths(reader, k, field)}

    return cached_index(path, fresh, build)["lengths"]


def lengths_cache(reader, field) -> tuple[Path, str]:
    """Where a pack's document lengths are cached (index_folder(), as the indexes of data
    read in place) and what they are valid for: the pack's manifest (its files' sizes and
    sha256) and, for a local pack, each data file's identity (in_place_identity). A cache
    that lies is caught when read: every document read is checked against its length."""
    manifest = json.dumps(reader.manifest, sort_keys=True, default=str)
    parts = [hashlib.sha256(manifest.encode()).hexdigest(), field.name]
    if reader.source is None:
        for name in reader.data_files():
            try:
                parts.append(f"{name}:{in_place_identity(os.stat(reader.root / name))}")
            except OSError:
                parts.append(f"{name}:missing")
    where = os.path.realpath(reader.root).encode("utf-8", "surrogateescape")
    key = hashlib.sha256(where + b"\0" + field.name.encode()).hexdigest()[:24]
    return index_folder() / f"tokens-{key}.npz", "\n".join(parts)


def read_lengths(reader, k: int, field) -> np.ndarray:
    """Every document read once, a batch at a time: its token count."""
    lengths = np.empty(reader.count, dtype=np.int64)
    for lo in range(0, reader.count, LENGTH_BATCH):
        docs = np.arange(lo, min(lo + LENGTH_BATCH, reader.count), dtype=np.int64)
        parts = document_tokens(reader, k, field, reader.read_batch(docs), docs)
        lengths[lo : lo + len(docs)] = [len(p) for p in parts]
    return lengths
