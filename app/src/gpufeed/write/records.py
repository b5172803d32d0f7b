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
    """The samples written since the last committed part, in order: single samples as lists
    (one append each), columnar batches as arrays (no object per sample)."""

    def __init__(self):
        self.blocks: list[tuple] = []  # (payload, sizes, labels, crcs, items), sealed
        self.records: list[bytes] = []
        self.labels: list[int] = []
        self.crcs: list[int] = []
        self.items: list[int] = []
        self.count = 0
        self.nbytes = 0

    def add(self, item: int, record: bytes, label: int, crc: int) -> None:
        self.records.append(record)
        self.labels.append(label)
        self.crcs.append(crc)
        self.items.append(item)
        self.count += 1
        self.nbytes += len(record)

    def add_block(self, payload, sizes, labels, crcs, items) -> None:
        self._seal()
        self.blocks.append((payload, sizes, labels, crcs, items))
        self.count += len(sizes)
        self.nbytes += len(payload)

    def _seal(self) -> None:
        """The single samples so far as one block."""
        if not self.records:
            return
        recs = self.records
        self.blocks.append(
            (
                np.frombuffer(b"".join(recs), np.uint8),
                np.fromiter(map(len, recs), np.int64, len(recs)),
                np.asarray(self.labels, np.int64),
                np.asarray(self.crcs, np.uint32),
                np.asarray(self.items, np.int64),
            )
        )
        self.records, self.labels, self.crcs, self.items = [], [], [], []

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(payload, sizes, labels, crcs, items) of every pending sample, in order."""
        self._seal()
        if len(self.blocks) != 1:
            empty = (np.uint8, np.int64, np.int64, np.uint32, np.int64)
            self.blocks = [
                tuple(
                    np.concatenate([b[k] for b in self.blocks]) if self.blocks else np.zeros(0, t)
                    for k, t in enumerate(empty)
                )
            ]
        return self.blocks[0]

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
