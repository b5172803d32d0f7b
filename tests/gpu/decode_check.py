"""The GPU JPEG path's pixels: what ``DevicePrefetcher(decode=RandomResizedCrop(...))`` runs on
a CUDA device (torchvision's batched decode, then gpufeed's batched crop/resize/flip products,
gpufeed.loading.batch_resize), against torchvision's own pipeline for the same boxes and flips:
the same decode, then ``resized_crop(antialias=True)`` computed in float64 and rounded.

    python tests/gpu/decode_check.py --device cpu     # one JSON line on stdout

The batched path runs on the CPU too (torchvision decodes a list there), so
tests/images/test_decode_check.py runs this in the images on the CPU and tests/gpu/smoke.py
on the GPU (``make smoke-gpu``), with TF32 switched on around it as training scripts do (the
products must not round differently). A failure: a value more than 1 away, more than
DIFFER_PCT of them 1 away, or a batch the decoder refused.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

DIFFER_PCT = 0.5  # float32 products against float64: ties round apart on a few values


def jpegs(count: int = 24, seed: int = 0) -> list[bytes]:
    """Pictures of several sizes and both orientations, smooth with some texture."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        h, w = [(120, 160), (160, 120), (97, 131), (64, 64)][i % 4]
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC)).astype(np.int16)
        img = np.clip(img + rng.integers(-10, 11, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def reference(payloads, crop, device, seed: int):
    """torchvision's pipeline for the draws DeviceDecode makes after ``manual_seed(seed)``."""
    import numpy as np
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    torch.manual_seed(seed)
    images = decode_jpeg(payloads, mode=ImageReadMode.RGB, device=device)
    sizes = np.array([img.shape[1:] for img in images])
    boxes = crop.crop_boxes(sizes[:, 0], sizes[:, 1]).tolist()
    flips = (torch.rand(len(images)) < crop.flip).tolist()
    out = []
    for img, (top, left, h, w), flip in zip(images, boxes, flips, strict=True):
        x = F.resized_crop(img.double(), top, left, h, w, list(crop.size), antialias=True)
        out.append(x.flip(-1) if flip else x)
    return torch.stack(out).round().clamp(0, 255).to(torch.uint8), sum(flips)


def run(device: str = "cpu", size: int = 32, seed: int = 5) -> dict:
    import torch

    import gpufeed
    from gpufeed.loading.device_decode import DeviceDecode

    dev = torch.device(device)
    payloads = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs()]
    crop = gpufeed.RandomResizedCrop(size, scale=(0.05, 1.0), memory_format=torch.contiguous_format)
    decode = DeviceDecode(crop, dev, batched=True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # as a training script may have set it
    try:
        torch.manual_seed(seed)
        got = decode(gpufeed.Batch(payloads, torch.arange(len(payloads)))).samples
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    want, flipped = reference(payloads, crop, dev, seed)
    diff = (got.int() - want.int()).abs()
    return {
        "device": str(got.device),
        "images": len(payloads),
        "flipped": int(flipped),
        "max_difference": int(diff.max()),
        "differ_pct": float((diff > 0).float().mean() * 100),
        "fallbacks": decode.fallbacks,
    }


def problems(result: dict) -> list[str]:
    found = []
    if result["max_difference"] > 1:
        found.append(f"a value {result['max_difference']} away from torchvision's")
    if result["differ_pct"] > DIFFER_PCT:
        found.append(f"{result['differ_pct']:.2f}% of values differ (> {DIFFER_PCT}%)")
    if result["fallbacks"]:
        found.append("the batched decoder refused the batch")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    result = run(args.device)
    print(json.dumps(result))
    found = problems(result)
    for problem in found:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
