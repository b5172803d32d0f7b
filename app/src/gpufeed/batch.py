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

A multi-field pack's sample is a dict of its fields (gpufeed.formats.schema): tensors for
arrays and decoded images, str, bytes, int, float or a JSON value for the others. Its batch
is a :class:`FieldBatch`, a dict of the fields collated (:func:`collate_fields`):

  fixed-shape tensors (arrays, same-size images)   stacked: [B, ...]
  ragged tensors (tokens, boxes, waveforms)        a list of B tensors, or with ``pad=``
                                                   {name: value}: one tensor padded with value
                                                   to the largest size in each dimension, plus
                                                   ``NAME_mask``, bool, the same shape, True
                                                   where a value is real (every batch, even
                                                   one whose sizes happen to agree)
  int, float                                       int64, float64 tensors [B] (as default_collate)
  str, bytes, JSON values                          lists of B

A ragged value in a sample (``dataset[i]["tokens"]``) is a :class:`RaggedTensor`: a
torch.Tensor in every way a user sees (ops on it give plain tensors, pickling and torch.save
store a plain tensor), whose type tells torch's ``default_collate`` to make the batch of them
as collate_fields does without ``pad=`` (:func:`collate_ragged`). Importing this module
registers it in torch's ``default_collate_fn_map``; every process that holds a RaggedTensor
has imported it, so a plain ``DataLoader`` collates ragged fields in the main process and in
its workers, fork or spawn.

Images of different sizes cannot be stacked: an (image, label) batch of them is a UsageError
saying so and what to do (:func:`mixed_sizes_message`: crop them as they are read with
``decode=gpufeed.RandomResizedCrop(...)``, or pack them at one size with ``--encode raw
--resize``), from ``get_batch``, ``make_loader`` and :func:`collate`, never a silent list.
The samples ``__getitems__`` hands out of such a read are :class:`MixedSizeTensor` s, whose
type makes torch's ``default_collate`` raise the same error instead of torch's "Trying to
resize storage that is not resizable"; a ``collate_fn`` of the user's that keeps lists takes
them as they are.

The rules every stage uses to look inside a batch live here too: how many samples it holds
(:func:`batch_len`: the loader counts them for resumption, bench and watch for rates), its
tensors (:func:`iter_tensors`) and their bytes (:func:`batch_nbytes`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from gpufeed.errors import UsageError
from gpufeed.pixels import mixed_sizes_message

__all__ = [
    "Batch",
    "FieldBatch",
    "MixedSizeTensor",
    "RaggedTensor",
    "batch_len",
    "batch_nbytes",
    "collate",
    "collate_fields",
    "collate_ragged",
    "is_batch",
    "iter_tensors",
    "mixed_sizes",
    "mixed_sizes_message",
    "new_batch_tensor",
    "pad_fields",
    "plain",
    "ragged",
    "stack",
    "stack_images",
    "to_batch",
    "to_samples",
]


class Batch(NamedTuple):
    """A batch as read; unpacks as DataLoader's ``[samples, labels]`` does.

    Args:
        samples: [B, ...] stacked when the samples' shapes agree, else a list of B tensors.
        labels: int64 [B].
    """

    samples: torch.Tensor | list[torch.Tensor]
    labels: torch.Tensor


def is_batch(data) -> bool:
    """A ``(samples, labels)`` NamedTuple: gpufeed's ``Batch`` or any dataset's look-alike."""
    return isinstance(data, tuple) and getattr(data, "_fields", None) == ("samples", "labels")


def batch_len(batch: Any) -> int | None:
    """Samples in a batch, or None when it does not say.

    A :class:`Batch`: its labels. A tensor or array: its leading dimension (a 0-d one says
    nothing). A dict: its first value. A tuple or list is read as columns when its first
    element is a tensor, an array, a dict or a list (``[images, labels]`` as default_collate
    makes it, ``(captions, labels)``): counted by that element; otherwise (a list of samples,
    each a tuple, a number, a string) by its own length. Duck-typed (``.shape``): asking
    needs no torch import."""
    if is_batch(batch):
        batch = batch.labels
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()), None)
        return None if first is None else batch_len(first)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if getattr(first, "shape", None) is not None or isinstance(first, (Mapping, list)):
            return batch_len(first)
        return len(batch)
    return None


def iter_tensors(obj: Any, arrays: bool = True) -> Iterator[torch.Tensor]:
    """Every tensor in a batch (nested dicts, lists and tuples); numpy arrays too, as tensors
    over the same memory, unless ``arrays=False``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v, arrays)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, arrays)
    elif arrays and isinstance(obj, np.ndarray):
        yield torch.from_numpy(obj)


def batch_nbytes(obj: Any) -> int:
    """Bytes of every tensor (and array) in a batch."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


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
        out = new_batch_tensor((len(samples), *first.shape), first.dtype)
        return torch.stack(samples, out=out)
    return samples


def new_batch_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An empty tensor to write a batch into; in a DataLoader worker, made in shared memory at
    once (as torch's default_collate does): handing the batch to the main process then moves
    a handle instead of copying the batch once more."""
    out = torch.empty(shape, dtype=dtype)
    if get_worker_info() is not None:
        out.share_memory_()
    return out


class RaggedTensor(torch.Tensor):
    """A value of a ragged field in a sample (``dataset[i]["tokens"]``): a torch.Tensor (its
    dtype, shape, indexing, arithmetic) whose type tells torch's default_collate to collate
    the field as :func:`collate_ragged` does. Ops on it give plain tensors, as ops on
    ``nn.Parameter`` do (no ``__torch_function__`` overhead, nothing of it leaks into a
    model's outputs); pickling (torch.save, worker queues) stores a plain tensor, so
    ``torch.load(weights_only=True)`` reads it without gpufeed; ``deepcopy`` keeps the type.
    A transform that makes a new tensor from one gets a plain tensor: :func:`ragged` marks
    it again."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        return plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = copy.deepcopy(plain(self), memo).as_subclass(RaggedTensor)
        return memo[id(self)]

    def __repr__(self, **kwargs) -> str:
        return repr(plain(self))


def ragged(value: torch.Tensor) -> RaggedTensor:
    """``value`` (no copy) as a RaggedTensor: collated by torch's default_collate as a ragged
    field is."""
    return value if type(value) is RaggedTensor else value.as_subclass(RaggedTensor)


def plain(value):
    """A RaggedTensor or MixedSizeTensor as the plain torch.Tensor over the same memory;
    anything else as it is."""
    if type(value) in (RaggedTensor, MixedSizeTensor):
        return value.as_subclass(torch.Tensor)
    return value


def collate_ragged(batch: Sequence[torch.Tensor], *, collate_fn_map=None):
    """torch's default_collate for RaggedTensors (``default_collate_fn_map``): what
    collate_fields gives for a ragged field without ``pad=``: one stacked tensor when every
    shape agrees, else the list of B tensors, plain torch.Tensors either way."""
    out = stack(batch)  # ops on RaggedTensors give plain tensors: only a list needs unwrapping
    return [plain(v) for v in out] if isinstance(out, list) else out


default_collate_fn_map[RaggedTensor] = collate_ragged


class MixedSizeTensor(torch.Tensor):
    """An image of a read whose images differ in size, as ``__getitems__`` hands it out: a
    torch.Tensor in every way a user sees (as :class:`RaggedTensor`), whose type makes
    torch's default_collate raise :func:`mixed_sizes_message` instead of failing to stack
    them deep inside torch (a worker's "Trying to resize storage that is not resizable")."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        return plain(self).__reduce_ex__(protocol)

    def __repr__(self, **kwargs) -> str:
        return repr(plain(self))


def _differ(samples) -> bool:
    """A list of images (tensors of 2 or more dimensions) whose shapes are not all the same:
    what no batch tensor can hold (1-D encoded bytes of decode=False stay a list)."""
    if not isinstance(samples, list) or len(samples) < 2:
        return False
    if not all(isinstance(s, torch.Tensor) and s.dim() >= 2 for s in samples):
        return False
    return any(s.shape != samples[0].shape for s in samples)


def stack_images(samples, where: str | None = None) -> torch.Tensor:
    """The samples of an (image, label) batch stacked; images of different sizes are a
    UsageError saying what to do, never a list handed on in place of the tensor."""
    out = samples if isinstance(samples, torch.Tensor) else stack(samples)
    if _differ(out):
        raise UsageError(mixed_sizes_message([s.shape for s in out], where))
    return out


def mixed_sizes(images: Sequence, where: str | None = None) -> Sequence:
    """The images of one read as a sample path hands them out: as they are, or, when their
    sizes differ (default_collate cannot stack them), as MixedSizeTensors that make it say
    so, naming ``where`` (the dataset)."""
    if not _differ(images):
        return images
    out = [image.as_subclass(MixedSizeTensor) for image in images]
    for image in out:
        image.gpufeed_where = where
    return out


def collate_mixed_sizes(batch: Sequence[torch.Tensor], *, collate_fn_map=None):
    """torch's default_collate for MixedSizeTensors: the error saying what to do."""
    where = getattr(batch[0], "gpufeed_where", None)
    raise UsageError(mixed_sizes_message([s.shape for s in batch], where))


default_collate_fn_map[MixedSizeTensor] = collate_mixed_sizes


def _rows(samples) -> Sequence[torch.Tensor]:
    # views into a stacked batch: splitting costs no copy
    return samples.unbind(0) if isinstance(samples, torch.Tensor) else samples


def to_samples(
    samples, labels: np.ndarray, kept: np.ndarray, count: int, where: str | None = None
) -> list:
    """The ``count`` samples of a read batch, in the order asked for: ``(tensor, int label)``
    (or the field dict of a multi-field pack) at each position in ``kept`` (the positions
    that were read and decoded), ``None`` at the others (skipped as corrupt). ``samples``
    and ``labels`` hold the kept ones, in order."""
    out: list = [None] * count
    rows = mixed_sizes(_rows(samples), where)
    for pos, sample, label in zip(kept.tolist(), rows, labels.tolist(), strict=True):
        out[pos] = sample if isinstance(sample, dict) else (sample, label)
    return out


class FieldBatch(dict):
    """A multi-field batch: field name -> collated values (see the module docstring). A
    dict; ``collate`` passes it through unchanged, as it does a Batch."""


def _pad(values: list[torch.Tensor], fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensors padded with ``fill`` to the largest size in each dimension, and a mask of
    the same shape, True where a value is real."""
    top = torch.tensor([list(v.shape) for v in values], dtype=torch.int64).max(0).values
    shape = (len(values), *top.tolist())
    out = new_batch_tensor(shape, values[0].dtype)
    out.fill_(fill)
    mask = new_batch_tensor(shape, torch.bool)
    mask.zero_()
    for b, v in enumerate(values):
        where = (b, *[slice(0, n) for n in v.shape])
        out[where] = v
        mask[where] = True
    return out, mask


def collate_fields(samples: Sequence[Mapping], pad: Mapping[str, Any] | None = None):
    """Field dicts -> one :class:`FieldBatch` (module docstring). ``pad``: ragged field ->
    its fill value; those fields come out padded with a ``NAME_mask``, others as lists."""
    out = FieldBatch()
    pad = pad or {}
    for name in samples[0] if samples else ():
        values = [s[name] for s in samples]
        first = values[0]
        if isinstance(first, torch.Tensor) and name in pad:
            out[name], out[f"{name}_mask"] = _pad(values, pad[name])
        elif type(first) is RaggedTensor:
            out[name] = collate_ragged(values)
        elif isinstance(first, torch.Tensor):
            out[name] = stack(values)
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            out[name] = torch.as_tensor(values, dtype=torch.int64)
        elif isinstance(first, (float, np.floating)):
            out[name] = torch.as_tensor(values, dtype=torch.float64)
        else:
            out[name] = values
    return out


def pad_fields(batch: FieldBatch, pad: Mapping[str, Any] | None) -> FieldBatch:
    """A FieldBatch whose ragged fields are lists of tensors -> those named in ``pad``
    padded, each followed by its ``NAME_mask`` (as collate_fields pads them)."""
    if not pad:
        return batch
    out = FieldBatch()
    for name, values in batch.items():
        if name in pad and isinstance(values, torch.Tensor):  # every size agreed
            out[name] = values
            out[f"{name}_mask"] = new_batch_tensor(values.shape, torch.bool).fill_(True)
        elif name in pad and values:
            out[name], out[f"{name}_mask"] = _pad(values, pad[name])
        else:
            out[name] = values
    return out


def to_batch(
    samples, labels: np.ndarray, pad: Mapping[str, Any] | None = None, where: str | None = None
):
    """A read batch as one :class:`Batch` (samples stacked; images of different sizes a
    UsageError naming ``where``, the dataset), or a :class:`FieldBatch` for field dicts or a
    FieldBatch read as one (``pad``: see collate_fields)."""
    if isinstance(samples, FieldBatch):
        return pad_fields(samples, pad)
    if isinstance(samples, list) and samples and isinstance(samples[0], dict):
        return collate_fields(samples, pad)
    samples = stack_images(samples, where)
    return Batch(samples, torch.as_tensor(np.asarray(labels, dtype=np.int64)))


def _is_label(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point()
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def collate(data, pad: Mapping[str, Any] | None = None):
    """A ``collate_fn`` that gives :class:`Batch` es.

    Use it with a plain DataLoader over a dataset opened with ``on_error="skip"`` (torch's
    default_collate cannot collate None), and to pad the ragged fields of multi-field packs
    (without ``pad=``, default_collate gives them as this does: see RaggedTensor).

    Args:
        data: what the DataLoader hands a collate_fn: a Batch (or FieldBatch), passed
            through unchanged; a list of ``(tensor, int label)`` samples (skipped ones,
            ``None``, are dropped); a list of field dicts; anything else goes to torch's
            ``default_collate``.
        pad: ragged field -> fill value (see collate_fields); pass it with
            functools.partial.

    Returns:
        A :class:`Batch` for ``(tensor, label)`` samples, a FieldBatch for field dicts,
        else what ``default_collate`` makes of ``data``.
    """
    if is_batch(data) or isinstance(data, FieldBatch):
        return data
    if isinstance(data, list):
        data = [d for d in data if d is not None]
        if data and all(isinstance(d, dict) for d in data):
            return collate_fields(data, pad)
        if data and all(
            isinstance(d, tuple)
            and len(d) == 2
            and isinstance(d[0], torch.Tensor)
            and _is_label(d[1])
            for d in data
        ):
            labels = torch.as_tensor([int(d[1]) for d in data], dtype=torch.int64)
            return Batch(stack_images([d[0] for d in data]), labels)
    return default_collate(data)
