"""A sample dict as a Writer's part holds it: its record, label and crc32
(gpufeed.formats.record encodes; here its refusals are named and its encoder made once)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gpufeed.errors import UsageError
from gpufeed.formats.checksums import crc32, raw_crc32
from gpufeed.formats.record import encode_value, record_encoder
from gpufeed.formats.schema import Schema

__all__ = ["Pending", "batch_length", "batch_records", "encoded", "label_of", "sample_encoder"]


def encoded(schema: Schema, sample: Mapping[str, Any]) -> tuple[bytes, int, int]:
    """A sample as a part holds it: (record, label, crc32 of the record)."""
    encode, has_label = _encoder(schema)
    try:
        record = encode(sample)
    except (ValueError, TypeError, OverflowError) as e:  # numpy's or PIL's, on a bad value
        raise UsageError(f"{_failing_field(schema, sample)}cannot be stored ({e})") from None
    label = int(sample["label"]) if has_label else -1
    return record, label, crc32(record)


def _failing_field(schema: Schema, sample: Mapping[str, Any]) -> str:
    """'field NAME: ' of the first field whose value does not encode on its own ('' if none
    does: the error is the sample's)."""
    for f in schema.fields:
        try:
            encode_value(f, sample[f.name])
        except Exception:  # noqa: BLE001 - any failure names this field
            return f"field {f.name!r}: "
    return ""


_ENCODERS: dict[int, tuple[Schema, Any, bool]] = {}  # id(schema): (schema, encoder, label?)


def _encoder(schema: Schema) -> tuple[Any, bool]:
    """The schema's record encoder (made once a schema) and whether it has an int label."""
    got = _ENCODERS.get(id(schema))
    if got is None or got[0] is not schema:
        if len(_ENCODERS) > 64:
            _ENCODERS.clear()
        got = _ENCODERS[id(schema)] = (schema, record_encoder(schema), _has_label(schema))
    return got[1], got[2]


def label_of(schema: Schema, sample: Mapping[str, Any]) -> int:
    """The pack's per-sample label (class-balanced samplers, verify): an int field named
    "label", else -1."""
    return int(sample["label"]) if _has_label(schema) else -1


def _has_label(schema: Schema) -> bool:
    """Whether the schema has the pack's label: an int field named "label"."""
    try:
        return schema["label"].type == "int"
    except KeyError:
        return False


# --------------------------------------------------------------------------- the fast paths
def sample_encoder(schema: Schema):
    """encoded() for one schema, made once, for Writer.write's loop: (record, label, crc32)
    of a sample, the same bytes. A sample already in the record's form costs one pass over
    its fields (formats.record.record_encoder's fast path); a refusal raises, and the caller
    goes the general way, which names the field and the sample."""
    encode, has_label = _encoder(schema)
    checksum = raw_crc32

    def one(sample):
        record = encode(sample)
        label = int(sample["label"]) if has_label else -1
        return record, label, checksum(record) & 0xFFFFFFFF

    return one


def batch_records(schema: Schema, columns: Mapping[str, Any], count: int):
    """A columnar batch's records at once with numpy: (payload uint8 [count * size], size,
    labels int64 [count]), every record ``size`` bytes; None where a column is not already
    what the fixed-size record holds (an uncompressed fixed-shape array of the field's dtype
    [count, *shape], an int or float field as a 1-d integer or float array): the caller then
    writes the batch a row at a time, through every check. The bytes are encode_record's."""
    parts = []
    for f in schema.fields:
        col = columns[f.name]
        if type(col) is not np.ndarray or f.compression or len(col) != count:
            return None
        kind = col.dtype.kind
        if f.type == "array" and col.dtype == np.dtype(f.dtype) and col.shape[1:] == f.shape:
            parts.append(np.ascontiguousarray(col).reshape(count, -1).view(np.uint8))
        elif f.type == "int" and col.ndim == 1 and kind in "iu" and _fits_int64(col):
            parts.append(col.astype(_INT64).reshape(count, 1).view(np.uint8))
        elif f.type == "float" and col.ndim == 1 and kind == "f" and col.dtype.itemsize <= 8:
            parts.append(col.astype(_FLOAT64).reshape(count, 1).view(np.uint8))
        else:
            return None
    head = np.asarray([p.shape[1] for p in parts], _INT64).view(np.uint8)
    size = len(head) + sum(p.shape[1] for p in parts)
    out = np.empty((count, size), np.uint8)
    out[:, : len(head)] = head
    at = len(head)
    for p in parts:
        out[:, at : at + p.shape[1]] = p
        at += p.shape[1]
    labels = (
        columns["label"].astype(np.int64) if _has_label(schema) else np.full(count, -1, np.int64)
    )
    return out.reshape(-1), size, labels


def _fits_int64(col: np.ndarray) -> bool:
    """An integer column every value of which an int field (int64) holds."""
    return col.dtype != np.uint64 or not len(col) or int(col.max()) < (1 << 63)


_INT64 = np.dtype("<i8")
_FLOAT64 = np.dtype("<f8")


class Pending:
    """The samples written since the last committed part, in order: their records back to
    back in one buffer (one allocation a part: keeping thousands of records of a few KiB as
    objects until the part is joined cost more in the allocator, about 2 us a record, than
    copying them), their sizes, labels, crc32s and inputs as lists (single samples, one
    append each) or arrays (columnar batches, no object a sample).

    ``capacity``: the bytes reserved at first (pages are touched only as records come); a
    record that does not fit grows the buffer by a copy. ``buffer``: one to fill again (a
    part's, written: pages touched once cost ~20x less to fill than new ones here, where
    every new page is a fault), else a new one."""

    def __init__(self, capacity: int = 1 << 20, buffer: np.ndarray | None = None):
        self._buf = buffer if buffer is not None else np.empty(max(capacity, 1), np.uint8)
        self._view = memoryview(self._buf)
        self._index: list[tuple] = []  # (sizes, labels, crcs, items) arrays, sealed, in order
        self.sizes: list[int] = []
        self.labels: list[int] = []
        self.crcs: list[int] = []
        self.items: list[int] = []
        self.count = 0
        self.nbytes = 0

    def add(self, item: int, record, label: int, crc: int) -> None:
        n = len(record)
        end = self.nbytes + n
        if end > len(self._buf):
            self._grow(end)
        self._view[self.nbytes : end] = record
        self.nbytes = end
        self.sizes.append(n)
        self.labels.append(label)
        self.crcs.append(crc)
        self.items.append(item)
        self.count += 1

    def add_block(self, payload, sizes, labels, crcs, items) -> None:
        self._seal()
        end = self.nbytes + len(payload)
        if end > len(self._buf):
            self._grow(end)
        self._buf[self.nbytes : end] = payload
        self.nbytes = end
        self._index.append((sizes, labels, crcs, items))
        self.count += len(sizes)

    @property
    def buffer(self) -> np.ndarray:
        """The buffer the records are in (for the next Pending once they are written)."""
        return self._buf

    def _grow(self, need: int) -> None:
        grown = np.empty(max(need, 2 * len(self._buf)), np.uint8)
        grown[: self.nbytes] = self._buf[: self.nbytes]
        self._buf, self._view = grown, memoryview(grown)

    def _seal(self) -> None:
        """The single samples' index so far as arrays."""
        if not self.sizes:
            return
        self._index.append(
            (
                np.asarray(self.sizes, np.int64),
                np.asarray(self.labels, np.int64),
                np.asarray(self.crcs, np.uint32),
                np.asarray(self.items, np.int64),
            )
        )
        self.sizes, self.labels, self.crcs, self.items = [], [], [], []

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(payload, sizes, labels, crcs, items) of every pending sample, in order; the
        payload is a view of the buffer (this Pending takes no more samples once a part is
        made of it)."""
        self._seal()
        if len(self._index) != 1:
            empty = (np.int64, np.int64, np.uint32, np.int64)
            self._index = [
                tuple(
                    np.concatenate([b[k] for b in self._index]) if self._index else np.zeros(0, t)
                    for k, t in enumerate(empty)
                )
            ]
        return (self._buf[: self.nbytes], *self._index[0])

    def rows(self) -> list[tuple[int, memoryview, int, int]]:
        """(item, record, label, crc32) of each pending sample (a schema widened: each one
        encoded again)."""
        payload, sizes, labels, crcs, items = self.arrays()
        ends = np.cumsum(sizes).tolist()
        view = memoryview(payload)
        return [
            (i, view[e - n : e], lab, c)
            for i, e, n, lab, c in zip(
                items.tolist(), ends, sizes.tolist(), labels.tolist(), crcs.tolist(), strict=True
            )
        ]


def batch_length(dest, columns: Mapping[str, Any]) -> int:
    """The samples in a columnar batch: every column's length, the same (else a
    UsageError naming the columns)."""
    if not isinstance(columns, Mapping):
        raise UsageError(
            f"{dest}: write_batch takes a dict of columns (field -> values), got "
            f"{type(columns).__name__}; write() takes one sample"
        )
    lengths = {name: len(col) for name, col in columns.items()}
    if len(set(lengths.values())) > 1:
        raise UsageError(f"{dest}: write_batch's columns differ in length: {lengths}")
    return next(iter(lengths.values()), 0)
