"""Stored sample bytes -> torch tensors.

Images decode to uint8 tensors in CHW order with 3 (RGB) channels, like torchvision.io:
torchvision.io.decode_image when torchvision is importable, PIL otherwise. Arrays become
tensors with torch.from_numpy on the buffer they were read into (no extra copy).
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import get_worker_info

from gpufeed.batch import new_batch_tensor
from gpufeed.data import native_jpeg
from gpufeed.data.boxes import check_options
from gpufeed.data.images import (
    as_bytes,
    crop_params,
    decode_image,
    decode_rgb,
    have_torchvision,
    resize_antialiased,
)
from gpufeed.errors import UsageError
from gpufeed.system import sysinfo

NPY_MAGIC = b"\x93NUMPY"


def decode_npy(data) -> torch.Tensor:
    arr = np.load(io.BytesIO(as_bytes(data)), allow_pickle=False)
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
    return torch.from_numpy(np.frombuffer(as_bytes(data), dtype=np.uint8).copy())


# ------------------------------------------------------------------ fused decode + crop


@functools.lru_cache(maxsize=1)
def _opencv_import():
    """((cv2, simplejpeg), None) when both import, else (None, why not)."""
    try:
        import cv2
        import simplejpeg
    except Exception as exc:  # noqa: BLE001 - missing or broken: the torch backend works alone
        return None, f"cv2 or simplejpeg does not import ({exc}): pip install 'gpufeed[opencv]'"
    return (cv2, simplejpeg), None


def opencv_backend():
    """(cv2, simplejpeg) when both import, else None: the fast path of RandomResizedCrop
    (``pip install gpufeed[opencv]``; the images carry both)."""
    return _opencv_import()[0]


def _hwc(chw: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(chw.permute(1, 2, 0).numpy())


def _decode_hwc_simplejpeg(data) -> np.ndarray:
    """uint8 RGB [H, W, 3] by simplejpeg (libjpeg-turbo reads the buffer as it is: no copy, no
    sniffing); the general way for what it refuses (not a JPEG) and for CMYK/YCCK, which
    TurboJPEG turns into RGB with other rounding than torchvision and Pillow (1 level off)."""
    simplejpeg = opencv_backend()[1]
    try:
        if simplejpeg.decode_jpeg_header(data)[2] not in ("CMYK", "YCCK"):
            return simplejpeg.decode_jpeg(data, "RGB")
    except ValueError:
        pass
    return _hwc(decode_rgb(data))


BACKENDS = ("auto", "native", "opencv", "torch")


def native_status() -> tuple[bool, str]:
    """(whether the native batch decoder gpufeed-jpeg imports, one line naming it or why not)."""
    return native_jpeg.available(), native_jpeg.status()


def _pick_backend(backend: str) -> str:
    native, why = native_status()
    if backend == "native" and not native:
        raise ValueError(f"backend='native' needs gpufeed-jpeg: {why}")
    if backend == "opencv" and opencv_backend() is None:
        raise ValueError(
            "backend='opencv' needs cv2 and simplejpeg: pip install 'gpufeed[opencv]' "
            "(or opencv-python-headless simplejpeg), or use backend='torch'"
        )
    if backend != "auto":
        return backend
    if native:
        return "native"
    return "opencv" if opencv_backend() is not None else "torch"


def jpeg_backend() -> tuple[str, str]:
    """(the backend ``RandomResizedCrop(backend="auto")`` takes here, one line saying what it
    is and, for each faster backend passed over, why: the import that failed)."""
    name = _pick_backend("auto")
    native, native_why = native_status()
    if name == "native":
        return name, native_why
    passed = f"native: {native_why}" if not native else ""
    if name == "opencv":
        cv2, simplejpeg = opencv_backend()
        what = f"cv2 {cv2.__version__} + simplejpeg {simplejpeg.__version__}"
    else:
        opencv_why = _opencv_import()[1] or "cv2 and simplejpeg do not import"
        passed += f"; opencv: {opencv_why}"
        what = "torchvision.io" if have_torchvision() else "PIL"
    return name, f"{what}; not faster ones ({passed})"


class RandomResizedCrop:
    """Decode, RandomResizedCrop and random horizontal flip in one pass over a batch: pass it
    as ``decode=`` to a dataset over encoded images (``gpufeed.open_dataset(path,
    decode=RandomResizedCrop(224))``). Batches come out as one uint8 [B, 3, size, size]
    tensor, written in place.

    The crop boxes are sampled as ``torchvision.transforms.v2.RandomResizedCrop(size, scale,
    ratio)`` samples them (ten tries, then the centre crop with the ratio clamped), for the
    whole batch at once from torch's generator, which make_loader seeds per worker, epoch and
    rank.

    Memory format, the same with every backend: ``dataset.get_batch`` and ``make_loader``
    hand the batch out as it is; ``dataset[i]`` and ``__getitems__`` give each sample as a
    [3, H, W] view of it (values equal, strides of the batch's layout), and a plain
    DataLoader's ``default_collate`` stacks those into a contiguous NCHW batch.

    Args:
        size: the output's side, or (height, width).
        scale: the crop's share of the image's area, (low, high), as torchvision's.
        ratio: the crop's aspect ratio, (low, high), as torchvision's.
        flip: the probability of a horizontal flip.
        backend: what decodes and resizes; ``"auto"`` takes the first installed of:
            ``"native"``: gpufeed-jpeg (``gpufeed.data.native_jpeg``, the images carry it),
            one call per batch on ``threads`` threads without the GIL, each JPEG decoded
            only where its box lies; for the same box torchvision's pixels (docs/jpeg.md).
            ``"opencv"`` (when cv2 and simplejpeg import): libjpeg-turbo through simplejpeg
            (CMYK JPEGs the general way, for torchvision's colours), then the box resized
            straight into the batch: by ``cv2.resize`` bilinear when it is enlarged
            (torchvision's antialiased bilinear is the same filter there), by torchvision's
            antialiasing kernel when it is shrunk; pixels match torchvision's to within 1
            (uint8 rounding); faster than the torch backend
            (docs/performance/jpeg-decode.md). ``"torch"``: torchvision's ``decode_jpeg``
            and its bilinear antialiased resize, the same pixels as
            ``transforms.v2.RandomResizedCrop`` + ``RandomHorizontalFlip`` for the same box.
        memory_format: ``torch.channels_last`` (the default: the layout GPU convolutions
            prefer, and the decoder's own HWC, so no transpose) or
            ``torch.contiguous_format`` (NCHW).
        threads: the native backend's threads; None sizes the pool from the loader's CPUs
            (:func:`gpufeed.system.sysinfo.loader_cpus`, read once per process) shared by
            the DataLoader workers of this process's loader: all of them in-process,
            ``cpus // num_workers`` in a worker.
        dct_scaling: native backend: let libjpeg-turbo shrink a box that is at least twice
            the output inside the IDCT first: faster on large pictures, but other pixels
            than torchvision's (docs/jpeg.md measures how far); off by default.
        boxes: multi-field packs (gpufeed.data.boxes): a field name, or several, of a ragged
            [-1, 4] field moved with its image as torchvision v2 moves a
            ``tv_tensors.BoundingBoxes`` through the same crop, resize and flip: clamped to
            the crop, a box left with no area dropped. A pack with a field that looks like
            boxes (named box, boxes, bbox or bboxes, or floating [-1, 4]) decoded without
            ``boxes=`` warns once: those boxes would no longer match the image; ``boxes=()``
            says there are none to move.
        box_format: "XYXY", "XYWH" or "CXCYWH", in pixels.
        per_box: fields whose values go with each box (its label...), dropped with it.
        return_params: True (or a field name) adds a field ``crop_params``: int64 [B, 5],
            each sample's (top, left, height, width, flipped) in its stored image.

    Raises:
        ValueError: an option out of its range (named, with what it may be).
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        backend: str = "auto",
        memory_format: torch.memory_format = torch.channels_last,
        threads: int | None = None,
        dct_scaling: bool = False,
        *,
        boxes: str | Sequence[str] | None = None,
        box_format: str = "XYXY",
        per_box: str | Sequence[str] = (),
        return_params: bool | str = False,
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
        if threads is not None and (
            isinstance(threads, bool) or int(threads) != threads or threads < 1
        ):
            raise ValueError(
                f"threads must be an int >= 1 or None (sized from the CPUs), got {threads!r}"
            )
        backend = _pick_backend(backend)
        if memory_format not in (torch.channels_last, torch.contiguous_format):
            raise ValueError(
                f"memory_format must be torch.channels_last or torch.contiguous_format, got "
                f"{memory_format!r}"
            )
        self.scale, self.ratio, self.flip = tuple(scale), tuple(ratio), float(flip)
        self.backend = backend
        self.memory_format = memory_format
        self.threads, self.dct_scaling = threads, bool(dct_scaling)
        self.loader_threads: int | None = None  # make_loader's decoder_threads, when not auto
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.boxes, self.per_box, self.box_format, self.return_params = check_options(
            boxes, per_box, box_format, return_params
        )

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"flip={self.flip}, backend={self.backend!r}, memory_format={self.memory_format}, "
            f"threads={self.threads}, dct_scaling={self.dct_scaling}{self._box_repr()})"
            + (f" (loader: {self.loader_threads} threads)" if self.loader_threads else "")
        )

    def _box_repr(self) -> str:
        text = "" if self.boxes is None else f", boxes={self.boxes}, box_format={self.box_format!r}"
        text += f", per_box={self.per_box}" if self.per_box else ""
        return text + (f", return_params={self.return_params!r}" if self.return_params else "")

    def threads_for(self, num_workers: int) -> int:
        """Decoder threads per process when the loader runs ``num_workers`` workers (0: the
        loading process itself): ``threads`` when given, else make_loader's
        ``decoder_threads`` when set, else the loader's CPUs shared by its processes. 1 for
        the backends that decode one image at a time."""
        if self.backend != "native":
            return 1
        if self.threads is not None or self.loader_threads is not None:
            return self.threads or self.loader_threads
        return max(1, sysinfo.process_loader_cpus() // max(1, num_workers))

    def decoder_threads(self) -> int:
        """:meth:`threads_for` this process: a DataLoader worker shares the CPUs with its
        siblings, the loading process has them all."""
        info = get_worker_info()
        return self.threads_for(info.num_workers if info is not None else 0)

    def crop_boxes(self, heights: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """[N, 4] int64 (top, left, h, w): torchvision's RandomResizedCrop.get_params for N
        images at once (ten tries each, the first that fits wins, else the centre crop with
        the ratio clamped), from one draw of torch's generator."""
        heights = np.asarray(heights, dtype=np.int64)
        widths = np.asarray(widths, dtype=np.int64)
        n = len(heights)
        u = torch.rand(n, 22, dtype=torch.float64).numpy()
        area = (heights * widths)[:, None]
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, :10])
        lo, hi = self._log_ratio
        aspect = np.exp(lo + (hi - lo) * u[:, 10:20])
        w = np.rint(np.sqrt(target * aspect)).astype(np.int64)
        h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fits = (w > 0) & (w <= widths[:, None]) & (h > 0) & (h <= heights[:, None])
        first = fits.argmax(axis=1)
        rows = np.arange(n)
        h, w = h[rows, first], w[rows, first]
        any_fit = fits[rows, first]
        # none of the ten fit: the centre crop, the ratio clamped into range
        in_ratio = widths / heights
        narrow, wide = in_ratio < self.ratio[0], in_ratio > self.ratio[1]
        ch = np.where(narrow, np.rint(widths / self.ratio[0]).astype(np.int64), heights)
        cw = np.where(wide, np.rint(heights * self.ratio[1]).astype(np.int64), widths)
        h, w = np.where(any_fit, h, ch), np.where(any_fit, w, cw)
        top = np.where(any_fit, (u[:, 20] * (heights - h + 1)).astype(np.int64), (heights - h) // 2)
        left = np.where(any_fit, (u[:, 21] * (widths - w + 1)).astype(np.int64), (widths - w) // 2)
        return np.stack([top, left, h, w], axis=1)

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, h, w) for one image (see crop_boxes)."""
        return tuple(int(v) for v in self.crop_boxes([height], [width])[0])

    def __call__(self, payloads) -> tuple[torch.Tensor, list[int], list[tuple[int, str]]]:
        """Decode, crop, resize and flip one batch of (image, label) samples.

        Args:
            payloads: the samples' encoded images (bytes or 1-D uint8 arrays/tensors).

        Returns:
            (batch [N, 3, H, W] of the samples that decoded, their positions in
            ``payloads``, (position, problem) for those that did not).

        Raises:
            UsageError: ``boxes=`` or ``return_params=`` was given: they need a multi-field
                pack.
        """
        if self.boxes or self.return_params:
            raise UsageError(
                f"{self!r}: boxes= and return_params= need a multi-field pack (samples are "
                "dicts, with the boxes in a field); this one's samples are (image, label)"
            )
        return self.with_params(payloads)[:3]

    def with_params(self, payloads):
        """``(batch, kept, failed, params)``: as calling it, and the crop each kept image
        got: int64 [N, 5] (top, left, height, width, flipped) in its stored pixels."""
        if self.backend == "native":
            return native_jpeg.decode_resized_crops(
                payloads,
                self,
                threads=self.decoder_threads(),
                dct_scaling=self.dct_scaling,
                with_params=True,
            )
        images, kept, failed = [], [], []
        for j, payload in enumerate(payloads):
            try:
                if self.backend == "opencv":
                    images.append(_decode_hwc_simplejpeg(payload))
                else:
                    images.append(decode_rgb(payload))
                kept.append(j)
            except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt sample
                failed.append((j, f"cannot decode: {e}"))
        hw = 0 if self.backend == "opencv" else 1  # HWC or CHW
        boxes = self.crop_boxes(
            [im.shape[hw] for im in images], [im.shape[hw + 1] for im in images]
        )
        if self.backend == "opencv":
            out = self._resize_opencv(images, boxes.tolist())
        else:
            out = self._resize_torch(images, boxes.tolist())
        flips = self.draw_flips(len(kept))
        if flips.any():
            out[flips] = out[flips].flip(-1)
        return out, kept, failed, crop_params(boxes, flips)

    def draw_flips(self, n: int) -> np.ndarray:
        """bool [n]: which images are mirrored (one draw of torch's generator, none when
        ``flip`` is 0)."""
        if self.flip and n:
            return (torch.rand(n) < self.flip).numpy()
        return np.zeros(n, dtype=bool)

    def _resize_opencv(self, images: list[np.ndarray], boxes: list[list[int]]) -> torch.Tensor:
        cv2 = opencv_backend()[0]
        height, width = self.size
        # cv2 writes HWC: into the batch itself when it is channels_last, else into a
        # scratch image copied into the NCHW batch (one small copy per image)
        out_nchw = self._out_batch(len(images))
        nhwc = self.memory_format == torch.channels_last
        out = out_nchw.permute(0, 2, 3, 1).numpy() if nhwc else None
        scratch = None if nhwc else np.empty((height, width, 3), dtype=np.uint8)
        linear = cv2.INTER_LINEAR
        for n, (img, (top, left, h, w)) in enumerate(zip(images, boxes, strict=True)):
            box = img[top : top + h, left : left + w]
            if h > height or w > width:
                # shrinking needs the antialiasing filter: torchvision's own kernel
                resize_antialiased(
                    torch.from_numpy(box).permute(2, 0, 1)[None], out_nchw[n : n + 1]
                )
            elif nhwc:
                cv2.resize(box, (width, height), dst=out[n], interpolation=linear)
            else:
                cv2.resize(box, (width, height), dst=scratch, interpolation=linear)
                out_nchw[n].copy_(torch.from_numpy(scratch).permute(2, 0, 1))
        return out_nchw

    def _resize_torch(self, images: list[torch.Tensor], boxes: list[list[int]]) -> torch.Tensor:
        out = self._out_batch(len(images))
        # the uint8 kernel writes the layout it reads (CHW here): into the batch when that is
        # NCHW, else into a scratch image copied into the channels_last batch
        nchw = self.memory_format == torch.contiguous_format
        scratch = None if nchw else torch.empty((1, 3, *self.size), dtype=torch.uint8)
        for n, (img, (top, left, h, w)) in enumerate(zip(images, boxes, strict=True)):
            crop = img[None, :, top : top + h, left : left + w]
            if nchw:
                resize_antialiased(crop, out[n : n + 1])
            else:
                resize_antialiased(crop, scratch)
                out[n].copy_(scratch[0])
        return out

    def _out_batch(self, n: int) -> torch.Tensor:
        """The [n, 3, H, W] uint8 batch, laid out in ``memory_format`` from the start, so
        neither backend transposes afterwards."""
        height, width = self.size
        if self.memory_format == torch.channels_last:
            return new_batch_tensor((n, height, width, 3)).permute(0, 3, 1, 2)
        return new_batch_tensor((n, 3, height, width))
