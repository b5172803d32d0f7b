"""Stored sample bytes -> torch tensors.

Images decode to uint8 tensors in CHW order with 3 (RGB) channels, like torchvision.io:
torchvision.io.decode_image when torchvision is importable, PIL otherwise. Arrays become
tensors with torch.from_numpy on the buffer they were read into (no extra copy).
"""

from __future__ import annotations

import functools
import io
import math
import random

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


# ------------------------------------------------------------------ fused decode + crop


def _decode_chw(data) -> torch.Tensor:
    """uint8 RGB [3, H, W]: torchvision's libjpeg-turbo decode_jpeg for JPEGs (no format
    sniffing, no extra copy of the bytes), the general decode_image path for anything else."""
    buf = _as_bytes(data)
    if have_torchvision() and buf[:2] == b"\xff\xd8":
        from torchvision.io import ImageReadMode, decode_jpeg

        return decode_jpeg(torch.frombuffer(bytearray(buf), dtype=torch.uint8), ImageReadMode.RGB)
    return decode_image(buf)


@functools.lru_cache(maxsize=1)
def opencv_backend():
    """(cv2, simplejpeg) when both import, else None: the fast path of RandomResizedCrop
    (``pip install gpufeed[opencv]``; the images carry both)."""
    try:
        import cv2
        import simplejpeg
    except Exception:  # noqa: BLE001 - missing or broken: the torch backend works alone
        return None
    return cv2, simplejpeg


def _decode_hwc(data, simplejpeg) -> np.ndarray:
    """uint8 RGB [H, W, 3]: simplejpeg (libjpeg-turbo, one call, RGB straight out) for JPEGs,
    the general decoder for anything else (PNG, CMYK JPEGs, ...)."""
    buf = _as_bytes(data)
    if buf[:2] == b"\xff\xd8":
        try:
            return simplejpeg.decode_jpeg(buf, colorspace="RGB")
        except ValueError:
            pass  # what libjpeg-turbo's simple API refuses (CMYK, ...) goes the general way
    chw = decode_image(buf)
    if chw.shape[0] == 1:
        chw = chw.expand(3, -1, -1)
    return np.ascontiguousarray(chw[:3].permute(1, 2, 0).numpy())


BACKENDS = ("auto", "opencv", "torch")


class RandomResizedCrop:
    """Decode, RandomResizedCrop and random horizontal flip in one pass over a batch: pass it
    as ``decode=`` to a dataset over encoded images (``gpufeed.open_dataset(path,
    decode=RandomResizedCrop(224))``). Batches come out as one uint8 [B, 3, size, size]
    tensor, written in place.

    The crop boxes are sampled as ``torchvision.transforms.v2.RandomResizedCrop(size, scale,
    ratio)`` samples them (ten tries, then the centre crop with the ratio clamped). Random
    numbers come from ``random`` and torch's generator, which make_loader seeds per worker,
    epoch and rank. Two backends resize the box:

    - ``"opencv"`` (``"auto"`` picks it when cv2 and simplejpeg import): libjpeg-turbo through
      simplejpeg, then the box resized straight into the batch: by ``cv2.resize`` bilinear
      when it is enlarged (torchvision's antialiased bilinear is the same filter there), by
      torchvision's antialiasing kernel when it is shrunk. Pixels match torchvision's to
      within 1 (uint8 rounding). The batch stays in the decoder's HWC layout: a
      [B, 3, H, W] tensor in ``channels_last`` memory format, the layout convolutions on the
      GPU prefer; ``memory_format=torch.contiguous_format`` transposes it (about 5 us per
      56x56 image). About 1.9x the torch backend on 64x64 JPEGs.
    - ``"torch"``: torchvision's ``decode_jpeg`` and its bilinear antialiased resize, the
      same pixels as ``transforms.v2.RandomResizedCrop`` + ``RandomHorizontalFlip`` for the
      same box; contiguous NCHW batches.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        backend: str = "auto",
        memory_format: torch.memory_format = torch.channels_last,
    ) -> None:
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        if len(self.size) != 2 or min(self.size) < 1:
            raise ValueError(f"size must be an int or (height, width) >= 1, got {size!r}")
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(
                f"need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1]: {scale}, {ratio}"
            )
        if not 0.0 <= flip <= 1.0:
            raise ValueError(f"flip is a probability, got {flip}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "opencv" and opencv_backend() is None:
            raise ValueError(
                "backend='opencv' needs cv2 and simplejpeg: pip install 'gpufeed[opencv]' "
                "(or opencv-python-headless simplejpeg), or use backend='torch'"
            )
        if backend == "auto":
            backend = "opencv" if opencv_backend() is not None else "torch"
        if memory_format not in (torch.channels_last, torch.contiguous_format):
            raise ValueError(
                f"memory_format must be torch.channels_last or torch.contiguous_format, got "
                f"{memory_format!r}"
            )
        self.scale, self.ratio, self.flip = tuple(scale), tuple(ratio), float(flip)
        self.backend = backend
        self.memory_format = memory_format
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def __repr__(self) -> str:
        layout = "" if self.backend == "torch" else f", memory_format={self.memory_format}"
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"flip={self.flip}, backend={self.backend!r}{layout})"
        )

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, h, w), as torchvision's RandomResizedCrop.get_params."""
        area = height * width
        for _ in range(10):
            target = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(*self._log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return random.randint(0, height - h), random.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h, w = height, int(round(height * self.ratio[1]))
        else:
            h, w = height, width
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, payloads) -> tuple[torch.Tensor, list[int], list[tuple[int, str]]]:
        """(batch [N, 3, H, W] of the samples that decoded, their positions in ``payloads``,
        (position, problem) for those that did not)."""
        if self.backend == "opencv":
            return self._opencv(payloads)
        return self._torch(payloads)

    def _opencv(self, payloads):
        cv2, simplejpeg = opencv_backend()
        height, width = self.size
        out = np.empty((len(payloads), height, width, 3), dtype=np.uint8)
        out_nchw = torch.from_numpy(out).permute(0, 3, 1, 2)  # the same memory, channels_last
        shrink_aa = torch.ops.aten._upsample_bilinear2d_aa.out
        kept: list[int] = []
        failed: list[tuple[int, str]] = []
        for j, payload in enumerate(payloads):
            try:
                img = _decode_hwc(payload, simplejpeg)
            except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt sample
                failed.append((j, f"cannot decode: {e}"))
                continue
            top, left, h, w = self.crop_box(img.shape[0], img.shape[1])
            n = len(kept)
            box = img[top : top + h, left : left + w]
            if h > height or w > width:
                # shrinking needs the antialiasing filter: torchvision's own kernel
                src = torch.from_numpy(box).permute(2, 0, 1)[None]
                shrink_aa(src, [height, width], False, out=out_nchw[n : n + 1])
            else:
                cv2.resize(box, (width, height), dst=out[n], interpolation=cv2.INTER_LINEAR)
            kept.append(j)
        n = len(kept)
        if self.flip and n:
            flips = (torch.rand(n) < self.flip).numpy()
            out[:n][flips] = out[:n][flips, :, ::-1]
        batch = out_nchw[:n]
        if self.memory_format == torch.contiguous_format:
            batch = batch.contiguous()
        return batch, kept, failed

    def _torch(self, payloads):
        out = torch.empty((len(payloads), 3, *self.size), dtype=torch.uint8)
        kept: list[int] = []
        failed: list[tuple[int, str]] = []
        resize = torch.ops.aten._upsample_bilinear2d_aa.out
        size = list(self.size)
        for j, payload in enumerate(payloads):
            try:
                img = _decode_chw(payload)
            except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt sample
                failed.append((j, f"cannot decode: {e}"))
                continue
            if img.shape[0] != 3:
                img = img.expand(3, -1, -1) if img.shape[0] == 1 else img[:3]
            top, left, h, w = self.crop_box(img.shape[1], img.shape[2])
            n = len(kept)
            crop = img[None, :, top : top + h, left : left + w]
            resize(crop, size, False, out=out[n : n + 1])
            kept.append(j)
        out = out[: len(kept)]
        if self.flip and len(kept):
            flips = torch.rand(len(kept)) < self.flip
            out[flips] = out[flips].flip(-1)
        return out, kept, failed
