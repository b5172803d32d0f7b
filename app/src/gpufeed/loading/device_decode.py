"""JPEG decode + RandomResizedCrop + flip on the GPU, inside ``DevicePrefetcher``.

The loader ships encoded bytes (``open_dataset(path, decode=False)``: one 1-D uint8 tensor
per sample, pinned by the loader), and the prefetcher decodes a whole batch on the device on
its side stream: ``torchvision.io.decode_jpeg(list, device="cuda")`` (nvJPEG, batched), then
every image's box cropped, resized (torch's antialiased bilinear weights) and flipped on the
GPU by two batched matrix products into one uint8 batch (loading/batch_resize.py), which
the prefetcher's usual conversions then turn into float, normalised, channels_last. The
boxes and flips are drawn on the CPU from torch's generator exactly as the CPU decoder draws
them (``RandomResizedCrop.crop_boxes``).

Where it runs (:func:`decode_device`): ``"auto"`` on the prefetcher's device when that is a
CUDA device and torchvision's GPU decoder imports, else on the CPU with the crop's own CPU
backend (gpufeed-jpeg, OpenCV or torch): the same batches, only slower. A batch the GPU
decoder refuses (a PNG, a corrupt or CMYK JPEG) is decoded on the CPU, where a corrupt
sample is dropped with its label, as the datasets drop it.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from gpufeed.batch import Batch, is_batch
from gpufeed.data.decoders import RandomResizedCrop
from gpufeed.errors import UsageError
from gpufeed.loading.batch_resize import resized_crops

__all__ = ["DECODE_ON", "DeviceDecode", "decode_device", "gpu_jpeg_decoder"]

DECODE_ON = ("auto", "cuda", "cpu")


@functools.lru_cache(maxsize=1)
def gpu_jpeg_decoder():
    """(torchvision.io.decode_jpeg, None), or (None, why the GPU path is not there)."""
    try:
        from torchvision.io import decode_jpeg
    except Exception as exc:  # noqa: BLE001 - a missing or broken torchvision: the CPU path
        return None, f"torchvision.io.decode_jpeg does not import ({exc})"
    return decode_jpeg, None


def decode_device(device: torch.device, decode_on: str = "auto") -> torch.device:
    """Where a batch is decoded: ``"cuda"`` asks for the GPU decoder (a UsageError naming
    why when it cannot run), ``"cpu"`` for the CPU decoders, ``"auto"`` the GPU when
    ``device`` is a CUDA device that torch sees and torchvision's decoder imports."""
    if decode_on not in DECODE_ON:
        raise ValueError(f"decode_on must be one of {DECODE_ON}, got {decode_on!r}")
    if decode_on == "cpu":
        return torch.device("cpu")
    why = None
    if device.type != "cuda" or not torch.cuda.is_available():
        why = f"the prefetcher's device is {device} (no CUDA device)"
    elif gpu_jpeg_decoder()[0] is None:
        why = gpu_jpeg_decoder()[1]
    if why is None:
        return device
    if decode_on == "cuda":
        raise UsageError(f"decode_on='cuda' needs the GPU JPEG decoder, but {why}")
    return torch.device("cpu")


class DeviceDecode:
    """Decode, crop, resize and flip batches of encoded images on ``device`` (see the
    module docstring) with ``crop``'s settings (size, scale, ratio, flip, memory_format)."""

    def __init__(
        self, crop: RandomResizedCrop, device: torch.device, batched: bool | None = None
    ) -> None:
        if not isinstance(crop, RandomResizedCrop):
            raise TypeError(f"decode must be a gpufeed.RandomResizedCrop, got {crop!r}")
        if crop.boxes or crop.return_params:
            raise UsageError(
                f"{crop!r}: boxes= and return_params= are for a crop in the dataset "
                "(open_dataset(path, decode=crop) over a multi-field pack); the device decodes "
                "(image, label) batches, which carry neither"
            )
        self.crop, self.device = crop, device
        # torchvision's batched decode on ``device`` (None: when it is a GPU), else the
        # crop's CPU backend; the batched path runs on the CPU too (its tests do)
        self.batched = device.type == "cuda" if batched is None else batched
        self.fallbacks = 0  # batches the batched decoder refused, decoded the CPU way instead

    def __repr__(self) -> str:
        return f"DeviceDecode({self.crop!r}, device={self.device})"

    def __call__(self, batch):
        """A Batch of encoded samples -> a Batch of [N, 3, H, W] uint8 images on ``device``
        (any other batch passes through unchanged)."""
        payloads = _encoded(batch)
        if payloads is None:
            return batch
        labels = batch.labels
        if self.batched:
            try:
                return Batch(self._on_device(payloads), labels.to(self.device))
            except RuntimeError as exc:
                self.fallbacks += 1
                if self.fallbacks == 1:
                    warnings.warn(
                        f"the batched JPEG decoder refused a batch ({exc}); decoding it the "
                        "CPU way (a PNG, CMYK or corrupt JPEG among the samples?)",
                        stacklevel=2,
                    )
        # numpy views of the encoded tensors: buffers every CPU backend reads without a copy
        images, kept, _ = self.crop([p.numpy() for p in payloads])
        kept = torch.as_tensor(kept, dtype=torch.long)
        return Batch(images.to(self.device), labels[kept].to(self.device))

    def _on_device(self, payloads: list[torch.Tensor]) -> torch.Tensor:
        decode, why = gpu_jpeg_decoder()
        if decode is None:
            raise RuntimeError(why)
        from torchvision.io import ImageReadMode

        images = decode(payloads, mode=ImageReadMode.RGB, device=self.device)
        sizes = np.array([img.shape[1:] for img in images], dtype=np.int64).reshape(-1, 2)
        boxes = self.crop.crop_boxes(sizes[:, 0], sizes[:, 1])
        flips = np.zeros(len(images), dtype=bool)
        if self.crop.flip and images:
            flips = (torch.rand(len(images)) < self.crop.flip).numpy()
        out = torch.empty((len(images), 3, *self.crop.size), dtype=torch.uint8, device=self.device)
        resized_crops(images, boxes, flips, out)
        return out.contiguous(memory_format=self.crop.memory_format)


def _encoded(batch) -> list[torch.Tensor] | None:
    """The encoded samples of a Batch: a list of 1-D uint8 tensors, or the rows of a 2-D one
    (payloads that happened to be of one length were stacked); None for anything else."""
    if not is_batch(batch):
        return None
    samples = batch.samples
    if isinstance(samples, torch.Tensor) and samples.dtype == torch.uint8 and samples.dim() == 2:
        return list(samples.unbind(0))
    if isinstance(samples, list) and all(isinstance(p, torch.Tensor) for p in samples):
        return samples
    return None
