"""The native batch JPEG decoder: gpufeed-jpeg (``app/native``, import name ``gpufeed_jpeg``).

One call per batch, on a pool of threads that runs without the GIL: each JPEG is decoded only
where its crop box lies (libjpeg-turbo: the box's iMCU columns, no rows below it), resized
with PyTorch's uint8 antialiased bilinear kernel (torchvision's resize: for the same box the
same pixels) and mirrored, straight into the batch. A separate distribution, so gpufeed stays
pure Python: where it is not installed (``pip install ./app/native``; the images carry it),
:func:`status` says why and RandomResizedCrop's other backends do the work.

:func:`decode_resized_crops` keeps the contract of ``RandomResizedCrop.__call__``: the same
crop boxes and flips from the same torch generator draws, ``(batch, kept, failed)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpufeed.batch import new_batch_tensor
from gpufeed.data.images import crop_params, decode_rgb, resize_antialiased
from gpufeed.system.native import jpeg_module

if TYPE_CHECKING:  # the crop's settings; decoders calls this module
    from gpufeed.data.decoders import RandomResizedCrop

NOT_A_JPEG = "not a JPEG"


def available() -> bool:
    return jpeg_module()[0] is not None


def status() -> str:
    """One line: which native decoder is active, or why none is."""
    mod, why = jpeg_module()
    if mod is None:
        return why
    return (
        f"gpufeed-jpeg (libjpeg-turbo {mod.LIBJPEG_TURBO_VERSION}, libjpeg API "
        f"{mod.JPEG_LIB_VERSION})"
    )


def _module():
    mod, why = jpeg_module()
    if mod is None:
        raise RuntimeError(why)
    return mod


def image_sizes(payloads: Sequence, threads: int = 1) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """(int64 [N, 2] (height, width) from the JPEG headers, -1 where unreadable;
    [(i, problem)] for those)."""
    return _module().image_sizes(payloads, threads)


def decode_resized_crops(
    payloads: Sequence,
    crop: RandomResizedCrop,
    *,
    threads: int = 1,
    dct_scaling: bool = False,
    with_params: bool = False,
) -> tuple:
    """``crop(payloads)`` with the native decoder: (batch [N, 3, H, W] uint8 in
    ``crop.memory_format``, positions in ``payloads`` of its images, (position, problem) for
    those that did not decode). Payloads that are not JPEGs (PNG, ...) decode the general way
    (gpufeed.data.decoders.decode_image) and resize with the same kernel.

    ``threads``: decoder threads for this call (the caller's thread is one of them).
    ``dct_scaling``: let libjpeg-turbo shrink a box that is at least twice the output by 2, 4
    or 8 in the IDCT first: faster on large pictures, but no longer torchvision's pixels (see
    docs/jpeg.md for the measured difference); off by default. ``with_params``: also each
    kept image's crop, int64 [N, 5] (top, left, h, w, flipped), as a fourth value.
    """
    mod = _module()
    sizes, problems = mod.image_sizes(payloads, threads)
    others, failed = {}, []
    for j, problem in problems:
        if problem.startswith(NOT_A_JPEG):
            try:
                others[j] = decode_rgb(payloads[j])
            except Exception as exc:  # noqa: BLE001 - any decoder failure is a corrupt sample
                failed.append((j, f"cannot decode: {exc}"))
        else:
            failed.append((j, f"cannot decode: {problem}"))
    for j, img in others.items():
        sizes[j] = img.shape[1:]
    kept_at = np.flatnonzero(sizes[:, 0] >= 0)  # in numpy: no Python step per image
    kept = kept_at.tolist()
    boxes = crop.crop_boxes(sizes[kept_at, 0], sizes[kept_at, 1])
    flips = crop.draw_flips(len(kept))
    height, width = crop.size
    out = new_batch_tensor((len(kept), height, width, 3))
    rows = out.numpy()
    if not others and len(kept) == len(payloads):  # all JPEGs, all readable: no list copy
        broken = mod.decode_crops(payloads, boxes, flips, rows, threads, dct_scaling)
    else:
        jpegs = [n for n, j in enumerate(kept) if j not in others]
        part = np.empty((len(jpegs), height, width, 3), dtype=np.uint8)
        broken = mod.decode_crops(
            [payloads[kept[n]] for n in jpegs],
            boxes[jpegs],
            flips[jpegs],
            part,
            threads,
            dct_scaling,
        )
        rows[jpegs] = part
        broken = [(jpegs[n], problem) for n, problem in broken]
    for j, img in others.items():
        n = kept.index(j)
        _resize_into(img, boxes[n], bool(flips[n]), out[n : n + 1].permute(0, 3, 1, 2))
    if broken:  # found only while decoding: the batch closes up over them
        bad = {n for n, _ in broken}
        failed += [(kept[n], f"cannot decode: {problem}") for n, problem in broken]
        keep = [n for n in range(len(kept)) if n not in bad]
        out, kept = out[keep], [kept[n] for n in keep]
        boxes, flips = boxes[keep], flips[keep]
        failed.sort()
    nchw = out.permute(0, 3, 1, 2)  # channels_last: the decoder's HWC memory
    if crop.memory_format == torch.contiguous_format:
        nchw = nchw.contiguous()
    if with_params:
        return nchw, kept, failed, crop_params(boxes, flips)
    return nchw, kept, failed


def _resize_into(img: torch.Tensor, box, flip: bool, out: torch.Tensor) -> None:
    top, left, h, w = (int(v) for v in box)
    resize_antialiased(img[None, :, top : top + h, left : left + w], out)
    if flip:
        out.copy_(out.flip(-1))
