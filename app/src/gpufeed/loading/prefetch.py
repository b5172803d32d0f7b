"""``DevicePrefetcher``: overlap the host-to-GPU copy of the next batch with compute on this one.

While the model runs batch ``i`` on the current (compute) stream, batch ``i+1`` is copied from
pinned host memory on a side stream (``non_blocking=True``) and converted there (uint8 ->
float, scaling, normalisation, channels_last), so the compute stream never waits for a copy
it could have overlapped. Before batch ``i+1`` is handed out the compute stream waits on the
side stream (``wait_stream``), and every tensor is marked as used by the compute stream
(``record_stream``) so the caching allocator does not reuse its memory for the side stream's
next copy while the model still reads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gpufeed.batch import batch_len, is_batch, iter_tensors
from gpufeed.data.decoders import RandomResizedCrop
from gpufeed.errors import UsageError
from gpufeed.loading.device_decode import DeviceDecode, decode_device

__all__ = ["DevicePrefetcher", "resolve_device"]


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``None``/``"auto"``: the current CUDA device, else the CPU. Anything else is a device
    that must be there (a clear :class:`~gpufeed.errors.UsageError` when it is not)."""
    cuda = torch.cuda.is_available()
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        # an int is a CUDA device index, as torch.cuda takes it (torch.device(0) asks for the
        # "current accelerator", an error of its own wording without one)
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"device {device!r} is not a device torch knows: {e}") from None
    if dev.type != "cuda":
        return dev
    if not cuda:
        raise UsageError(
            f"device {device!r} was asked for, but torch sees no CUDA device (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); pass device=None or "
            f"'auto' to fall back to the CPU, or check the driver and --gpus with gpufeed doctor"
        )
    count = torch.cuda.device_count()
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= count:
        raise UsageError(f"device {device!r}: torch sees {count} CUDA device(s), 0..{count - 1}")
    return dev


class DevicePrefetcher:
    """Iterate ``loader``'s batches on ``device``, one batch copied ahead.

    Batches may be gpufeed ``Batch`` namedtuples ``(samples, labels)``, other namedtuples,
    tuples, lists, dicts (nested) of tensors; non-tensors pass through unchanged.

    Which tensors are converted: the ``samples`` of a ``Batch`` (each element when it is a
    list of differently shaped tensors); in any other container, every uint8 tensor. Labels
    and other integer tensors keep their dtype. A converted tensor

    1. becomes ``dtype`` (None: keeps its dtype); uint8 input is also divided by 255 when
       ``scale=True``, giving [0, 1] like torchvision's ``ToTensor``;
    2. is normalised with ``normalize=(mean, std)``, per channel along ``channel_dim``
       (in the [0, 1] units of step 1 for uint8 input, like torchvision's ``Normalize``);
    3. is made ``channels_last`` when asked and 4-D.

    ``state_dict()`` is the loader's, minus the batch held in look-ahead: resuming from it
    does not skip the batch the prefetcher had copied but not yet handed out.

    Args:
        loader: any iterable of batches (a ``make_loader`` loader, a DataLoader); its
            ``set_epoch``, ``state_dict`` and ``load_state_dict`` are passed through.
        device: ``None`` or ``"auto"`` is the current CUDA device when torch sees one, else
            the CPU: there batches pass through with no copy and no look-ahead, and the same
            conversions are applied on the CPU, so code written for the GPU runs unchanged
            (and tests can check the conversions). An explicit device (a torch.device, a
            str, a CUDA index) is used as given: a training job meant for the GPU does not
            quietly run on the CPU.
        normalize: ``(mean, std)``, one value per channel (step 2).
        channels_last: make converted 4-D tensors channels_last (step 3).
        dtype: what converted tensors become (step 1); None keeps their dtype.
        non_blocking: copy asynchronously from pinned memory (a warning says when batches
            are not pinned, so the copy cannot overlap compute).
        scale: divide uint8 input by 255 (step 1).
        channel_dim: the channel dimension ``normalize`` applies along.
        decode: a :class:`~gpufeed.RandomResizedCrop` for a loader over encoded images
            (``open_dataset(path, decode=False)``): each batch is decoded, cropped, resized
            and flipped here, before the conversions.
        decode_on: ``"auto"`` decodes on the GPU (``torchvision.io.decode_jpeg(list,
            device="cuda")``, on the side stream) when ``device`` is a CUDA device, else on
            the CPU with the crop's own backend; ``"cuda"`` insists, ``"cpu"`` keeps
            decoding on the CPU. See :mod:`gpufeed.loading.device_decode`.

    Raises:
        UsageError: ``device`` is not there (``"cuda"`` on a machine without CUDA,
            ``"cuda:3"`` with two GPUs; the message names what torch sees), or
            ``decode_on="cuda"`` cannot decode there (the message says why).
        ValueError: ``normalize``'s mean and std differ in length, a std is zero, or
            ``decode_on`` is not "auto", "cuda" or "cpu".
    """

    def __init__(
        self,
        loader: Iterable,
        device: torch.device | str | int | None = None,
        *,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        channels_last: bool = False,
        dtype: torch.dtype | None = torch.float32,
        non_blocking: bool = True,
        scale: bool = True,
        channel_dim: int = 1,
        decode: RandomResizedCrop | None = None,
        decode_on: str = "auto",
    ) -> None:
        self.loader = loader
        self.device = resolve_device(device)
        # encoded batches (open_dataset(decode=False)) decoded here: on the GPU when there is
        # one (loading/device_decode.py), else on the CPU with the crop's own backend
        self.decode = None
        if decode is not None:
            self.decode = DeviceDecode(decode, decode_device(self.device, decode_on))
        self.dtype = dtype
        self.channels_last = channels_last
        self.non_blocking = non_blocking
        self.scale = scale
        self.channel_dim = channel_dim
        self.normalize = None
        if normalize is not None:
            mean, std = normalize
            mean_t = torch.as_tensor(mean, dtype=torch.float32).flatten()
            std_t = torch.as_tensor(std, dtype=torch.float32).flatten()
            if mean_t.numel() != std_t.numel():
                raise ValueError(f"normalize mean has {mean_t.numel()} values, std {std_t.numel()}")
            if (std_t == 0).any():
                raise ValueError(f"normalize std must be non-zero, got {std_t.tolist()}")
            self.normalize = (mean_t, std_t)
        self._norm_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_len = 0
        self._pending = False
        self._check_pinned = True

    @property
    def uses_cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    # -- conversions (device-agnostic: run on the side stream on CUDA, inline on the CPU)
    def _norm_params(self, x: torch.Tensor, channel_dim: int):
        key = (x.device, x.dtype, x.dim(), channel_dim)
        if key not in self._norm_cache:
            mean, std = self.normalize
            shape = [1] * x.dim()
            shape[channel_dim] = -1
            self._norm_cache[key] = (
                mean.to(x.device, x.dtype).view(shape),
                (1.0 / std).to(x.device, x.dtype).view(shape),
            )
        return self._norm_cache[key]

    def _convert(self, x: torch.Tensor, unbatched: bool = False) -> torch.Tensor:
        channel_dim = self.channel_dim - 1 if unbatched else self.channel_dim
        was_uint8 = x.dtype == torch.uint8
        if self.dtype is not None and x.dtype != self.dtype:
            x = x.to(self.dtype)
        if was_uint8 and self.scale and x.is_floating_point():
            x = x.mul(1.0 / 255.0) if x.dtype != torch.float64 else x / 255.0
        if self.normalize is not None and x.is_floating_point():
            channels = self.normalize[0].numel()
            if x.dim() <= channel_dim or x.shape[channel_dim] != channels:
                raise ValueError(
                    f"normalize has {channels} channel values but the samples are "
                    f"{tuple(x.shape)} (channel dim {channel_dim})"
                )
            mean, inv_std = self._norm_params(x, channel_dim)
            x = (x - mean).mul_(inv_std)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _move(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device:
            x = x.to(self.device, non_blocking=self.non_blocking)
        return x

    def _apply(self, obj: Any, sample: bool | None = None) -> Any:
        """Move every tensor; convert the sample tensors (see the class docstring)."""
        if isinstance(obj, torch.Tensor):
            x = self._move(obj)
            convert = sample if sample is not None else obj.dtype == torch.uint8
            return self._convert(x) if convert else x
        if is_batch(obj):
            samples = obj.samples
            if isinstance(samples, list):  # differently shaped samples, one tensor each
                samples = [
                    self._convert(self._move(x), unbatched=True)
                    if isinstance(x, torch.Tensor)
                    else x
                    for x in samples
                ]
            else:
                samples = self._apply(samples, True)
            return type(obj)(samples, self._apply(obj.labels, False))
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self._apply(v, sample) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._apply(v, sample) for v in obj)
        if isinstance(obj, Mapping):
            return type(obj)({k: self._apply(v, sample) for k, v in obj.items()})
        return obj

    def _decoded(self, batch: Any) -> Any:
        return batch if self.decode is None else self.decode(batch)

    # -- iteration
    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    def state_dict(self) -> dict:
        state = dict(self.loader.state_dict())  # type: ignore[attr-defined]
        if self._pending:
            state["samples_seen"] = max(0, state["samples_seen"] - self._pending_len)
            state["batches_seen"] = max(0, state["batches_seen"] - 1)
        return state

    def load_state_dict(self, state: Mapping) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator:
        """One pass over the loader.

        Yields:
            The loader's batches, converted, on ``device`` (the next one copied on a side
            stream while this one is used).
        """
        if not self.uses_cuda:
            for batch in self.loader:
                yield self._apply(self._decoded(batch))
            return
        yield from self._iter_cuda()

    def _iter_cuda(self) -> Iterator:
        side = torch.cuda.Stream(device=self.device)
        it = iter(self.loader)

        def preload():
            try:
                host = next(it)
            except StopIteration:
                return None
            self._pending_len = batch_len(host) or 0
            tensors = list(iter_tensors(host, arrays=False))
            if any(t.is_cuda for t in tensors):
                # already on a GPU, written by the caller's stream: convert after that work
                side.wait_stream(torch.cuda.current_stream(self.device))
            if self._check_pinned:
                self._check_pinned = False
                if self.non_blocking and any(not t.is_cuda and not t.is_pinned() for t in tensors):
                    warnings.warn(
                        "batches are not in pinned memory, so the host-to-GPU copy cannot "
                        "overlap compute; build the loader with gpufeed.make_loader "
                        "(pin_memory='auto') or DataLoader(pin_memory=True)",
                        stacklevel=3,
                    )
            with torch.cuda.stream(side):
                return self._apply(self._decoded(host))

        # No device context around the loop: it would stay switched while the caller's loop
        # body runs. torch.cuda.stream(side) switches to side's device for the copy only.
        try:
            nxt = preload()
            self._pending = nxt is not None
            while nxt is not None:
                # the caller's stream now (asked each time: the loop body may switch streams)
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(side)
                batch = nxt
                _record_stream(batch, compute)
                self._pending = False
                nxt = preload()
                self._pending = nxt is not None
                yield batch
        finally:
            self._pending = False


def _record_stream(obj: Any, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator these tensors are in use on ``stream`` (the compute
    stream), not only on the side stream that allocated them."""
    for t in iter_tensors(obj, arrays=False):
        if t.is_cuda:
            t.record_stream(stream)
