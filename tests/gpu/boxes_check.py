"""Boxes through gpufeed.RandomResizedCrop against torchvision v2's own box transform, in an
image that ships torchvision (the host's test venv has none: its CUDA wheels do not load
against the CPU torch; tests/unit/data/test_boxes.py checks the same steps written out).

For every box format, a multi-field pack of JPEGs with boxes (inside, across the edges of and
outside the image) and per-box labels is decoded with ``RandomResizedCrop(boxes=...,
per_box=..., return_params=True)``; each sample's boxes must equal torchvision's
``resized_crop`` (+ ``horizontal_flip``) of a ``tv_tensors.BoundingBoxes`` for the crop drawn,
clamped, with boxes left without area dropped along with their labels. Prints one JSON line.

    python tests/gpu/boxes_check.py
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

import gpufeed

SIZES = [(82, 71), (40, 60), (64, 64)]
OUT = (32, 48)
N = 24


def _jpeg(i: int, size) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _boxes(i: int, size, fmt: str) -> torch.Tensor:
    rng = np.random.default_rng(100 + i)
    h, w = size
    n = 1 + i % 6
    x1, y1 = rng.uniform(-10, w, n), rng.uniform(-10, h, n)
    xyxy = np.stack([x1, y1, x1 + rng.uniform(0.5, w, n), y1 + rng.uniform(0.5, h, n)], 1)
    b = torch.from_numpy(xyxy.astype(np.float32))
    return F.convert_bounding_box_format(
        tv_tensors.BoundingBoxes(b, format="XYXY", canvas_size=size), new_format=fmt
    ).as_subclass(torch.Tensor)


def _torchvision(boxes, fmt, params, size):
    """(boxes kept, kept mask): torchvision's resized_crop, flip, clamp; empty boxes out."""
    top, left, h, w, flipped = params
    b = tv_tensors.BoundingBoxes(boxes, format=fmt, canvas_size=size)
    b = F.resized_crop(b, top, left, h, w, list(OUT))
    b = F.clamp_bounding_boxes(F.horizontal_flip(b) if flipped else b)
    xyxy = F.convert_bounding_box_format(b, new_format="XYXY").as_subclass(torch.Tensor)
    keep = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
    return b.as_subclass(torch.Tensor)[keep], keep


def check(fmt: str, root: Path) -> dict:
    schema = {"image": "jpeg", "boxes": "float32[-1,4]", "labels": "int64[-1]"}
    with gpufeed.Writer(root / fmt, format="lmdb", schema=schema, quiet=True) as w:
        for i in range(N):
            size = SIZES[i % 3]
            boxes = _boxes(i, size, fmt).numpy()
            w.write({"image": _jpeg(i, size), "boxes": boxes, "labels": np.arange(len(boxes))})
    torch.manual_seed(0)
    crop = gpufeed.RandomResizedCrop(
        OUT, boxes="boxes", box_format=fmt, per_box="labels", return_params=True
    )
    batch = gpufeed.open_dataset(root / fmt, decode=crop).get_batch(list(range(N)))
    worst, dropped, flipped = 0.0, 0, int(batch["crop_params"][:, 4].sum())
    for i in range(N):
        size = SIZES[i % 3]
        boxes = _boxes(i, size, fmt)
        want, keep = _torchvision(boxes, fmt, batch["crop_params"][i].tolist(), size)
        got = batch["boxes"][i]
        if got.shape != want.shape:
            return {"format": fmt, "sample": i, "error": f"{list(got.shape)} != {list(want.shape)}"}
        worst = max(worst, float((got - want).abs().max()) if len(want) else 0.0)
        if batch["labels"][i].tolist() != torch.arange(len(boxes))[keep].tolist():
            return {"format": fmt, "sample": i, "error": "labels not aligned with boxes"}
        dropped += int((~keep).sum())
    return {"format": fmt, "max_difference": worst, "dropped": dropped, "flipped": flipped}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        results = [check(fmt, Path(tmp)) for fmt in ("XYXY", "XYWH", "CXCYWH")]
    ok = all("error" not in r and r["max_difference"] <= 1e-4 for r in results)
    print(json.dumps({"ok": ok, "samples": N, "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
