"""What a sample and a batch are: the one home of that rule.

A **sample** is what ``dataset[i]`` returns and what PyTorch's ``collate_fn`` receives a list
of: ``(image, label)``, the image a tensor (images: uint8 [3, H, W], CHW like torchvision.io;
arrays: their stored dtype and shape), the label an int (-1 when unknown). A sample that was
skipped as corrupt (``on_error="skip"``) is ``None``.

A :class:`Batch` is what gpufeed's fast path hands out (``dataset.get_batch(indices)``,
``make_loader``): every sample of the batch stacked into one tensor, and the labels as one
int64 tensor. It unpacks like torch's default-collated ``[images, labels]``:
``for images, labels in loader``.

Datasets read a batch at a time and build either from the same two pieces (the samples as
read and their labels) with :func:`to_samples` or :func:`to_batch`, so a new kind of sample is
a change here, not in every dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

__all__ = ["Batch", "collate", "is_batch", "stack", "to_batch", "to_samples"]


class Batch(NamedTuple):
    """A batch as read: samples [B, ...] stacked when shapes agree (else a list of tensors),
    labels int64 [B]."""

    samples: torch.Tensor | list[torch.Tensor]
    labels: torch.Tensor


def is_batch(data) -> bool:
    """A ``(samples, labels)`` NamedTuple: gpufeed's ``Batch`` or any dataset's look-alike."""
    return isinstance(data, tuple) and getattr(data, "_fields", None) == ("samples", "labels")


def stack(samples: Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """One tensor when every sample has the same shape and dtype, else the list as it is."""
    samples = list(samples)
    if not samples:
        return torch.empty(0)
    first = samples[0]
    if all(
        isinstance(s, torch.Tensor) and s.shape == first.shape and s.dtype == first.dtype
        for s in samples
    ):
        if get_worker_info() is None:
            return torch.stack(samples)
        # in a DataLoader worker, stacked straight into shared memory (as torch's
        # default_collate does): handing the batch to the main process then moves a handle
        # instead of copying the batch once more
        out = torch.empty((len(samples), *first.shape), dtype=first.dtype).share_memory_()
        return torch.stack(samples, out=out)
    return samples


def _rows(samples) -> Sequence[torch.Tensor]:
    # views into a stacked batch: splitting costs no copy
    return samples.unbind(0) if isinstance(samples, torch.Tensor) else samples


def to_samples(samples, labels: np.ndarray, kept: np.ndarray, count: int) -> list:
    """The ``count`` samples of a read batch, in the order asked for: ``(tensor, int label)``
    at each position in ``kept`` (the positions that were read and decoded), ``None`` at the
    others (skipped as corrupt). ``samples`` and ``labels`` hold the kept ones, in order."""
    out: list = [None] * count
    for pos, sample, label in zip(kept.tolist(), _rows(samples), labels.tolist(), strict=True):
        out[pos] = (sample, label)
    return out


def to_batch(samples, labels: np.ndarray) -> Batch:
    """A read batch as one :class:`Batch` (samples stacked when their shapes agree)."""
    if not isinstance(samples, torch.Tensor):
        samples = stack(samples)
    return Batch(samples, torch.as_tensor(np.asarray(labels, dtype=np.int64)))


def _is_label(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point()
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def collate(data):
    """A ``collate_fn`` that gives :class:`Batch` es: a Batch passes through unchanged; a list
    of ``(tensor, int label)`` samples (skipped ones, ``None``, are dropped) becomes a Batch;
    anything else goes to torch's ``default_collate``. Use it with a plain DataLoader over a
    dataset opened with ``on_error="skip"`` (torch's default_collate cannot collate None)."""
    if is_batch(data):
        return data
    if isinstance(data, list):
        data = [d for d in data if d is not None]
        if data and all(
            isinstance(d, tuple)
            and len(d) == 2
            and isinstance(d[0], torch.Tensor)
            and _is_label(d[1])
            for d in data
        ):
            labels = torch.as_tensor([int(d[1]) for d in data], dtype=torch.int64)
            return Batch(stack([d[0] for d in data]), labels)
    return default_collate(data)
