"""Crop, antialiased resize and flip of a whole batch of images as two batched matrix products:
what ``DevicePrefetcher(decode=crop)`` runs on the GPU after nvJPEG.

torch's antialiased bilinear resize (``_upsample_bilinear2d_aa``, what torchvision's
``resized_crop(antialias=True)`` calls) is separable and linear: each output row is a weighted
sum of input rows, each output column of input columns, with weights that depend only on the
input and output sizes (a triangle filter, widened by the scale when shrinking, normalised).
So the resize of one crop is ``Wy @ crop @ Wx.T``, and a batch of crops of different sizes is
one ``matmul`` over crops zero-padded to the batch's largest box with each image's weights
zero beyond its own box; the flips are one ``where`` over the result. The weights are built
on the device, the crops copied in one kernel each: 2 + N kernels a chunk, where a per-image
``resized_crop`` launches 6-8 per image (docs/performance/jpeg-decode.md, "GPU decode").

Pixels: torch's own weights (the same formula, tested against torch's kernel); the products
run in float32 with TF32 off for their duration, so a training script's ``allow_tf32`` cannot
round them differently.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

__all__ = ["aa_weights", "resized_crops"]

CHUNK_BYTES = 64 << 20  # float32 padded crops per product: bounds the GPU memory it takes


def aa_weights(extents: torch.Tensor, out_size: int, pad: int) -> torch.Tensor:
    """[N, out_size, pad] float32 on ``extents``' device: row ``i`` of image ``n`` holds the
    weights of output ``i`` over input positions ``0 .. pad-1`` of a crop ``extents[n]``
    long (zero past it), as torch's ``_compute_indices_min_size_weights_aa`` computes them
    (in float64 here, rounded once). Built where the products run: a batch's weights are tens
    of MB, too many to compute on the CPU and copy (docs/performance/jpeg-decode.md, "GPU
    decode, measured once on an H200")."""
    dev = extents.device
    ext = extents.to(torch.float64)
    scale = ext / out_size  # [N]
    support = torch.where(scale >= 1.0, scale, 1.0)[:, None]
    invscale = torch.where(scale >= 1.0, 1.0 / scale, 1.0)[:, None, None]
    center = scale[:, None] * (torch.arange(out_size, dtype=torch.float64, device=dev) + 0.5)
    # C's static_cast<int64_t> truncates toward zero: trunc does the same
    xmin = (center - support + 0.5).trunc().clamp_(min=0.0)[..., None]
    xmax = torch.minimum((center + support + 0.5).trunc(), ext[:, None])[..., None]
    pos = torch.arange(pad, dtype=torch.float64, device=dev)
    w = (1.0 - ((pos - center[..., None] + 0.5) * invscale).abs()).clamp_(min=0.0)
    w = torch.where((pos >= xmin) & (pos < xmax), w, 0.0)
    return (w / w.sum(dim=-1, keepdim=True)).to(torch.float32)


@contextlib.contextmanager
def _ieee_float32():
    """float32 products in full precision (TF32 off) for the block, restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def resized_crops(
    images: list[torch.Tensor], boxes: np.ndarray, flips: np.ndarray, out: torch.Tensor
) -> torch.Tensor:
    """``out[n]`` (uint8 [N, C, H, W], on the images' device) = image ``n`` [C, h, w] uint8
    cropped to ``boxes[n]`` (top, left, height, width), resized to H x W with torch's
    antialiased bilinear filter, flipped left-right where ``flips[n]``; returns ``out``."""
    n, channels, height, width = out.shape
    if n == 0:
        return out
    device = out.device
    boxes = np.asarray(boxes, dtype=np.int64)
    hmax, wmax = int(boxes[:, 2].max()), int(boxes[:, 3].max())
    sizes = torch.from_numpy(boxes[:, 2:].copy()).to(device)  # [N, (h, w)]
    flips = torch.from_numpy(np.asarray(flips, dtype=bool)).to(device)
    step = max(1, CHUNK_BYTES // (channels * hmax * wmax * 4))
    with _ieee_float32():
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            # zeros, not empty: padding meets zero weights, and 0 * NaN would be NaN
            crops = torch.zeros((hi - lo, channels, hmax, wmax), device=device)
            for k, (top, left, h, w) in enumerate(boxes[lo:hi].tolist()):
                crops[k, :, :h, :w] = images[lo + k][:, top : top + h, left : left + w]
            rows = aa_weights(sizes[lo:hi, 0], height, hmax)
            cols = aa_weights(sizes[lo:hi, 1], width, wmax)
            resized = rows[:, None] @ crops @ cols[:, None].transpose(-1, -2)
            resized = resized.round_().clamp_(0, 255)
            # flipped after the product (exactly the unflipped pixels, mirrored)
            out[lo:hi] = torch.where(flips[lo:hi, None, None, None], resized.flip(-1), resized)
    return out
