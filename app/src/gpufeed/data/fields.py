"""Records of a multi-field pack -> sample dicts, or a whole batch of them at once.

Arrays become tensors (their dtype and shape, ragged ones their own shape, as
gpufeed.batch.RaggedTensor so that torch's default_collate lists them; a big-endian dtype
becomes the native one, same values), images are
decoded like the (image, label) packs' (uint8 CHW; ``decode=False``: the encoded bytes as a
1-D uint8 tensor), int, float, str, bytes and JSON values stay Python values.

:func:`decode_fields` reads one record; :func:`decode_batch` reads a batch of them with
numpy (every record split by one fancy index, a fixed-shape field copied straight into its
[B, ...] tensor, a ragged one into one buffer of the batch, ints and floats read as one
array, the images decoded by one call of a batch decoder such as
gpufeed.RandomResizedCrop), giving the columns of the batch, not a dict per sample.
:func:`field_rows` splits such a batch into the sample dicts decode_fields gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gpufeed.batch import FieldBatch, mixed_sizes, new_batch_tensor, ragged, stack
from gpufeed.data.boxes import CropPlan, crop_plan, move_boxes
from gpufeed.data.decoders import decode_image, raw_bytes_tensor
from gpufeed.formats.record import (
    Column,
    decode_value,
    join_values,
    plain_bytes,
    split_record,
    split_records,
)
from gpufeed.formats.schema import Field, Schema

__all__ = ["decode_batch", "decode_fields", "field_rows"]

_INT64 = np.dtype("<i8")
# fields whose sample value is a Python number; the batch holds them as one tensor
NUMBERS = {"int": (_INT64, torch.int64), "float": (np.dtype("<f8"), torch.float64)}
Problems = dict[int, str]  # position in the batch -> why that sample is left out


def decode_fields(schema: Schema, record, decode: bool = True) -> dict[str, Any]:
    """One record -> its sample dict. Raises on a record that does not parse or an image
    that does not decode (the dataset turns that into a CorruptSampleError)."""
    sample: dict[str, Any] = {}
    for field, stored in zip(schema.fields, split_record(schema, record), strict=True):
        value = decode_value(field, stored)
        if field.type in ("array", "ragged"):
            value = torch.from_numpy(_native(value))
            if field.type == "ragged":
                value = ragged(value)
        elif field.type == "image":
            value = decode_image(value) if decode else raw_bytes_tensor(value)
        sample[field.name] = value
    return sample


def _native(arr: np.ndarray) -> np.ndarray:
    """torch holds native byte order only: the same values in it."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def decode_batch(
    schema: Schema, records: Sequence, decode: bool | Callable = True
) -> tuple[FieldBatch, np.ndarray, list[tuple[int, str]]]:
    """Records -> (the batch of those that decode, their positions in ``records``,
    (position, problem) for the others). The batch is a FieldBatch in schema order, as
    collate_fields makes it from the per-sample dicts: fixed-shape arrays stacked
    [B, ...]; ragged ones copied into one buffer of the batch, [B, ...] when every size
    agrees, else a list of B views of it (get_batch pads them when asked); images as
    ``decode`` says (True: decoded, stacked when their sizes agree; False: the encoded
    bytes, 1-D uint8; a batch decoder: its [B, 3, H, W] batch); int and float fields
    int64 and float64 tensors [B]; str, bytes and JSON lists of B."""
    plan = crop_plan(schema, decode) if callable(decode) else None
    parts = split_records(schema, records)
    problems: Problems = dict(parts.bad)
    columns = [parts.column(k) for k in range(len(schema.fields))]
    lists: dict[str, list] = {}
    for k, field in enumerate(schema.fields):
        if field.compression:
            columns[k] = _decompressed(field, columns[k], problems)
        if field.type in PYTHON_VALUES:
            lists[field.name] = _python_values(field, columns[k], problems)
        elif field.type != "image":
            _check_sizes(field, columns[k], problems)
    if plan is not None:
        _check_box_counts(schema, plan, columns, problems)
    rows = _good(len(records), problems)
    images: dict[str, tuple[np.ndarray, Any, Any]] = {}
    for k, field in enumerate(schema.fields):
        if field.type == "image":
            images[field.name] = _images(columns[k], rows, decode, problems)
            rows = _good(len(records), problems)
    out = FieldBatch()
    for k, field in enumerate(schema.fields):
        if field.name in images:
            out[field.name] = _select(*images[field.name][:2], rows)
        elif field.name in lists:
            values = lists[field.name]
            out[field.name] = [values[j] for j in rows.tolist()]
        else:
            out[field.name] = MAKERS[field.type](field, columns[k], rows)
    if plan is not None:
        given, _, params = images[plan.image]
        move_boxes(plan, out, _select(given, params, rows), decode.size)
    failed = sorted((j, f"cannot decode: {p}") for j, p in problems.items())
    return out, rows, failed


def _good(count: int, problems: Problems) -> np.ndarray:
    rows = np.ones(count, dtype=bool)
    rows[list(problems)] = False
    return np.flatnonzero(rows)


def _decompressed(field: Field, column: Column, problems: Problems) -> Column:
    plain = []
    for j, stored in enumerate(column.values(np.arange(len(column.sizes)))):
        try:
            plain.append(b"" if j in problems else plain_bytes(field, stored))
        except Exception as e:  # noqa: BLE001 - a frame that does not decompress
            problems[j] = f"field {field.name!r}: {e}"
            plain.append(b"")
    return join_values(plain)


def _bad_sizes(field: Field, column: Column, wrong: np.ndarray, problems: Problems) -> None:
    for j in np.flatnonzero(wrong).tolist():
        problems.setdefault(j, f"field {field.name!r}: {column.sizes[j]} bytes do not fit")


def _check_sizes(field: Field, column: Column, problems: Problems) -> None:
    """Flag the samples whose stored bytes cannot be the field's value (decode_value would
    raise on them)."""
    sizes = column.sizes
    if field.type in NUMBERS:
        _bad_sizes(field, column, sizes != 8, problems)
    elif field.type == "array":
        _bad_sizes(field, column, sizes != _nbytes(field, field.shape), problems)
    else:
        shapes, wrong = _ragged_shapes(field, column)
        _bad_sizes(field, column, wrong, problems)


def _nbytes(field: Field, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(field.dtype).itemsize


def _ragged_shapes(field: Field, column: Column) -> tuple[np.ndarray, np.ndarray]:
    """Each value's shape (int64 [B, ndim]) and where it does not fit the value's bytes."""
    nd = len(field.shape)
    everyone = np.arange(len(column.sizes))
    shapes = column.gather(everyone, 8 * nd).view(_INT64).reshape(-1, nd)
    itemsize = np.dtype(field.dtype).itemsize
    body = column.sizes - 8 * nd
    with np.errstate(over="ignore"):
        want = np.prod(shapes, axis=1) * itemsize
    wrong = (body < 0) | (shapes < 0).any(axis=1) | (want != body)
    return shapes, wrong


def _fixed(field: Field, column: Column, rows: np.ndarray) -> torch.Tensor:
    """A fixed-shape field: every row's bytes copied into one [B, ...] tensor."""
    dtype = np.dtype(field.dtype)
    width = _nbytes(field, field.shape)
    views = column.values(rows)
    if not dtype.isnative:
        flat = np.stack(views) if views else np.empty((0, width), np.uint8)
        return torch.from_numpy(_native(flat.view(dtype).reshape(len(rows), *field.shape)))
    out = new_batch_tensor((len(rows), *field.shape), _torch_dtype(dtype))
    if views:
        np.stack(views, out=out.numpy().reshape(len(rows), -1).view(np.uint8))
    return out


def _ragged(field: Field, column: Column, rows: np.ndarray):
    """A ragged field: the values of the batch (after their shapes) in one buffer."""
    nd = len(field.shape)
    shapes = column.gather(rows, 8 * nd).view(_INT64).reshape(-1, nd)
    body = Column(column.buf, column.starts + 8 * nd, column.sizes - 8 * nd)
    return _one_buffer(body.values(rows), np.dtype(field.dtype), shapes)


def _one_buffer(parts: list[np.ndarray], dtype: np.dtype, shapes: np.ndarray):
    """Byte strings -> one tensor of their values, copied once: as [B, ...] when every
    shape is the same (as collate's stack makes it), else a list of views of it."""
    counts = np.prod(shapes, axis=1).tolist()
    if not dtype.isnative:
        flat = torch.from_numpy(_native(np.concatenate(parts).view(dtype)))
    else:
        flat = new_batch_tensor((sum(counts),), _torch_dtype(dtype))
        if parts:
            np.concatenate(parts, out=flat.numpy().view(np.uint8))
    if len(shapes) and (shapes == shapes[0]).all():
        return flat.view(len(shapes), *shapes[0].tolist())
    values = flat.split(counts)
    if shapes.shape[1] == 1:  # split made them 1-D already (a view each costs more than a copy)
        return list(values)
    return [v.view(s) for v, s in zip(values, shapes.tolist(), strict=True)]


def _numbers(field: Field, column: Column, rows: np.ndarray) -> torch.Tensor:
    dtype, tdtype = NUMBERS[field.type]
    out = new_batch_tensor((len(rows),), tdtype)
    out.numpy()[:] = column.gather(rows, 8).view(dtype).reshape(-1)
    return out


MAKERS = {"array": _fixed, "ragged": _ragged, "int": _numbers, "float": _numbers}


def _python_values(field: Field, column: Column, problems: Problems) -> list:
    """str, bytes or JSON values of every sample (None where the sample is left out)."""
    out: list = []
    for j, stored in enumerate(column.values(np.arange(len(column.sizes)))):
        try:
            out.append(None if j in problems else PYTHON_VALUES[field.type](stored))
        except Exception as e:  # noqa: BLE001 - text that is not UTF-8, JSON that is not
            problems[j] = f"field {field.name!r}: {e}"
            out.append(None)
    return out


PYTHON_VALUES = {
    "str": lambda b: b.tobytes().decode("utf-8"),
    "bytes": lambda b: b.tobytes(),
    "json": lambda b: json.loads(b.tobytes()),
}


def _images(column: Column, rows: np.ndarray, decode, problems: Problems):
    """(the rows whose image decoded, their images: a batch decoder's batch, or tensors
    stacked when their shapes agree). A row whose image does not decode goes into
    ``problems``."""
    payloads = column.values(rows)
    if callable(decode):
        with_params = getattr(decode, "with_params", None)  # RandomResizedCrop: its crops too
        batch, kept, failed, *params = with_params(payloads) if with_params else decode(payloads)
        for j, problem in failed:
            problems[int(rows[j])] = problem.removeprefix("cannot decode: ")
        return rows[np.asarray(kept, dtype=np.int64)], batch, (params or [None])[0]
    if not decode:  # the encoded bytes, 1-D uint8
        sizes = column.sizes[rows][:, None]
        return rows, _one_buffer(payloads, np.dtype(np.uint8), sizes), None
    images, ok = [], []
    for j, payload in zip(rows.tolist(), payloads, strict=True):
        try:
            images.append(decode_image(payload))
            ok.append(j)
        except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt sample
            problems[j] = str(e)
    return np.asarray(ok, dtype=np.int64), stack(images), None


def _check_box_counts(schema: Schema, plan: CropPlan, columns: list, problems: Problems) -> None:
    """Flag the samples whose per-box fields do not hold one value per box: the boxes
    dropped by a crop could not take the right ones with them."""
    k_of = {f.name: k for k, f in enumerate(schema.fields)}
    boxes = plan.boxes[0]
    counts = _ragged_shapes(schema.fields[k_of[boxes]], columns[k_of[boxes]])[0][:, 0]
    for name in plan.per_box:
        k = k_of[name]
        other = _ragged_shapes(schema.fields[k], columns[k])[0][:, 0]
        for j in np.flatnonzero(other != counts).tolist():
            problems.setdefault(
                j, f"field {name!r} holds {other[j]} values for the {counts[j]} boxes in {boxes!r}"
            )


def _select(given: np.ndarray, values, rows: np.ndarray):
    """The values of ``rows`` out of those decoded for ``given`` (a superset, in order)."""
    if len(given) == len(rows):
        return values
    keep = np.flatnonzero(np.isin(given, rows))  # of the given rows, those still good
    if isinstance(values, torch.Tensor):
        return values[torch.from_numpy(keep)]
    return [values[j] for j in keep.tolist()]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def field_rows(schema: Schema, batch: FieldBatch) -> list[dict[str, Any]]:
    """A batch from decode_batch -> its sample dicts, as decode_fields gives them: tensors
    as views of the batch (no copy; ragged fields' as RaggedTensors), int and float fields as
    Python numbers."""
    by_name = {field.name: field for field in schema.fields}
    columns, names = [], list(by_name)
    names += [name for name in batch if name not in by_name]  # a crop's crop_params
    for name in names:
        field = by_name.get(name)
        values = batch[name]
        kind = field.type if field is not None else None
        if kind in NUMBERS:
            values = values.tolist()
        elif isinstance(values, torch.Tensor):
            values = values.unbind(0)
        if kind == "ragged":
            values = [ragged(v) for v in values]
        elif kind == "image":
            values = mixed_sizes(values)
        columns.append(values)
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]
