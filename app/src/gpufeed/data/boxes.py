"""Bounding boxes through a geometric crop: the box fields of a multi-field pack follow
``RandomResizedCrop``'s crop, resize and flip of the image, as torchvision v2 moves a
``tv_tensors.BoundingBoxes`` through ``resized_crop`` and ``horizontal_flip``.

Per sample, with the crop (top, left, h, w) of the stored image and an output of H x W:
the boxes (format XYXY, XYWH or CXCYWH, in pixels of the stored image) are shifted by the
crop's corner and clamped to it (``crop_bounding_boxes``), scaled by (W / w, H / h)
(``resize_bounding_boxes``), mirrored when the image was (x -> W - x), and a box left with
no area (outside the crop) is dropped, as ``SanitizeBoundingBoxes`` drops it, together with
the values of the per-box fields (its label...) at the same position. Floating boxes keep
their dtype; integer ones come out float32 (a scaled box is not whole pixels).

:func:`crop_plan` reads what a crop asks of a pack's schema (and refuses what cannot be
right: a box field that is not ``[-1, 4]``, per-box fields without boxes...), and warns once
per crop and schema (a UserWarning, not an error: a pack may be read for its images alone)
when the pack holds a field that looks like boxes but the crop was not told about it: its
boxes would no longer match the image, silently.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import get_worker_info

from gpufeed.errors import UsageError
from gpufeed.formats.schema import Field, Schema

__all__ = [
    "BOX_FORMATS",
    "CropPlan",
    "crop_plan",
    "looks_like_boxes",
    "move_boxes",
    "transform_boxes",
]

BOX_FORMATS = ("XYXY", "XYWH", "CXCYWH")
BOX_NAMES = ("box", "boxes", "bbox", "bboxes")


def box_format(value) -> str:
    fmt = str(getattr(value, "name", value)).upper()  # a tv_tensors.BoundingBoxFormat too
    if fmt not in BOX_FORMATS:
        raise UsageError(f"box_format {value!r}: expected one of {BOX_FORMATS}")
    return fmt


def _to_xyxy(b: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "XYWH":
        return torch.cat([b[:, :2], b[:, :2] + b[:, 2:]], dim=1)
    if fmt == "CXCYWH":
        half = b[:, 2:] / 2
        return torch.cat([b[:, :2] - half, b[:, :2] + half], dim=1)
    return b


def _from_xyxy(b: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "XYWH":
        return torch.cat([b[:, :2], b[:, 2:] - b[:, :2]], dim=1)
    if fmt == "CXCYWH":
        return torch.cat([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]], dim=1)
    return b


def transform_boxes(
    boxes: torch.Tensor, fmt: str, crops: torch.Tensor, size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes [n, 4] in ``fmt``, each through the crop on its row of ``crops`` [n, 5] (top,
    left, h, w, flipped: its sample's) to an output of ``size`` (H, W): (the boxes kept, in
    ``fmt``; bool [n], which were kept). A whole batch's boxes in one pass."""
    height, width = size
    dtype = boxes.dtype if boxes.is_floating_point() else torch.float32
    xyxy = _to_xyxy(boxes.to(dtype), fmt)
    top, left, h, w, flipped = crops.to(dtype).unbind(1)
    x = torch.minimum((xyxy[:, 0::2] - left[:, None]).clamp(min=0), w[:, None])
    y = torch.minimum((xyxy[:, 1::2] - top[:, None]).clamp(min=0), h[:, None])
    x = x * (width / w)[:, None]
    y = y * (height / h)[:, None]
    x = torch.where(flipped[:, None] > 0, width - x.flip(1), x)
    keep = (x[:, 1] > x[:, 0]) & (y[:, 1] > y[:, 0])
    xyxy = torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], dim=1)
    return _from_xyxy(xyxy[keep], fmt), keep


def move_boxes(plan: CropPlan, batch: dict, params: torch.Tensor, size: tuple[int, int]):
    """The box fields of a decoded batch (field -> [B, n, 4] tensor or list of B tensors)
    moved with their images (``params`` [B, 5], the crops drawn), in place: the boxes left
    with no area dropped with the per-box fields' values at their positions; each field a
    [B, ...] tensor when every sample keeps as many, else a list of B tensors."""
    for name in plan.boxes if len(params) else ():
        values = list(batch[name])
        counts = torch.tensor([len(v) for v in values], dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(values)), counts)
        flat = torch.cat(values) if values else torch.empty(0, 4)
        moved, keep = transform_boxes(flat, plan.box_format, params[owner], size)
        kept = torch.bincount(owner[keep], minlength=len(values)).tolist()
        batch[name] = _per_sample(moved, kept)
        for other in plan.per_box if len(plan.boxes) == 1 else ():
            rows = list(batch[other])
            batch[other] = _per_sample(torch.cat(rows)[keep] if rows else flat[:0], kept)
    if plan.params:
        batch[plan.params] = params


def _per_sample(flat: torch.Tensor, counts: list[int]):
    if counts and all(c == counts[0] for c in counts):
        return flat.reshape(len(counts), counts[0], *flat.shape[1:])
    return list(flat.split(counts))


def looks_like_boxes(field: Field) -> bool:
    """A field a detection pack keeps its boxes in: named so, or floating [-1, 4]."""
    if field.type not in ("array", "ragged"):
        return False
    if field.name.lower() in BOX_NAMES:
        return True
    floating = np.dtype(field.dtype).kind == "f"
    return floating and field.type == "ragged" and tuple(field.shape) == (-1, 4)


@dataclass(frozen=True)
class CropPlan:
    """What a crop does to a pack's fields beyond its one image field."""

    image: str
    boxes: tuple[str, ...]
    per_box: tuple[str, ...]
    box_format: str
    params: str | None  # the field the crop parameters go in, or None


def _names(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"{what}={value!r}: expected a field name or a list of them")
    return tuple(names)


def check_options(boxes, per_box, fmt, return_params) -> tuple:
    """RandomResizedCrop's box options, checked: (boxes or None, per_box, format, params)."""
    names = None if boxes is None else _names(boxes, "boxes")
    per = _names(per_box, "per_box")
    if per and not names:
        raise UsageError(f"per_box={per_box!r} names fields kept in step with boxes: name them")
    if per and len(names) > 1:
        raise UsageError(f"per_box={per_box!r} with boxes={boxes!r}: per_box follows one box field")
    if isinstance(return_params, str):
        params = _names(return_params, "return_params")[0]
    elif isinstance(return_params, bool):
        params = "crop_params" if return_params else None
    else:
        raise UsageError(f"return_params={return_params!r}: expected True, False or a field name")
    return names, per, box_format(fmt), params


def crop_plan(schema: Schema, crop, where: str | None = None) -> CropPlan | None:
    """What ``crop`` (a RandomResizedCrop) asks of a pack of ``schema``, checked against it;
    None when it asks nothing. Warns (once per process) of a box-like field the crop was not
    told about."""
    boxes = getattr(crop, "boxes", ())
    params = getattr(crop, "return_params", None)
    by_name = {f.name: f for f in schema.fields}
    pack = f"{where}: " if where else ""
    if boxes is None:
        _warn_unnamed(schema, crop, pack)
        boxes = ()
    if not boxes and not params:
        return None
    images = [f.name for f in schema.fields if f.type == "image"]
    if len(images) != 1:
        raise UsageError(
            f"{pack}{crop!r} moves boxes or returns crop parameters for one image field; this "
            f"pack has {len(images)} ({', '.join(images) or 'none'})"
        )
    for name in (*boxes, *crop.per_box):
        _check_field(by_name, name, name in boxes, pack)
    if params in by_name:
        raise UsageError(
            f"{pack}return_params={params!r}: the pack has a field of that name; "
            "pass return_params='another_name'"
        )
    return CropPlan(images[0], tuple(boxes), tuple(crop.per_box), crop.box_format, params)


def _check_field(by_name: dict[str, Field], name: str, is_box: bool, pack: str) -> None:
    field = by_name.get(name)
    if field is None:
        raise UsageError(f"{pack}the pack has no field {name!r} (fields: {', '.join(by_name)})")
    shape = tuple(field.shape or ())
    if is_box:
        ok = field.type == "ragged" and shape == (-1, 4)
        ok = ok and np.dtype(field.dtype).kind in "fiu"
        want = "a ragged numeric field of shape [-1, 4] (one row per box)"
    else:
        ok = field.type == "ragged" and shape[:1] == (-1,)
        want = "a ragged field with one row per box (shape [-1, ...])"
    if not ok:
        raise UsageError(f"{pack}field {name!r} is {field.describe()}; boxes need {want}")


def _warn_unnamed(schema: Schema, crop, pack: str) -> None:
    found = [f for f in schema.fields if looks_like_boxes(f)]
    if not found:
        return
    names = ", ".join(f"{f.name!r} ({f.describe()})" for f in found)
    text = (
        f"{pack}{type(crop).__name__} crops, resizes and flips the images, but the pack's "
        f"field {names} looks like boxes and the crop was not told: its boxes would no longer "
        f"match the image. Name it: RandomResizedCrop(..., boxes={found[0].name!r}, "
        "box_format='XYXY', per_box=('labels',)) moves them with the image (per_box: the "
        "fields with one value per box), return_params=True adds each sample's crop; "
        "boxes=() says the pack has none to move"
    )
    # once per crop and pack schema: the mark travels with the crop (pickled into the
    # DataLoader's workers), and of the workers that did not get it only the first warns
    warned = crop.__dict__.setdefault("warned_schemas", set())
    info = get_worker_info()
    if schema.describe() not in warned and (info is None or info.id == 0):
        warned.add(schema.describe())
        warnings.warn(text, UserWarning, stacklevel=4)
