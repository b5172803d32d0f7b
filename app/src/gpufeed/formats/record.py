"""One multi-field sample as stored: a record, and its tar members.

A record (what HDF5, LMDB and mmap store per sample, and what crc32 covers in every format):

  int64 little-endian [F]   the stored size of each field, in schema order
  field bytes               each field's stored bytes (formats/schema.py), back to back

Read one with numpy alone: ``sizes = np.frombuffer(rec, "<i8", F)``; field k starts at
``8 * F + sizes[:k].sum()``. A ragged field's bytes start with its shape (int64 [ndim]).

In tar shards each field is its own member, ``KEY.NAME.EXT`` (WebDataset's layout: the
sample dict has the key ``NAME.EXT``): arrays as .npy, str .txt, int .cls (decimal), float
and JSON .json, bytes .bin, images .jpg/.png/.webp; a zstd field adds .zst to its
extension and holds the zstd frame of the bytes above.
"""

from __future__ import annotations

import functools
import io
import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from gpufeed.errors import UsageError
from gpufeed.formats import zstd
from gpufeed.formats.npy import parse_header
from gpufeed.formats.schema import (
    IMAGE_MAGIC,
    Field,
    Schema,
    fit_array,
    fit_float,
    fit_int,
    sniff_image,
)
from gpufeed.formats.tar.members import header_size

__all__ = [
    "TAR_EXT",
    "Column",
    "Records",
    "decode_record",
    "decode_value",
    "encode_record",
    "join_record",
    "member_bytes",
    "member_name",
    "npy_header_for",
    "record_encoder",
    "plain_bytes",
    "record_from_members",
    "split_joined",
    "split_record",
    "split_records",
    "stored_from_member",
]

TAR_EXT = {"array": "npy", "ragged": "npy", "str": "txt", "int": "cls", "float": "json"}
TAR_EXT.update(bytes="bin", json="json")
IMAGE_EXT = {"jpeg": "jpg", "png": "png", "webp": "webp"}
_INT64 = np.dtype("<i8")


def _as_array(field: Field, value: Any) -> np.ndarray:
    want = np.dtype(field.dtype)
    arr = fit_array(field, np.asarray(value))
    if len(arr.shape) != len(field.shape) or any(
        want_n >= 0 and n != want_n for n, want_n in zip(arr.shape, field.shape, strict=True)
    ):
        raise _shape_error(field, arr, want)
    return np.require(arr, requirements="C")  # np.ascontiguousarray makes 0-d 1-d


def _shape_error(field: Field, arr: np.ndarray, want: np.dtype) -> UsageError:
    """The shape does not fit the schema's: how to declare the sizes that vary."""
    said = f"field {field.name!r}: shape {list(arr.shape)}, the schema says {field.describe()}"
    if len(arr.shape) != len(field.shape):
        return UsageError(f"{said}: another number of dimensions (every sample has the same)")
    dims = ",".join("-1" if n != w else str(n) for n, w in zip(arr.shape, field.shape, strict=True))
    return UsageError(
        f"{said} (-1/* varies); declare varying sizes with -1, e.g. "
        f"schema={{{field.name!r}: '{want.name}[{dims}]'}} "
        f"(gpufeed pack --schema {field.name}={want.name}[{dims}])"
    )


def _encode_plain(field: Field, value: Any) -> bytes:
    kind = field.type
    if kind == "array":
        return _as_array(field, value).tobytes()
    if kind == "ragged":
        arr = _as_array(field, value)
        return np.asarray(arr.shape, dtype=_INT64).tobytes() + arr.tobytes()
    if kind == "image":
        return _image_bytes(field, value)
    if kind == "bytes" and isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if kind == "str" and isinstance(value, str):
        return value.encode("utf-8")
    if kind == "int" and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return np.asarray(fit_int(field, value), dtype=_INT64).tobytes()
    if kind == "float" and isinstance(value, (int, float, np.integer, np.floating)):
        return np.asarray(fit_float(field, value), dtype="<f8").tobytes()
    if kind == "json":
        try:
            return json.dumps(value, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise UsageError(f"field {field.name!r}: not JSON-able: {e}") from None
    raise UsageError(
        f"field {field.name!r}: the schema says {field.type}, got {type(value).__name__}"
    )


def _image_bytes(field: Field, value: Any) -> bytes:
    """Encoded bytes as given (checked by their magic number), or an HWC/HW uint8 array
    encoded in the field's format (PNG lossless; JPEG and WebP at quality 95)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        found = sniff_image(data[:16])
        if found != field.format:
            raise UsageError(
                f"field {field.name!r}: expected {field.format} bytes, found "
                f"{found or 'bytes of no image format gpufeed knows'}"
            )
        return data
    from PIL import Image

    arr = np.asarray(value)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
        raise UsageError(
            f"field {field.name!r}: an image is encoded bytes or a uint8 HxW(xC) array, "
            f"got {arr.dtype} {list(arr.shape)}"
        )
    buf = io.BytesIO()
    kw = {} if field.format == "png" else {"quality": 95}
    Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[2] == 1 else arr).save(
        buf, format=field.format.upper(), **kw
    )
    return buf.getvalue()


def encode_value(field: Field, value: Any) -> bytes:
    """One field's stored bytes (compressed when the field says so)."""
    data = _encode_plain(field, value)
    if field.compression == "zstd":
        return zstd.compress(data)
    return data


def encode_record(schema: Schema, sample: Mapping[str, Any]) -> bytes:
    """A sample dict -> its record; every field of the schema, nothing else."""
    if not isinstance(sample, Mapping):
        raise UsageError(f"a sample is a dict of fields, got {type(sample).__name__}")
    names = schema.names
    extra = [k for k in sample if k not in names]
    missing = [k for k in names if k not in sample]
    if extra or missing:
        raise UsageError(
            f"sample fields {sorted(sample)} differ from the schema's {names}"
            + (f": missing {missing}" if missing else "")
            + (f": not in the schema {extra}" if extra else "")
        )
    return join_record([_stored(f, sample[f.name]) for f in schema.fields])


_INT64_RANGE = (-(1 << 63), 1 << 63)


def record_encoder(schema: Schema):
    """encode_record for one schema, made once: a sample that is a plain dict of exactly the
    schema's fields, each already what the record stores (a C-contiguous array of the
    field's dtype and shape, fixed or ragged; an int in int64's range; a float; bytes; a
    str; an image field's encoded bytes, of its format) skips the general checks and
    conversions (the same bytes: a value of the field's own dtype always fits it); a field
    that is not goes through them alone, and a sample that is no such dict through
    encode_record (their checks and errors).

    The function is generated for the schema (as dataclasses and namedtuple make theirs): one
    straight run of tests a field, no loop or lookup a sample, about 0.5 us for an image and a
    label where a loop over the fields took 2. Only the kinds' fixed lines become code; field
    names, dtypes and shapes are passed in as variables, never written into it."""
    env: dict[str, Any] = {
        "encode_record": encode_record,
        "schema": schema,
        "MISSING": _MISSING,
        "ndarray": np.ndarray,
        "asarray": np.asarray,
        "stored": _stored,
        "fits": _fits_ragged,
        "sniff": sniff_image,
        "INT64": _INT64,
        "int64": struct.Struct("<q").pack,
        "float64": struct.Struct("<d").pack,
        "head": struct.Struct(f"<{len(schema.fields)}q").pack,
        "lo": _INT64_RANGE[0],
        "hi": _INT64_RANGE[1],
    }
    lines = [
        "def encode(sample):",
        f"    if type(sample) is not dict or len(sample) != {len(schema.fields)}:",
        "        return encode_record(schema, sample)",
    ]
    for k, f in enumerate(schema.fields):
        env[f"name{k}"], env[f"field{k}"] = f.name, f
        if f.type in ("array", "ragged"):
            env[f"dtype{k}"], env[f"shape{k}"] = np.dtype(f.dtype), f.shape
        if f.type == "image":  # a magic number to start with, or (webp) the sniff
            env[f"format{k}"], env[f"magic{k}"] = f.format, IMAGE_MAGIC.get(f.format)
        lines += [f"    v{k} = sample.get(name{k}, MISSING)"]
        fast = _FAST_LINES.get(_fast_kind(f), ())
        lines += [line.format(k=k) for line in (*fast, *_GENERAL_LINES[bool(fast)])]
    n = len(schema.fields)
    sizes, values = ", ".join(f"s{k}" for k in range(n)), ", ".join(f"v{k}" for k in range(n))
    lines.append(f"    return b''.join((head({sizes}), {values}))")
    exec(compile("\n".join(lines), f"<record encoder {schema.describe()[:60]}>", "exec"), env)  # noqa: S102
    return env["encode"]


_MISSING = object()
_ARRAY, _RAGGED, _INT, _FLOAT, _BYTES, _STR, _IMAGE = range(7)
_KINDS = {
    "ragged": _RAGGED,
    "int": _INT,
    "float": _FLOAT,
    "bytes": _BYTES,
    "str": _STR,
    "image": _IMAGE,
}

# each fast kind's test and conversion of field k's value v{k} to its stored bytes (size s{k})
_PLAIN = "type(v{k}) is ndarray and v{k}.dtype == dtype{k} and v{k}.flags.c_contiguous"
_FAST_LINES: dict[int, tuple[str, ...]] = {
    _ARRAY: (  # stored as it is
        "    if " + _PLAIN + " and v{k}.shape == shape{k}:",
        "        s{k} = v{k}.nbytes",
    ),
    _RAGGED: (  # its shape, then its bytes
        "    if " + _PLAIN + " and fits(shape{k}, v{k}.shape):",
        "        v{k} = asarray(v{k}.shape, INT64).tobytes() + v{k}.tobytes()",
        "        s{k} = len(v{k})",
    ),
    _INT: (
        "    if type(v{k}) is int and lo <= v{k} < hi:",
        "        v{k} = int64(v{k})",
        "        s{k} = 8",
    ),
    _FLOAT: (
        "    if type(v{k}) is float:",
        "        v{k} = float64(v{k})",
        "        s{k} = 8",
    ),
    _BYTES: (
        "    if type(v{k}) is bytes:",
        "        s{k} = len(v{k})",
    ),
    _STR: (
        "    if type(v{k}) is str:",
        "        v{k} = v{k}.encode('utf-8')",
        "        s{k} = len(v{k})",
    ),
    _IMAGE: (  # encoded bytes of the field's format, stored as given
        "    if type(v{k}) is bytes and (v{k}.startswith(magic{k}) if magic{k}"
        " else sniff(v{k}[:16]) == format{k}):",
        "        s{k} = len(v{k})",
    ),
}
# the general way for a value the fast test did not take (True: after such a test)
_GENERAL_LINES = {
    True: (
        "    else:",
        "        if v{k} is MISSING:",
        "            return encode_record(schema, sample)",
        "        v{k} = stored(field{k}, v{k})",
        "        s{k} = v{k}.nbytes if type(v{k}) is ndarray else len(v{k})",
    ),
    False: (
        "    if v{k} is MISSING:",
        "        return encode_record(schema, sample)",
        "    v{k} = stored(field{k}, v{k})",
        "    s{k} = v{k}.nbytes if type(v{k}) is ndarray else len(v{k})",
    ),
}


def _fast_kind(f: Field) -> int | None:
    """How the encoder's fast path takes the field's values, None where it does not (a
    compressed field, an image, json: encode_value's own work)."""
    if f.compression == "zstd":
        return None
    if f.type == "array" and all(d >= 0 for d in f.shape):
        return _ARRAY
    return _KINDS.get(f.type)


def _plain_array(v: Any, dtype: np.dtype) -> bool:
    """An ndarray of the field's dtype, C-contiguous: what the record stores as it is."""
    return type(v) is np.ndarray and v.dtype == dtype and v.flags.c_contiguous


def _fits_ragged(declared: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """An array of this shape fits a ragged field's declared one (-1: any size)."""
    return len(shape) == len(declared) and all(
        w < 0 or n == w for n, w in zip(shape, declared, strict=True)
    )


def _stored(field: Field, value: Any):
    """encode_value's bytes, or for an uncompressed fixed-shape array a uint8 view of it (the
    record is then its one copy: join_record)."""
    if field.type == "array" and field.compression != "zstd":
        return _as_array(field, value).reshape(-1).view(np.uint8)
    return encode_value(field, value)


def split_record(schema: Schema, record) -> list[memoryview]:
    """The stored bytes of each field of a record (views, no copy)."""
    view = memoryview(record).cast("B")
    n = len(schema.fields)
    head = 8 * n
    if len(view) < head:
        raise ValueError(f"record of {len(view)} bytes is shorter than its {n} field sizes")
    sizes = struct.unpack_from(f"<{n}q", view)
    out, pos = [], head
    for size in sizes:
        if size < 0:
            break
        out.append(view[pos : pos + size])
        pos += size
    if pos != len(view) or len(out) != n:
        raise ValueError(f"record field sizes {list(sizes)} do not add up to {len(view)}")
    return out


class Column(NamedTuple):
    """One field's stored bytes across a batch: ``buf[starts[j] : starts[j] + sizes[j]]``."""

    buf: np.ndarray  # uint8
    starts: np.ndarray  # int64 [B]
    sizes: np.ndarray  # int64 [B]

    def values(self, rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """The stored bytes of ``rows`` as uint8 views of ``buf`` (no copy)."""
        buf = self.buf
        return [
            buf[a : a + n]
            for a, n in zip(self.starts[rows].tolist(), self.sizes[rows].tolist(), strict=True)
        ]

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """uint8 [len(rows), width]: the first ``width`` bytes of each of ``rows`` (one
        fancy index; for short values such as int64 fields and ragged shapes)."""
        return self.buf[self.starts[rows][:, None] + np.arange(width)]


def join_values(values: Sequence, pad: int = 8 * 64) -> Column:
    """Bytes-like values -> one Column over their join, ``pad`` zero bytes after it, so that a
    gather of a too-short value stays inside the buffer (the default: a ragged shape of
    numpy's 64 dimensions at most)."""
    sizes = np.fromiter(map(len, values), _INT64, len(values))
    ends = np.cumsum(sizes)
    buf = np.frombuffer(b"".join(values) + bytes(pad), np.uint8)
    return Column(buf, ends - sizes, sizes)


class Records(NamedTuple):
    """A batch of records split at once (split_records): field k's bytes are
    ``column(k)``; ``bad``: position -> why that record does not split (its sizes are 0)."""

    buf: np.ndarray
    starts: np.ndarray  # int64 [B, F]
    sizes: np.ndarray  # int64 [B, F]
    bad: dict[int, str]

    def column(self, k: int) -> Column:
        return Column(self.buf, self.starts[:, k], self.sizes[:, k])


def split_records(schema: Schema, records: Sequence) -> Records:
    """split_record for a whole batch with numpy: the records joined once, then
    split_joined."""
    whole = join_values(records, pad=max(8 * 64, 8 * len(schema.fields)))
    return split_joined(schema, whole.buf, whole.starts, whole.sizes)


def split_joined(schema: Schema, buf: np.ndarray, begins: np.ndarray, lens: np.ndarray) -> Records:
    """Records already joined in ``buf`` (record j: ``lens[j]`` bytes from ``begins[j]``), split
    at once: every record's field sizes read by one fancy index, their starts by one
    cumulative sum; a record that does not split is in ``bad``, with split_record's message."""
    n = len(schema.fields)
    head = 8 * n
    count = len(begins)
    sizes = np.zeros((count, n), _INT64)
    rows = np.flatnonzero(lens >= head)  # only these have their sizes to read
    sizes[rows] = buf[begins[rows][:, None] + np.arange(head)].view(_INT64).reshape(-1, n)
    ok = (lens >= head) & (sizes >= 0).all(1) & (sizes <= lens[:, None]).all(1)
    ok &= sizes.sum(1) == lens - head
    bad = {}
    for j in np.flatnonzero(~ok).tolist():
        if lens[j] < head:
            bad[j] = f"record of {lens[j]} bytes is shorter than its {n} field sizes"
        else:
            bad[j] = f"record field sizes {sizes[j].tolist()} do not add up to {lens[j]}"
    sizes[~ok] = 0
    starts = begins[:, None] + head + np.cumsum(sizes, axis=1) - sizes
    return Records(buf, starts, sizes, bad)


def decompressed_limit(field: Field) -> int:
    """The most bytes ``field``'s stored bytes may decompress to: what its schema fixes (a
    fixed-shape array, an int or float), else max_decompressed_bytes()."""
    if field.type == "array":
        return math.prod(field.shape) * np.dtype(field.dtype).itemsize
    if field.type in ("int", "float"):
        return 8
    return zstd.max_decompressed_bytes()


def plain_bytes(field: Field, data) -> memoryview | bytes:
    """A field's stored bytes with its compression undone, never more than
    decompressed_limit(field) of them (else ValueError, before anything that size is
    allocated)."""
    if field.compression == "zstd":
        limit = decompressed_limit(field)
        if field.type in ("array", "int", "float"):
            most = f"the {limit:,} bytes of the schema's {field.describe()}"
        else:
            most = f"the {limit:,} bytes a field may hold ({zstd.MAX_DECOMPRESSED_ENV} sets more)"
        return zstd.decompress(data, limit, most)
    return data


def decode_value(field: Field, data) -> Any:
    """A field's stored bytes -> numpy array (array, ragged), bytes (image, bytes), str, int,
    float or the JSON value. Arrays are fresh (writable) copies."""
    try:
        data = plain_bytes(field, data)
    except ValueError as e:
        raise ValueError(f"field {field.name!r}: {e}") from None
    kind = field.type
    if kind == "array":
        return np.frombuffer(data, dtype=field.dtype).reshape(field.shape).copy()
    if kind == "ragged":
        nd = len(field.shape)
        shape = np.frombuffer(data[: 8 * nd], dtype=_INT64).tolist()
        return np.frombuffer(data[8 * nd :], dtype=field.dtype).reshape(shape).copy()
    if kind in ("image", "bytes"):
        return bytes(data)
    if kind == "str":
        return bytes(data).decode("utf-8")
    if kind == "int":
        return int(np.frombuffer(data, dtype=_INT64)[0])
    if kind == "float":
        return float(np.frombuffer(data, dtype="<f8")[0])
    return json.loads(bytes(data))


def decode_record(schema: Schema, record) -> dict[str, Any]:
    parts = split_record(schema, record)
    return {f.name: decode_value(f, d) for f, d in zip(schema.fields, parts, strict=True)}


# -- tar members ------------------------------------------------------------------------


def member_name(key: str, field: Field) -> str:
    ext = IMAGE_EXT[field.format] if field.type == "image" else TAR_EXT[field.type]
    return f"{key}.{field.name}.{ext}" + (".zst" if field.compression else "")


@functools.lru_cache(maxsize=256)  # fixed-shape fields: one header for every sample
def npy_header_for(dtype: str, shape: tuple[int, ...]) -> bytes:
    head = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": tuple(shape)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, head)
    return buf.getvalue()


def member_bytes(field: Field, stored) -> bytes:
    """A field's stored record bytes -> its tar member's bytes (readable by webdataset's
    default decoders: .npy, .txt, .cls, .json)."""
    if field.compression:
        return bytes(stored)  # the zstd frame of the record bytes, .zst
    kind = field.type
    if kind == "array":
        return npy_header_for(field.dtype, field.shape) + bytes(stored)
    if kind == "ragged":
        nd = len(field.shape)
        shape = struct.unpack_from(f"<{nd}q", stored)
        return npy_header_for(field.dtype, shape) + bytes(stored[8 * nd :])
    if kind == "int":  # struct, not numpy: a tar pack's assembly makes one member per field
        return b"%d" % struct.unpack_from("<q", stored)[0]
    if kind == "float":
        value = struct.unpack_from("<d", stored)[0]
        if not math.isfinite(value):
            return json.dumps(value).encode()  # NaN/Infinity: Python's json reads them back
        return repr(value).encode()
    return bytes(stored)


def npy_shape(data: bytes) -> tuple[tuple[int, ...], int]:
    """(shape, where the array's bytes start) of a .npy file's bytes. Headers are parsed
    once each (numpy parses them with ast.literal_eval, slower than reading the member):
    the members of a field mostly share a few."""
    if data[6:7] == b"\x01":  # format 1.0: a 2-byte header length; 2.0 and 3.0: 4 bytes
        start = 10 + int.from_bytes(data[8:10], "little")
    else:
        start = 12 + int.from_bytes(data[8:12], "little")
    return _npy_header_shape(bytes(data[:start])), start


@functools.lru_cache(maxsize=4096)
def _npy_header_shape(head: bytes) -> tuple[int, ...]:
    return parse_header(io.BytesIO(head))[0]


def stored_from_member(field: Field, data: bytes) -> bytes:
    """A tar member's bytes -> the field's stored record bytes (member_bytes undone; also
    how a WebDataset shard's members are read in place)."""
    if field.compression:
        return data
    kind = field.type
    if kind in ("array", "ragged"):
        shape, start = npy_shape(data)
        body = data[start:]
        if kind == "array":
            return body
        return struct.pack(f"<{len(shape)}q", *shape) + body
    try:  # struct: the int64 / float64 little-endian bytes, faster than numpy for one value
        if kind == "int":
            return struct.pack("<q", int(data.strip() or b"x"))
        if kind == "float":
            return struct.pack("<d", float(json.loads(data)))
    except struct.error as e:
        raise ValueError(f"{kind} {data[:40]!r}: {e}") from None
    return data


def record_from_members(schema: Schema, span) -> bytes:
    """A sample's span in a shard (its members, headers included, back to back) -> its
    record. The members are the schema's fields in order (the writer wrote them so)."""
    data = span if isinstance(span, bytes) else bytes(span)
    end, pos, stored = len(data), 0, []
    for field in schema.fields:
        if pos + 512 > end:
            raise ValueError(f"shard ends before field {field.name!r}'s member")
        name = data[pos : pos + 100]
        if b".%s." % field.name.encode() not in name:
            name = name.rstrip(b"\0").decode("utf-8", "replace")
            raise ValueError(f"member {name!r} found where field {field.name!r} should be")
        size = header_size(data[pos : pos + 512])
        pos += 512
        if pos + size > end:
            raise ValueError(f"field {field.name!r}'s member is truncated")
        stored.append(stored_from_member(field, data[pos : pos + size]))
        pos += size + (-size) % 512
    return join_record(stored)


def join_record(stored: list[bytes]) -> bytes:
    """Each field's stored bytes (bytes-like, 1-d), in schema order -> the record (one join:
    the fields' bytes copied once)."""
    return b"".join([struct.pack(f"<{len(stored)}q", *map(len, stored)), *stored])
