"""Stored sample bytes -> torch tensors.

Images decode to uint8 tensors in CHW order with 3 (RGB) channels, like torchvision.io:
torchvision.io.decode_image when torchvision is importable, PIL otherwise. Arrays become
tensors with torch.from_numpy on the buffer they were read into (no extra copy).
"""

from __future__ import annotations

import functools
import io

import numpy as np
import torch

NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=1)
def have_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken torchvision install means: use PIL
        return False
    return True


def _as_bytes(data) -> bytes:
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

        buf = torch.from_numpy(np.frombuffer(_as_bytes(data), dtype=np.uint8).copy())
        read_mode = ImageReadMode.RGB if mode == "RGB" else ImageReadMode.GRAY
        try:
            return tv_decode(buf, mode=read_mode)
        except RuntimeError:
            pass  # formats torchvision does not decode (BMP, TIFF, ...) fall through to PIL
    from PIL import Image

    with Image.open(io.BytesIO(_as_bytes(data))) as img:
        arr = np.asarray(img.convert(mode))
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def decode_npy(data) -> torch.Tensor:
    arr = np.load(io.BytesIO(_as_bytes(data)), allow_pickle=False)
    return torch.from_numpy(np.ascontiguousarray(arr))


def array_to_tensor(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy for the writable arrays readers return; copies read-only views."""
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def decode_bytes(data) -> torch.Tensor:
    """An encoded sample of any supported kind (image or .npy) -> tensor."""
    head = bytes(data[:6]) if len(data) >= 6 else b""
    if head == NPY_MAGIC:
        return decode_npy(data)
    return decode_image(data)


def raw_bytes_tensor(data) -> torch.Tensor:
    """Encoded bytes as a 1-D uint8 tensor (decode=False: e.g. for GPU JPEG decoding)."""
    return torch.from_numpy(np.frombuffer(_as_bytes(data), dtype=np.uint8).copy())
