"""A sample dict as a Writer's part holds it: its record, label and crc32
(gpufeed.formats.record encodes; here its refusals are named and its encoder made once)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpufeed.errors import UsageError
from gpufeed.formats.checksums import crc32
from gpufeed.formats.record import encode_value, record_encoder
from gpufeed.formats.schema import Schema

__all__ = ["encoded", "label_of"]


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
