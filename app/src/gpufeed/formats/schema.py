"""The sample schema: a sample is a dict of named fields, each of one type.

A schema is written into the manifest (``sample: {"kind": "fields", "fields": [...]}``) and
checked when a pack is opened. Field types, as a schema names them (a string shorthand, or
the manifest's dict form):

  type      shorthand          one value is                        stored as (one field's bytes)
  array     "float32[3,64,64]"  an array of that dtype and shape     raw C-order bytes
  ragged    "int32[-1]"         an array whose -1 dimensions vary    int64 shape, then raw bytes
            "float32[-1,4]"     (tokens, boxes, waveforms)
  image     "jpeg" "png" "webp" encoded image bytes (decoded on read) the file's bytes, as given
  bytes     "bytes"             bytes                                as given
  str       "str"               text                                 UTF-8
  int       "int"               an integer                           int64 little-endian
  float     "float"             a number                             float64 little-endian
  json      "json"              any JSON-able value                  UTF-8 JSON

A field may also say ``"compression": "zstd"`` (raw arrays, text, bytes, JSON; never images,
which are compressed already): its stored bytes are a zstd frame of the bytes above.
Everything here is numpy only: how a record is laid out is in formats/record.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.errors import UsageError

__all__ = [
    "FIELD_TYPES",
    "IMAGE_FORMATS",
    "IMAGE_MAGIC",
    "Field",
    "Schema",
    "fit_array",
    "fit_float",
    "fit_int",
    "infer_schema",
    "inferred_names",
    "parse_schema",
    "widened",
]

IMAGE_FORMATS = ("jpeg", "png", "webp")
SCALAR_TYPES = ("bytes", "str", "int", "float", "json")
FIELD_TYPES = ("array", "ragged", "image", *SCALAR_TYPES)
COMPRESSIONS = ("zstd",)
# a name is a plain identifier: it becomes part of tar member names and HDF5 attributes
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
ARRAY_TEXT = re.compile(r"([A-Za-z0-9<>=|]+)\[([-0-9, ]*)\]")


@dataclass(frozen=True)
class Field:
    """One named field: its type and, for arrays, dtype and shape (-1: varies)."""

    name: str
    type: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    format: str | None = None  # image: jpeg | png | webp
    compression: str | None = None

    @property
    def ragged(self) -> bool:
        return self.type == "ragged"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "type": self.type}
        if self.type in ("array", "ragged"):
            d.update(dtype=self.dtype, shape=list(self.shape))
        if self.type == "image":
            d["format"] = self.format
        if self.compression:
            d["compression"] = self.compression
        return d

    def describe(self) -> str:
        if self.type in ("array", "ragged"):
            dims = ",".join("*" if s < 0 else str(s) for s in self.shape)
            text = f"{np.dtype(self.dtype).name}[{dims}]"
        elif self.type == "image":
            text = f"image/{self.format}"
        else:
            text = self.type
        return text + (f" ({self.compression})" if self.compression else "")


# a value larger than this is no real pack's: its byte count would overflow int64 sums
MAX_SAMPLE_BYTES = 1 << 48
MAX_DIMS = 32  # numpy's own limit on dimensions


def _array_field(name: str, dtype, shape, compression) -> Field:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"field {name!r}: {dtype!r} is not a numpy dtype") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise UsageError(f"field {name!r}: dtype {dt} cannot be stored as raw bytes")
    try:
        if isinstance(shape, (str, bytes)) or any(isinstance(s, (bool, float)) for s in shape):
            raise TypeError
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise UsageError(
            f"field {name!r}: shape {shape!r}: expected a list of sizes (-1: varies)"
        ) from None
    if any(s < -1 for s in shape):
        raise UsageError(f"field {name!r}: shape {list(shape)}: sizes are >= 0, or -1 (varies)")
    fixed = math.prod(s for s in shape if s != -1) * dt.itemsize
    if len(shape) > MAX_DIMS or fixed > MAX_SAMPLE_BYTES:
        raise UsageError(
            f"field {name!r}: shape {list(shape)}: at most {MAX_DIMS} dimensions, and under "
            f"{MAX_SAMPLE_BYTES:,} bytes a value"
        )
    kind = "ragged" if -1 in shape else "array"
    return Field(name, kind, dtype=dt.str, shape=shape, compression=compression)


def _parse_text(name: str, text: str, compression: str | None) -> Field:
    text = text.strip()
    low = text.lower()
    if low in ("jpg", "jpeg", "png", "webp"):
        return Field(name, "image", format="jpeg" if low == "jpg" else low)
    if low in SCALAR_TYPES:
        return Field(name, low, compression=compression)
    m = ARRAY_TEXT.fullmatch(text)
    if m:
        dims = [d for d in m.group(2).replace(" ", "").split(",") if d]
        return _array_field(name, m.group(1), [int(d) for d in dims], compression)
    raise UsageError(
        f"field {name!r}: unknown type {text!r}; use jpeg, png, webp, bytes, str, int, float, "
        "json, an array such as 'float32[3,64,64]' or a ragged one such as 'int32[-1]'"
    )


def _parse_field(name: str, spec: Any) -> Field:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UsageError(
            f"field name {name!r}: use letters, digits and _ (not first), at most 64 characters"
        )
    if isinstance(spec, Field):
        spec = spec.to_json()
    if isinstance(spec, str):
        return _parse_text(name, spec, None)
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise UsageError(
            f"field {name!r}: expected a type name or a dict with 'type', got {spec!r}"
        )
    kind, comp = str(spec["type"]), spec.get("compression") or None
    if comp is not None and comp not in COMPRESSIONS:
        raise UsageError(f"field {name!r}: compression {comp!r}; use one of {COMPRESSIONS}")
    if kind in ("array", "ragged"):
        if "dtype" not in spec or "shape" not in spec:
            raise UsageError(f"field {name!r}: an {kind} field needs dtype and shape")
        field = _array_field(name, spec["dtype"], spec["shape"], comp)
        if field.type != kind:
            raise UsageError(f"field {name!r}: type {kind} but shape {list(field.shape)}")
        return field
    if kind == "image":
        fmt = str(spec.get("format", "jpeg")).lower()
        fmt = "jpeg" if fmt == "jpg" else fmt
        if fmt not in IMAGE_FORMATS:
            raise UsageError(f"field {name!r}: image format {fmt!r}; use one of {IMAGE_FORMATS}")
        if comp:
            raise UsageError(f"field {name!r}: images are compressed already; no compression")
        return Field(name, "image", format=fmt)
    if kind in SCALAR_TYPES:
        return Field(name, kind, compression=comp)
    return _parse_text(name, kind, comp)


@dataclass(frozen=True)
class Schema:
    """The fields of every sample, in a fixed order (the order they are stored in)."""

    fields: tuple[Field, ...]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def __getitem__(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> list[dict[str, Any]]:
        return [f.to_json() for f in self.fields]

    def to_json_dict(self) -> dict[str, dict[str, Any]]:
        """{name: the field's dict form}, as parse_schema takes it."""
        return {f.name: f.to_json() for f in self.fields}

    @classmethod
    def from_json(cls, fields: list[dict[str, Any]]) -> Schema:
        if not isinstance(fields, list) or not fields:
            raise UsageError(f"a schema is a non-empty list of fields, got {fields!r}")
        return parse_schema({d.get("name"): d for d in fields})

    def describe(self) -> str:
        return ", ".join(f"{f.name}: {f.describe()}" for f in self.fields)


def parse_schema(schema: Schema | Mapping[str, Any]) -> Schema:
    """A Schema from ``{"image": "jpeg", "caption": "str", "tokens": "int32[-1]"}`` (or the
    dict forms the manifest writes); a UsageError naming the field otherwise."""
    if isinstance(schema, Schema):
        return schema
    if not isinstance(schema, Mapping) or not schema:
        raise UsageError(
            "schema: expected a dict of field name -> type, such as "
            "{'image': 'jpeg', 'caption': 'str'}, got " + repr(schema)
        )
    return Schema(tuple(_parse_field(name, spec) for name, spec in schema.items()))


# --------------------------------------------------------------------------- values that fit
# One rule for every number stored: a value is stored only if the field's type holds it
# (integers by range, floats finite in -> finite out); never wrapped, never overflowed.
_INTS = {"i": ("<i1", "<i2", "<i4", "<i8"), "u": ("|u1", "<u2", "<u4", "<u8")}
_FLOATS = ("<f4", "<f8")
_COMPLEX = ("<c8", "<c16")


def fit_array(field: Field, arr: np.ndarray) -> np.ndarray:
    """``arr`` as the field's dtype; a UsageError naming the field where a value would not
    survive the cast (out of an integer type's range, finite turned infinite) or the kinds
    differ (floats into integers, numbers into bool...)."""
    want = np.dtype(field.dtype)
    if arr.dtype == want:
        return arr
    ints = arr.dtype.kind in "biu" and want.kind in "iu"
    if arr.dtype.hasobject or not (ints or np.can_cast(arr.dtype, want, "same_kind")):
        raise UsageError(f"field {field.name!r}: {arr.dtype} values do not fit the schema's {want}")
    if ints and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        info = np.iinfo(want)
        if lo < int(info.min) or hi > int(info.max):
            raise _too_wide(field, lo if lo < int(info.min) else hi, _wider_int(lo, hi, want))
    with np.errstate(over="ignore", invalid="ignore"):
        out = arr.astype(want)
    if want.kind in "fc" and not np.isfinite(out).all():
        lost = np.isfinite(arr) & ~np.isfinite(out)
        if lost.any():
            value = arr[lost].flat[0].item()
            raise _too_wide(field, value, _wider_float(arr[lost], want))
    return out


def fit_int(field: Field, value: Any) -> int:
    """An int field's value (int64): a UsageError where it is out of int64's range."""
    value = int(value)
    if not -(1 << 63) <= value < 1 << 63:
        instead = f"an array field, e.g. schema={{{field.name!r}: 'uint64[]'}}, or "
        raise UsageError(
            f"field {field.name!r}: value {_shown(value)} does not fit an int field (int64); "
            f"store it as {instead if 0 <= value < 1 << 64 else ''}str or json"
        )
    return value


def fit_float(field: Field, value: Any) -> float:
    """A float field's value (float64): a UsageError where a finite value would be stored
    as infinity (a number beyond float64's range)."""
    try:
        out = float(value)
    except OverflowError:  # a Python int beyond float64's range
        out = math.inf
    finite = isinstance(value, (int, np.integer)) or bool(np.isfinite(value))
    if finite and math.isinf(out):
        raise UsageError(
            f"field {field.name!r}: value {_shown(value)} does not fit a float field "
            "(float64); store it as str or json"
        )
    return out


def _shown(value: Any) -> str:
    """A number as an error message shows it (a huge int by its first digits)."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}... ({len(text)} characters)"


def _too_wide(field: Field, value: Any, wider: str | None) -> UsageError:
    """The value does not fit the field's dtype: which dtype to declare instead."""
    want = np.dtype(field.dtype)
    said = f"field {field.name!r}: value {_shown(value)} does not fit the schema's {want.name}"
    if wider is None:
        return UsageError(f"{said}; store it as another type (str, json)")
    dims = ",".join(str(s) for s in field.shape)
    name = np.dtype(wider).name
    return UsageError(
        f"{said}; declare a wider dtype in the schema, e.g. schema={{{field.name!r}: "
        f"'{name}[{dims}]'}} (gpufeed pack --schema {field.name}={name}[{dims}])"
    )


def _wider_int(lo: int, hi: int, want: np.dtype) -> str | None:
    """The smallest integer dtype holding lo..hi (of want's signedness where it can)."""
    order = _INTS["u"] + _INTS["i"] if want.kind == "u" and lo >= 0 else _INTS["i"] + _INTS["u"]
    for dt in order:
        info = np.iinfo(dt)
        if int(info.min) <= lo and hi <= int(info.max):
            return dt
    return None


def _wider_float(values: np.ndarray, want: np.dtype) -> str | None:
    """The smallest float (complex) dtype holding these finite values."""
    for dt in _FLOATS if want.kind == "f" else _COMPLEX:
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(values.astype(dt)).all():
                return dt
    return None


def _infer_field(name: str, value: Any) -> Any:
    if isinstance(value, bool):
        raise UsageError(f"field {name!r}: bool; store it as int, or declare a schema")
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        fmt = sniff_image(bytes(value[:16]))
        return fmt or "bytes"
    if isinstance(value, (dict, list, tuple)) or value is None:
        return "json"
    arr = np.asarray(value)  # a tensor (numpy protocol) or an array
    if arr.dtype.hasobject:
        raise UsageError(f"field {name!r}: cannot infer a type for {type(value).__name__}")
    return {"type": "array", "dtype": arr.dtype.str, "shape": list(arr.shape)}


def infer_schema(sample: Mapping[str, Any], declared: Mapping[str, Any] | None = None) -> Schema:
    """The schema of a first sample: arrays of its shape (a Writer makes a size that varies
    later -1: widened), image bytes by their magic number, the rest by Python type.
    ``declared``: a partial schema; the fields it names are as it says (in the sample's
    order), the others inferred."""
    if not isinstance(sample, Mapping) or not sample:
        raise UsageError(f"a sample is a non-empty dict of fields, got {type(sample).__name__}")
    given = dict(parse_schema(declared).to_json_dict()) if declared else {}
    unknown = [name for name in given if name not in sample]
    if unknown:
        raise UsageError(
            f"the schema names {unknown}, which the first sample does not hold "
            f"(its fields: {sorted(sample)})"
        )
    return parse_schema(
        {name: given.get(name) or _infer_field(name, v) for name, v in sample.items()}
    )


def inferred_names(schema: Schema, declared: Mapping[str, Any] | None) -> list[str]:
    """The fields of ``schema`` that were inferred: those ``declared`` does not name."""
    named = set(parse_schema(declared).names) if declared else set()
    return [name for name in schema.names if name not in named]


def widened(field: Field, value: Any) -> Field | None:
    """An inferred fixed-shape array field made to hold ``value`` too: the same dtype and
    number of dimensions, -1 where the sizes differ (a ragged field); None when ``value``
    fits it already or cannot be made to (another dtype or number of dimensions)."""
    if field.type not in ("array", "ragged") or isinstance(value, (bytes, str)):
        return None
    arr = np.asarray(value)
    if arr.dtype.hasobject or arr.ndim != len(field.shape):
        return None
    if arr.dtype != np.dtype(field.dtype) and not np.can_cast(arr.dtype, field.dtype, "safe"):
        return None
    shape = tuple(
        -1 if w != n and w != -1 else w for n, w in zip(arr.shape, field.shape, strict=True)
    )
    if shape == field.shape:
        return None
    return _array_field(field.name, field.dtype, shape, field.compression)


# the magic numbers that start a file of these image formats (webp: RIFF, then WEBP at 8)
IMAGE_MAGIC = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


def sniff_image(head: bytes) -> str | None:
    """jpeg, png or webp by the file's magic number; None for anything else."""
    for name, magic in IMAGE_MAGIC.items():
        if head.startswith(magic):
            return name
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "webp"
    return None
