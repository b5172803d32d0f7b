"""How the documents of a token pack are read (gpufeed.data.tokens): their lengths, known
when a TokenWindows is made (from the index where it has them, else read once and cached),
their tokens out of read records, and the byte spans of an HDF5 pack's records in one read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import h5py
import numpy as np

from gpufeed.errors import CorruptSampleError, DataError
from gpufeed.formats.inplace.webdataset import cached_index, in_place_identity, index_folder
from gpufeed.formats.record import plain_bytes, split_records

__all__ = [
    "HEAD_BYTES",
    "Spans",
    "document_lengths",
    "document_tokens",
    "read_h5_spans",
]

# documents read per round trip while measuring lengths
LENGTH_BATCH = 4096
_SHAPE_BYTES = 8  # a ragged 1-D field's bytes start with its int64 length
# a one-field record: the field's size (int64), the document's length (int64), its tokens
HEAD_BYTES = 8 + _SHAPE_BYTES
# spans of an h5py read closer than this are read as one (the bytes between cost less than
# another hyperslab of the selection: a window's document head lies just before it)
SPAN_GAP = 4096


class Spans:
    """Where byte spans of a file's dataset landed in the buffer of one read: the merged
    spans' starts in the dataset and in the buffer."""

    def __init__(self, starts: np.ndarray, at: np.ndarray):
        self.starts, self.at = starts, at

    def locate(self, positions: np.ndarray) -> np.ndarray:
        """The buffer position of each dataset position (each inside a span read)."""
        k = np.searchsorted(self.starts, positions, side="right") - 1
        return self.at[k] + positions - self.starts[k]


def read_h5_spans(ds: h5py.Dataset, starts: np.ndarray, sizes: np.ndarray, path):
    """Bytes ``[starts[j], starts[j] + sizes[j])`` of the 1-D uint8 h5py dataset ``ds``
    (of the file at ``path``), overlapping or near spans merged (SPAN_GAP), in ONE read (a
    hyperslab union: HDF5 then visits each chunk once, not once a document; a read a span
    cost 3x more): (buffer, Spans)."""
    keep = sizes > 0
    starts, ends = starts[keep], starts[keep] + sizes[keep]
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    if not len(starts):
        return np.empty(0, np.uint8), Spans(np.zeros(1, np.int64), np.zeros(1, np.int64))
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > reach[:-1] + SPAN_GAP  # past every earlier span's end, and the gap
    first = np.flatnonzero(new)
    lo, hi = starts[first], np.maximum.reduceat(ends, first)
    at = np.concatenate(([0], np.cumsum(hi - lo)))
    buf = np.empty(int(at[-1]), np.uint8)
    try:
        if len(lo) == 1:
            ds.read_direct(buf, np.s_[int(lo[0]) : int(hi[0])])
        else:
            space = ds.id.get_space()
            space.select_none()
            for a, n in zip(lo.tolist(), (hi - lo).tolist(), strict=True):
                space.select_hyperslab((a,), (n,), op=h5py.h5s.SELECT_OR)
            ds.id.read(h5py.h5s.create_simple((len(buf),)), space, buf)
    except (OSError, ValueError) as e:  # h5py's errors do not name the file
        raise DataError(f"{path}: cannot read /{ds.name.lstrip('/')}: {e}") from None
    return buf, Spans(lo, at[:-1])


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
