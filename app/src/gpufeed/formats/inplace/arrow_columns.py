"""Arrow columns as gpufeed fields: which field type each Arrow type becomes, and a column of
rows turned into each row's stored field bytes (formats/record.py), so the data layer decodes
them as it decodes a multi-field pack's.

  Arrow type                                  field
  int*, uint*, bool                           int
  float*                                      float
  string, large_string                        str
  binary (image bytes by their magic)         image (jpeg, png, webp) or bytes
  struct<bytes, path> (the Hub's Image)       image, from its bytes
  struct<bytes, path> (the Hub's Audio)       bytes: the encoded file (decoded by arrow_rows)
  fixed_size_list<...> of numbers             array, e.g. float32[3, 4]
  list<...> of numbers (outer size varies)    ragged, e.g. int32[-1], float32[-1, 4]
  dictionary<T>                               as T
  timestamp, date, time, decimal              str (Arrow's text of the value)
  anything else (list<string>, struct...)     json

Nulls are no value gpufeed stores: a null is an error naming the row and column
(:func:`null_problem`), which ``on_error="skip"`` turns into a skipped sample; or, with
``nulls="mask"``, the type's empty value (:func:`empty_value`) and a ``<column>_valid`` field
(:func:`valid_field`, a bool) that says so.
pyarrow is imported by the functions that need it (importing gpufeed costs no pyarrow).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from gpufeed.formats.schema import Field, parse_schema, sniff_image

__all__ = [
    "column_field",
    "empty_value",
    "hub_features",
    "null_problem",
    "null_rows",
    "parse_field",
    "stored_column",
    "stored_masked",
    "valid_field",
]

_INT64 = np.dtype("<i8")
# the Hub's feature types whose Arrow column is struct<bytes, path>
HUB_FILES = ("Image", "Audio")


def hub_features(schema) -> dict[str, Any]:
    """The Hugging Face features recorded in an Arrow schema's metadata ({} if none or
    unreadable): they tell an Image from other struct<bytes, path> columns and give a
    ClassLabel's names."""
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(meta)["info"]["features"]
    except (TypeError, ValueError, KeyError):
        return {}
    return features if isinstance(features, dict) else {}


def _is_file_struct(t) -> bool:
    import pyarrow as pa

    if not pa.types.is_struct(t):
        return False
    names = {t.field(k).name for k in range(t.num_fields)}
    return "bytes" in names and names <= {"bytes", "path", "sampling_rate"}


def _array_dims(t) -> tuple[list[int], Any]:
    """(the sizes of nested lists, -1 where a list's size varies; the innermost type)."""
    import pyarrow as pa

    dims = []
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        dims.append(t.list_size if pa.types.is_fixed_size_list(t) else -1)
        t = t.value_type
    return dims, t


def _numeric(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t)


def column_field(name: str, t, feature: Any, first: bytes | None) -> Field:
    """The field of column `name`, Arrow type `t`: `feature` is its Hugging Face feature
    (or None), `first` the first bytes of its first value where it holds bytes (to tell
    images by their magic number)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    hub = feature.get("_type") if isinstance(feature, dict) else None
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return parse_field(name, "int")
    if pa.types.is_floating(t):
        return parse_field(name, "float")
    if pa.types.is_string(t) or pa.types.is_large_string(t) or _as_text(t):
        return parse_field(name, "str")
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return parse_field(name, sniff_image(first or b"") or "bytes")
    if _is_file_struct(t) and hub in (None, "Image"):
        return parse_field(name, sniff_image(first or b"") or "bytes")
    if _is_file_struct(t):
        return parse_field(name, "bytes")  # Audio, Video, Pdf: the file's encoded bytes
    dims, inner = _array_dims(t)
    if dims and _numeric(inner) and -1 not in dims[1:]:
        dtype = np.dtype(inner.to_pandas_dtype()).str
        kind = "ragged" if -1 in dims else "array"
        return parse_field(name, {"type": kind, "dtype": dtype, "shape": dims})
    return parse_field(name, "json")


def parse_field(name: str, spec: Any) -> Field:
    """One field, as parse_schema reads `spec` (a type name or a dict)."""
    return parse_schema({name: spec}).fields[0]


def _as_text(t) -> bool:
    """Arrow types gpufeed reads as their text (a timestamp's ISO form, a decimal's digits)."""
    import pyarrow as pa

    view = getattr(pa.types, "is_string_view", None)
    return pa.types.is_temporal(t) or pa.types.is_decimal(t) or bool(view and view(t))


def first_bytes(column) -> bytes | None:
    """The first bytes of the first non-null value of a bytes or struct<bytes, path> column
    (a ChunkedArray or Array), for sniff_image."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
    if pa.types.is_dictionary(column.type):
        return None
    if _is_file_struct(column.type):
        column = column.field("bytes")
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return None
    for k in range(min(len(column), 64)):
        if column[k].is_valid:
            return column[k].as_py()[:16]
    return None


def null_rows(field: Field, column) -> np.ndarray | None:
    """Per row of `column` (an Array), whether it holds a null that `field` cannot store (a
    null value; for an image, no bytes; for a list, a null element); None when none does."""
    import pyarrow.compute as pc

    struct = _is_file_struct(column.type)
    if not column.null_count and field.type not in ("array", "ragged"):
        if not struct or not column.field("bytes").null_count:
            return None  # Arrow counted them already: the common case, no pass over the rows
    nulls = column.is_null()
    if struct:
        nulls = pc.or_(nulls, column.field("bytes").is_null())
    if field.type in ("array", "ragged") and len(column):
        nulls = pc.or_(nulls, _inner_nulls(column))
    rows = np.asarray(nulls.to_numpy(zero_copy_only=False), dtype=bool)
    return rows if rows.any() else None


def null_problem(field: Field, column) -> int | None:
    """The position of the first row of `column` that null_rows reports, or None."""
    rows = null_rows(field, column)
    return None if rows is None else int(np.argmax(rows))


def valid_field(name: str) -> Field:
    """The field that says, per row, whether column `name` held a value (nulls="mask")."""
    return parse_field(f"{name}_valid", {"type": "array", "dtype": "|b1", "shape": []})


def stored_masked(field: Field, column, nulls: np.ndarray | None) -> list:
    """stored_column with each row that `nulls` marks stored as `field`'s empty value."""
    import pyarrow as pa

    if nulls is None:
        return stored_column(field, column)
    out = [empty_value(field)] * len(column)
    keep = np.flatnonzero(~nulls)
    if len(keep):
        kept = stored_column(field, column.take(pa.array(keep)))
        for j, value in zip(keep.tolist(), kept, strict=True):
            out[j] = value
    return out


def empty_value(field: Field) -> bytes:
    """The stored bytes of a null under nulls="mask": zero, empty, or a 1x1 black image of
    the field's format (an image field's values must decode)."""
    kind = field.type
    if kind in ("int", "float"):
        return bytes(8)
    if kind == "json":
        return b"null"
    if kind == "image":
        return _blank_image(field.format or "png")
    if kind == "array":
        return bytes(int(np.prod(field.shape, dtype=np.int64)) * np.dtype(field.dtype).itemsize)
    if kind == "ragged":
        return np.asarray([0, *(max(d, 0) for d in field.shape[1:])], dtype=_INT64).tobytes()
    return b""  # str, bytes


_BLANK: dict[str, bytes] = {}


def _blank_image(fmt: str) -> bytes:
    if fmt not in _BLANK:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (1, 1)).save(buf, format={"jpeg": "JPEG", "webp": "WEBP"}.get(fmt, "PNG"))
        _BLANK[fmt] = buf.getvalue()
    return _BLANK[fmt]


def _inner_nulls(column):
    """Per row: whether any element of a (nested) list column is null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parent = pc.list_parent_indices(column) if len(column) else None
    values = column.flatten()
    inner = values.is_null()
    if _array_dims(values.type)[0]:
        inner = pc.or_(inner, _inner_nulls(values))
    rows = np.zeros(len(column), dtype=bool)
    bad = np.asarray(inner.to_numpy(zero_copy_only=False), dtype=bool)
    if bad.any():
        rows[np.asarray(parent.to_numpy())[bad]] = True
    return pa.array(rows)


def stored_column(field: Field, column) -> list:
    """Each row's stored bytes of `field` from `column` (an Array with no null that
    null_problem reports), as formats.record lays them out."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    kind = field.type
    if kind in ("int", "float"):
        dtype = _INT64 if kind == "int" else np.dtype("<f8")
        values = _numbers(field, column, dtype)
        return list(values.view(np.uint8).reshape(len(values), 8))
    if kind == "str":
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            column = column.cast(pa.string())
        return [s.encode("utf-8") for s in column.to_pylist()]
    if kind in ("image", "bytes"):
        if _is_file_struct(column.type):
            column = column.field("bytes")
        return column.to_pylist()
    if kind in ("array", "ragged"):
        return _arrays(field, column)
    return [json.dumps(v, allow_nan=False).encode("utf-8") for v in column.to_pylist()]


def _numbers(field: Field, column, dtype: np.dtype) -> np.ndarray:
    import pyarrow as pa

    values = column.to_numpy(zero_copy_only=False)
    if pa.types.is_uint64(column.type) and len(values) and int(values.max()) >= 1 << 63:
        raise ValueError(
            f"column {field.name!r}: value {int(values.max())} does not fit an int field (int64)"
        )
    return np.ascontiguousarray(values, dtype=dtype)


def _arrays(field: Field, column) -> list:
    """A list column's rows: fixed inner sizes read as one numpy array, split by the outer
    list's offsets; the shape of a ragged row stored before its bytes."""
    n, dims = len(column), list(field.shape)
    dtype = np.dtype(field.dtype)
    if dims[0] == -1:
        offsets = column.offsets.to_numpy()  # of the sliced rows, into column.values
        flat, lo = column.values, int(offsets[0])
        lens = np.diff(offsets)
    else:
        flat, lo, lens = column, 0, np.full(n, dims[0], dtype=np.int64)
        flat = flat.flatten()
    for _ in dims[1:]:
        flat = flat.flatten()
    values = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=dtype)
    inner = int(np.prod(dims[1:], dtype=np.int64))
    out, pos = [], lo * inner
    for k in lens.tolist():
        size = k * inner
        arr = values[pos : pos + size]
        pos += size
        if field.type == "array":
            out.append(arr.view(np.uint8))
        else:
            shape = np.asarray([k, *dims[1:]], dtype=_INT64)
            out.append(shape.tobytes() + arr.tobytes())
    return out
