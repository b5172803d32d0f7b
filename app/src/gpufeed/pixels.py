"""Pixel depth: every decoded image is 8-bit (uint8), whatever its file stores.

A 16-bit image (16-bit PNG or TIFF: PIL modes I;16*, torchvision's uint16) is scaled to 8 bits,
value * 255 / 65535 rounded (what libpng's png_set_scale_16 does), never clipped: PIL's own
convert("RGB") clips, which turns nearly every pixel of a 16-bit image white. Images whose
pixels have no 8-bit meaning without a guess (32-bit integer or float pixels) are refused with
a message: never a silently wrong picture.

Images of different sizes cannot be one batch tensor: :func:`mixed_sizes_message` is the one
wording of that and what to do, for the load-time errors (gpufeed.batch), pack and inspect.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MAX16 = 65535


def scale16(values: np.ndarray) -> np.ndarray:
    """uint16 values (in any integer dtype wide enough) -> uint8, rounded."""
    wide = values.astype(np.uint32)
    return ((wide * 255 + _MAX16 // 2) // _MAX16).astype(np.uint8)


def to_8bit(img):
    """A PIL image in an 8-bit mode: 16-bit grey scaled (mode L); 8-bit modes unchanged.
    Raises ValueError naming the mode for pixels that have no 8-bit reading."""
    from PIL import Image

    mode = img.mode
    if mode.startswith("I;16"):
        return Image.fromarray(scale16(np.asarray(img)))  # 2-D uint8: mode L
    if mode == "I" and img.format == "PNG":  # older Pillow opens 16-bit grey PNGs as "I"
        return Image.fromarray(scale16(np.asarray(img)))
    if mode in ("I", "F"):
        kind = "32-bit integer" if mode == "I" else "floating-point"
        raise ValueError(
            f"{kind} pixels (PIL mode {mode}): gpufeed decodes images to 8 bits and will not "
            "guess a scale; convert the image to 8 or 16 bits first, or pack it as a .npy array"
        )
    return img


def tensor_to_uint8(img):
    """A decoded image tensor as uint8: torchvision decodes 16-bit PNGs to uint16."""
    import torch

    if img.dtype == torch.uint8:
        return img
    if img.dtype == torch.uint16:
        return torch.from_numpy(scale16(img.numpy()))
    raise ValueError(f"decoded image has dtype {img.dtype}; expected uint8 or uint16")


def mixed_sizes_message(shapes: Sequence[Sequence[int]], where: str | None = None) -> str:
    """The one wording of "these images differ in size", and what to do.

    Args:
        shapes: the images' shapes ([3, H, W] as read, or (H, W) as packed); repeats are
            shown once, the first three of them.
        where: the dataset or pack the images are in, named first.

    Returns:
        The message: for the load-time errors (gpufeed.batch), and for pack and inspect to
        print when a pack's image sizes vary.
    """
    seen: list[list[int]] = []
    for shape in shapes:
        if list(shape) not in seen:
            seen.append(list(shape))
    shown = ", ".join(str(s) for s in seen[:3]) + (", ..." if len(seen) > 3 else "")
    return (
        (f"{where}: " if where else "")
        + f"the images differ in size ({shown}), so a batch of them cannot be one tensor. "
        "Crop them to one size as they are read: open_dataset(path, "
        "decode=gpufeed.RandomResizedCrop(224)) (or a transform that resizes), or pack them "
        "at one size: gpufeed pack SOURCE DEST --encode raw --resize 224x224. A collate_fn "
        "that keeps lists (lambda batch: tuple(zip(*batch))) takes them as they are"
    )
