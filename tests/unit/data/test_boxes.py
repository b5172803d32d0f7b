"""Boxes through RandomResizedCrop (gpufeed.data.boxes; issue 38 item 2): the box fields of a
multi-field pack move with the image exactly as torchvision v2 moves a
``tv_tensors.BoundingBoxes`` through ``resized_crop`` + ``horizontal_flip`` for the same crop,
boxes left with no area are dropped with their labels, the crop drawn comes back with the
batch, and a box-like field the crop was not told about warns.

The reference: torchvision v2's own functions where torchvision imports; else (the dev venv
has no torchvision: its CUDA wheels do not load against the CPU torch) the same steps written
from torchvision's kernels, in their order and in the boxes' own format: crop_bounding_boxes
(subtract the corner, clamp through XYXY), resize_bounding_boxes (scale every coordinate),
horizontal_flip_bounding_boxes, then SanitizeBoundingBoxes-like dropping of empty boxes."""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.data import native_jpeg
from gpufeed.data.decoders import RandomResizedCrop, decode_rgb, resize_antialiased
from gpufeed.errors import CorruptSampleError, UsageError

NATIVE = native_jpeg.available() or bool(os.environ.get("CI"))
BACKENDS = ["torch", "opencv"] + (["native"] if NATIVE else [])
FORMATS = ["XYXY", "XYWH", "CXCYWH"]
SIZES = [(82, 71), (40, 60), (64, 64)]
N = 24


def _jpeg(i: int, size) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _xyxy_to(b: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "XYWH":
        return np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], 1)
    if fmt == "CXCYWH":
        return np.concatenate([(b[:, :2] + b[:, 2:]) / 2, b[:, 2:] - b[:, :2]], 1)
    return b


def _boxes(i: int, size, fmt: str) -> np.ndarray:
    """Boxes inside, across the edges of and outside the image, in ``fmt``."""
    rng = np.random.default_rng(100 + i)
    h, w = size
    n = 1 + i % 6
    x1 = rng.uniform(-10, w, n)
    y1 = rng.uniform(-10, h, n)
    xyxy = np.stack([x1, y1, x1 + rng.uniform(0.5, w, n), y1 + rng.uniform(0.5, h, n)], 1)
    return _xyxy_to(xyxy, fmt).astype(np.float32)


def _pack(root, fmt: str, box_type: str = "float32[-1,4]", count_off: bool = False):
    schema = {"image": "jpeg", "boxes": box_type, "labels": "int64[-1]", "name": "str"}
    with gpufeed.Writer(root, format="lmdb", schema=schema) as w:
        for i in range(N):
            boxes = _boxes(i, SIZES[i % 3], fmt)
            n = len(boxes) + (1 if count_off and i == 5 else 0)
            w.write({"image": _jpeg(i, SIZES[i % 3]), "boxes": boxes.astype(box_type.split("[")[0]),
                     "labels": np.arange(n) + 100 * i, "name": f"s{i}"})  # fmt: skip
    return root


@pytest.fixture(scope="module", params=FORMATS)
def box_pack(request, tmp_path_factory):
    return request.param, _pack(tmp_path_factory.mktemp("boxes") / "p", request.param)


def _torchvision():
    try:
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as F
    except Exception:  # noqa: BLE001 - not installed, or its C ops do not load
        return None
    return tv_tensors, F


def _reference_formulas(boxes, fmt, params, size):
    """torchvision v2's steps for one sample, written from its kernels (module docstring)."""
    top, left, h, w, flipped = params
    height, width = size
    b = boxes.clone()
    b -= torch.tensor([left, top, left, top] if fmt == "XYXY" else [left, top, 0, 0], dtype=b.dtype)
    xyxy = _to_xyxy(b, fmt)  # clamp_bounding_boxes: through XYXY and back
    xyxy[:, 0::2] = xyxy[:, 0::2].clamp(0, w)
    xyxy[:, 1::2] = xyxy[:, 1::2].clamp(0, h)
    b = _from_xyxy(xyxy, fmt)
    b = b * torch.tensor([width / w, height / h, width / w, height / h], dtype=b.dtype)
    if flipped:  # horizontal_flip_bounding_boxes
        if fmt == "XYXY":
            b[:, [2, 0]] = width - b[:, [0, 2]]
        elif fmt == "XYWH":
            b[:, 0] = width - (b[:, 0] + b[:, 2])
        else:
            b[:, 0] = width - b[:, 0]
    return b


def _to_xyxy(b, fmt):
    if fmt == "XYWH":
        return torch.cat([b[:, :2], b[:, :2] + b[:, 2:]], 1)
    if fmt == "CXCYWH":
        return torch.cat([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)
    return b.clone()


def _from_xyxy(b, fmt):
    return torch.from_numpy(_xyxy_to(b.numpy(), fmt))


def _reference(boxes: torch.Tensor, fmt: str, params, size, source_size):
    """(boxes kept, kept mask) for one sample: torchvision's transform when it imports."""
    tv = _torchvision()
    if tv is None:
        moved = _reference_formulas(boxes, fmt, params, size)
    else:
        tv_tensors, F = tv
        top, left, h, w, flipped = params
        b = tv_tensors.BoundingBoxes(boxes, format=fmt, canvas_size=source_size)
        b = F.resized_crop(b, top, left, h, w, list(size))
        moved = F.horizontal_flip(b) if flipped else b
        moved = F.clamp_bounding_boxes(moved).as_subclass(torch.Tensor)
    xyxy = _to_xyxy(moved, fmt)
    keep = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])  # SanitizeBoundingBoxes-like
    return moved[keep], keep


@pytest.mark.parametrize("backend", BACKENDS)
def test_boxes_move_as_torchvision_moves_them(box_pack, backend):
    fmt, pack = box_pack
    torch.manual_seed(0)
    crop = RandomResizedCrop(
        (32, 48), backend=backend, boxes="boxes", box_format=fmt, per_box="labels",
        return_params=True, memory_format=torch.contiguous_format,
    )  # fmt: skip
    batch = gpufeed.open_dataset(pack, decode=crop).get_batch(list(range(N)))
    raw = gpufeed.open_dataset(pack, decode=False)
    params = batch["crop_params"]
    assert params.shape == (N, 5) and params.dtype == torch.int64
    assert 0 < params[:, 4].sum() < N  # some flipped, some not
    dropped = 0
    for i in range(N):
        stored = raw[i]
        boxes = torch.from_numpy(_boxes(i, SIZES[i % 3], fmt))
        want, keep = _reference(boxes, fmt, params[i].tolist(), (32, 48), SIZES[i % 3])
        dropped += int((~keep).sum())
        assert torch.allclose(batch["boxes"][i], want, atol=1e-4), (i, fmt)
        assert batch["labels"][i].tolist() == (torch.arange(len(boxes))[keep] + 100 * i).tolist()
        assert batch["name"][i] == f"s{i}"
        # the params are the crop the image got: the same crop, resized and flipped, by hand
        if backend != "opencv":  # opencv enlarges by cv2.resize: within 1, not equal
            top, left, h, w, flipped = params[i].tolist()
            img = decode_rgb(stored["image"].numpy().tobytes())[
                None, :, top : top + h, left : left + w
            ]
            out = torch.empty((1, 3, 32, 48), dtype=torch.uint8)
            resize_antialiased(img.contiguous(), out)
            assert torch.equal(batch["image"][i], out[0].flip(-1) if flipped else out[0])
    assert dropped > 0  # the data has boxes that leave the crop


def test_per_sample_path_and_plain_dataloader_carry_the_boxes(box_pack):
    from torch.utils.data import DataLoader

    fmt, pack = box_pack
    crop = RandomResizedCrop(
        24, boxes="boxes", box_format=fmt, per_box="labels", return_params=True
    )
    ds = gpufeed.open_dataset(pack, decode=crop)
    sample = ds[7]
    assert set(sample) == {"image", "boxes", "labels", "name", "crop_params"}
    assert len(sample["boxes"]) == len(sample["labels"]) and sample["crop_params"].shape == (5,)
    batch = next(iter(DataLoader(ds, batch_size=6, num_workers=0)))  # default_collate
    assert batch["crop_params"].shape == (6, 5) and len(batch["boxes"]) == 6
    padded = gpufeed.open_dataset(pack, decode=crop, pad={"boxes": 0, "labels": -1})
    got = padded.get_batch(list(range(8)))
    assert (got["boxes_mask"][..., 0].sum(1) == (got["labels"] >= 0).sum(1)).all()


def test_integer_boxes_come_out_float32(tmp_path):
    pack = _pack(tmp_path / "p", "XYXY", box_type="int32[-1,4]")
    crop = RandomResizedCrop(16, boxes="boxes", per_box="labels", return_params=True)
    batch = gpufeed.open_dataset(pack, decode=crop).get_batch(list(range(6)))
    assert all(b.dtype == torch.float32 for b in batch["boxes"])
    boxes = torch.from_numpy(_boxes(3, SIZES[0], "XYXY").astype(np.int32)).float()
    want, _ = _reference(boxes, "XYXY", batch["crop_params"][3].tolist(), (16, 16), SIZES[0])
    assert torch.allclose(batch["boxes"][3], want, atol=1e-4)


def test_a_box_field_the_crop_was_not_told_about_warns_once(box_pack):
    fmt, pack = box_pack
    crop = RandomResizedCrop(16, backend="torch", flip=0.3)
    with pytest.warns(UserWarning, match=r"field 'boxes' \(float32\[\*,4\]\) looks like boxes"):
        ds = gpufeed.open_dataset(pack, decode=crop)  # at open (gpufeed.data.reading)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.get_batch([2, 3])  # once
        told = RandomResizedCrop(16, backend="torch", flip=0.3, boxes=())
        gpufeed.open_dataset(pack, decode=told).get_batch([0, 1])  # boxes=(): none to move


def test_box_options_that_cannot_be_right_are_refused(tmp_path, box_pack):
    _, pack = box_pack
    cases = [
        (dict(boxes="bbox"), "no field 'bbox'"),
        (dict(boxes="name"), "field 'name' is str; boxes need a ragged numeric field"),
        (dict(boxes="labels"), "field 'labels' is int64"),
        (dict(boxes="boxes", per_box="name"), "one row per box"),
        (dict(boxes="boxes", return_params="labels"), "has a field of that name"),
    ]
    for options, message in cases:
        with pytest.raises(UsageError, match=message):
            gpufeed.open_dataset(pack, decode=RandomResizedCrop(16, **options)).get_batch([0])
    for options, message in [
        (dict(per_box="labels"), "per_box"),
        (dict(boxes="boxes", box_format="xyxyn"), "box_format"),
        (dict(boxes=3), "boxes=3"),
        (dict(return_params=2), "return_params=2"),
    ]:
        with pytest.raises(UsageError, match=message):
            RandomResizedCrop(16, **options)
    two = {"a": "jpeg", "b": "jpeg", "boxes": "float32[-1,4]"}
    with gpufeed.Writer(tmp_path / "two", format="lmdb", schema=two) as w:
        w.write({"a": _jpeg(0, (8, 8)), "b": _jpeg(1, (8, 8)), "boxes": np.zeros((0, 4), "f4")})
    with pytest.raises(UsageError, match="one image field; this pack has 2"):
        gpufeed.open_dataset(tmp_path / "two", decode=RandomResizedCrop(4, boxes="boxes"))[0]


def test_image_label_packs_and_the_device_refuse_boxes(tmp_path, jpeg_folder):
    from gpufeed.loading.device_decode import DeviceDecode

    gpufeed.pack(jpeg_folder, tmp_path / "p", format="mmap", workers=1, quiet=True)
    crop = RandomResizedCrop(8, return_params=True)
    with pytest.raises(UsageError, match=r"need a multi-field pack.*\(image, label\)"):
        gpufeed.open_dataset(tmp_path / "p", decode=crop).get_batch([0, 1])
    with pytest.raises(UsageError, match="device decodes"):
        DeviceDecode(crop, torch.device("cpu"))


def test_labels_that_do_not_match_the_boxes_name_the_sample(tmp_path):
    pack = _pack(tmp_path / "p", "XYXY", count_off=True)
    crop = RandomResizedCrop(16, boxes="boxes", per_box="labels")
    ds = gpufeed.open_dataset(pack, decode=crop)
    with pytest.raises(
        CorruptSampleError, match=r"sample 5.*'labels' holds 7 values for the 6 box"
    ):
        ds.get_batch([4, 5])
    skip = gpufeed.open_dataset(pack, decode=crop, on_error="skip")
    with pytest.warns(UserWarning, match="skipping corrupt samples"):
        assert skip.get_batch([4, 5, 6])["name"] == ["s4", "s6"]
