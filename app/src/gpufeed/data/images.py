"""One image's bytes -> a uint8 RGB tensor, and resizing a crop of it: what every backend of
RandomResizedCrop shares (gpufeed.data.decoders; the native one in gpufeed.data.native_jpeg).
torchvision.io decodes when it imports, PIL otherwise."""

from __future__ import annotations

import functools
import io

import numpy as np
import torch

from gpufeed.pixels import tensor_to_uint8, to_8bit


@functools.lru_cache(maxsize=1)
def have_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken torchvision install means: use PIL
        return False
    return True


def as_bytes(data) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        return data.tobytes()
    return bytes(data)


def decode_image(data, mode: str = "RGB") -> torch.Tensor:
    """JPEG/PNG/... bytes -> uint8 tensor [C, H, W] (C=3 for RGB, 1 for "L")."""
    if have_torchvision():
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_image as tv_decode

        buf = torch.from_numpy(np.frombuffer(as_bytes(data), dtype=np.uint8).copy())
        read_mode = ImageReadMode.RGB if mode == "RGB" else ImageReadMode.GRAY
        try:
            return tensor_to_uint8(tv_decode(buf, mode=read_mode))
        except RuntimeError:
            pass  # formats torchvision does not decode (BMP, TIFF, ...) fall through to PIL
    from PIL import Image

    with Image.open(io.BytesIO(as_bytes(data))) as img:
        arr = np.asarray(to_8bit(img).convert(mode))
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _decode_chw(data) -> torch.Tensor:
    """uint8 RGB [3, H, W]: torchvision's libjpeg-turbo decode_jpeg for JPEGs (no format
    sniffing, no extra copy of the bytes), the general decode_image path for anything else."""
    buf = as_bytes(data)
    if have_torchvision() and buf[:2] == b"\xff\xd8":
        from torchvision.io import ImageReadMode, decode_jpeg

        return decode_jpeg(torch.frombuffer(bytearray(buf), dtype=torch.uint8), ImageReadMode.RGB)
    return decode_image(buf)


def decode_rgb(data) -> torch.Tensor:
    """uint8 RGB [3, H, W] (grey repeated, alpha dropped)."""
    img = _decode_chw(data)
    if img.shape[0] != 3:
        img = img.expand(3, -1, -1) if img.shape[0] == 1 else img[:3]
    return img


def resize_antialiased(src: torch.Tensor, out: torch.Tensor) -> None:
    """src [1, 3, h, w] uint8 resized into out [1, 3, H, W] by torch's antialiased bilinear
    uint8 kernel, the one torchvision's resize takes for uint8 images."""
    size = list(out.shape[2:])
    if size == [1, 1]:
        # a 1x1 output is contiguous in both layouts: the kernel takes it for channels_last and
        # fails an internal assert (num_channels == unpacked_output.size(0)) on an NCHW src
        src = src.contiguous(memory_format=torch.channels_last)
    torch.ops.aten._upsample_bilinear2d_aa.out(src, size, False, out=out)


def crop_params(boxes: np.ndarray, flips: np.ndarray) -> torch.Tensor:
    """int64 [N, 5]: each image's crop box (top, left, h, w) and whether it was flipped."""
    params = np.concatenate([boxes.reshape(-1, 4), flips.reshape(-1, 1)], axis=1)
    return torch.from_numpy(params.astype(np.int64))
