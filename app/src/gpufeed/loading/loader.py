"""``GpufeedLoader``: the iterable make_loader returns. Epochs that advance by themselves,
and mid-epoch resumption (``state_dict``/``load_state_dict``) that yields exactly the samples
not yet handed out."""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from gpufeed.batch import batch_len
from gpufeed.data.samplers import BlockShuffleSampler, SortedBatchSampler
from gpufeed.loading.plan import LoaderPlan
from gpufeed.loading.workers import IterProxy, MapProxy, WorkerInit, loader_dataset

__all__ = ["GpufeedLoader"]

_STATE_FORMAT = "gpufeed.loader/1"


class GpufeedLoader:
    """Iterable over batches, built by :func:`make_loader`.

    Epochs: ``set_epoch(e)`` picks the order of the next pass; a pass that runs to the end
    advances the epoch by one by itself, so forgetting ``set_epoch`` does not repeat the same
    order. A pass abandoned midway (``break``) leaves the epoch where it was.

    Resumption: ``state_dict()`` records the epoch, the seed and how many samples this rank
    has handed to *you* (counted as each batch is yielded; what workers prefetched is not
    counted). After ``load_state_dict(state)`` the next pass yields exactly the samples of
    that epoch not yet yielded, then epochs continue as usual. Each rank saves and restores
    its own state. Map-style datasets in gpufeed's order skip to the position directly;
    iterable datasets and your own ``batch_sampler`` replay: the skipped batches are read
    again and dropped (correct when the order is a function of the epoch, as gpufeed's tar
    shards are). Exact only with ``in_order=True``.
    """

    def __init__(
        self,
        dataset,
        *,
        batch_size: int,
        plan: LoaderPlan,
        batch_sampler,
        collate_fn: Callable,
        drop_last: bool,
        seed: int,
        rank: int,
        world_size: int,
        worker_init_fn: Callable | None,
        timeout: float,
        batched: bool = False,
        dataloader_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.plan = plan
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.batched = batched
        self._user_worker_init = worker_init_fn
        self._timeout = timeout
        self._dataloader_options = dict(dataloader_options or {})
        self.epoch = 0
        self._samples_seen = 0
        self._batches_seen = 0
        self._resume: tuple[int, int] | None = None  # (samples, batches) to skip next pass
        self._dl: DataLoader | None = None
        self._epoch_value = None

    # -- properties users reach for
    @property
    def num_workers(self) -> int:
        return self.plan.num_workers

    @property
    def pin_memory(self) -> bool:
        return self.plan.pin_memory

    @property
    def prefetch_factor(self) -> int | None:
        return self.plan.prefetch_factor

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def _seeks(self) -> bool:
        """Resumes by starting its own sampler mid-epoch (else: replays batches)."""
        return isinstance(self.batch_sampler, SortedBatchSampler)

    @property
    def dataloader(self) -> DataLoader:
        """The underlying ``torch.utils.data.DataLoader`` (built on first use)."""
        if self._dl is None:
            self._dl = self._build()
        return self._dl

    def _build(self) -> DataLoader:
        p = self.plan
        kw: dict[str, Any] = dict(
            num_workers=p.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=p.pin_memory,
            timeout=self._timeout,
            **self._dataloader_options,
        )
        if p.num_workers > 0:
            ctx = multiprocessing.get_context(p.multiprocessing_context)
            self._epoch_value = ctx.RawValue("q", self.epoch)
            kw.update(
                multiprocessing_context=ctx,
                persistent_workers=p.persistent_workers,
                prefetch_factor=p.prefetch_factor,
                worker_init_fn=WorkerInit(
                    self.seed, self._epoch_value, self.rank, self._user_worker_init
                ),
            )
        elif self._user_worker_init is not None:
            warnings.warn(
                "worker_init_fn is not called: loading in-process (0 workers)", stacklevel=3
            )
        if self.iterable:
            dataset = self.dataset
            if self._epoch_value is not None:
                dataset = IterProxy(dataset, self._epoch_value, self.seed, self.rank)
            dataset, size = loader_dataset(dataset, self.batch_size, self.drop_last, self.batched)
            return DataLoader(dataset, batch_size=size, drop_last=self.drop_last, **kw)
        proxy = MapProxy(self.dataset, self._epoch_value, self.seed, self.rank, self.batched)
        return DataLoader(proxy, batch_sampler=self.batch_sampler, **kw)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next pass (and drop a pending resume of another
        epoch)."""
        epoch = int(epoch)
        if self._resume is not None and epoch != self.epoch:
            self._resume = None
        self.epoch = epoch

    def samples_per_epoch(self) -> int | None:
        """Samples this rank yields in a full epoch (None where unknown: iterable datasets
        without len, your own batch_sampler)."""
        if self._seeks:
            return self.batch_sampler.samples_per_epoch()
        if self.batch_sampler is not None:
            return None
        try:
            n = len(self.dataset)
        except TypeError:
            return None
        return n - n % self.batch_size if self.drop_last else n

    def source_counts(self) -> dict[str, int] | None:
        """Draws from each source of a mixture (gpufeed.mix) that this rank's order holds in
        the current epoch: name -> count. None for other datasets or an order of your own."""
        counts = getattr(self.dataset, "counts", None)
        sampler = getattr(self.batch_sampler, "sampler", None)
        if not callable(counts) or not callable(getattr(sampler, "order", None)):
            return None
        sampler.set_epoch(self.epoch)
        return counts(sampler.order())

    def __len__(self) -> int:
        """Batches in a full epoch on this rank."""
        if self.batch_sampler is not None and not self._seeks:
            return len(self.batch_sampler)
        n = self.samples_per_epoch()
        if n is None:
            raise TypeError(f"{type(self.dataset).__name__} has no len(); neither has its loader")
        return -(-n // self.batch_size)

    def _prepare_pass(self) -> tuple[int, int]:
        skip_samples, skip_batches = self._resume or (0, 0)
        self._resume = None
        if self._seeks:
            self.batch_sampler.set_epoch(self.epoch)
            self.batch_sampler.start = skip_samples
            skip_batches = 0  # the sampler starts at the right index; nothing to replay
        elif self.batch_sampler is not None:
            # your batch sampler, or a DistributedSampler inside torch's BatchSampler
            for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
                if callable(getattr(obj, "set_epoch", None)):
                    obj.set_epoch(self.epoch)
        # in-process this is the copy that is read (a mixture's draws, a stream's shard
        # split); with workers it keeps len() in step; workers get it via the proxies
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        if self._epoch_value is not None:
            self._epoch_value.value = self.epoch
        return skip_samples, skip_batches

    def __iter__(self) -> Iterator:
        dl = self.dataloader
        skip_samples, replay = self._prepare_pass()
        self._samples_seen = skip_samples
        # gpufeed's sampler starts at the right index; a replay counts its batches up again
        self._batches_seen = -(-skip_samples // self.batch_size) if self._seeks else 0
        total = self.samples_per_epoch()
        for batch in dl:
            if replay > 0:
                replay -= 1
                self._batches_seen += 1
                continue
            self._batches_seen += 1
            if self._seeks and total is not None:
                self._samples_seen = min(total, self._samples_seen + self.batch_size)
            else:
                self._samples_seen += batch_len(batch) or self.batch_size
            yield batch
        self.epoch += 1
        self._samples_seen = self._batches_seen = 0

    # -- resumption
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "epoch": self.epoch,
            "seed": self.seed,
            "samples_seen": self._samples_seen,
            "batches_seen": self._batches_seen,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples_per_epoch": self.samples_per_epoch(),
            "iterable": self.iterable,
            "dataset_len": None if self.iterable else len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"not a gpufeed loader state (format {state.get('format')!r}, expected "
                f"{_STATE_FORMAT!r})"
            )
        mine = self.state_dict()
        if state["world_size"] != mine["world_size"]:
            self._resume_elastic(state, mine)
            return
        # An iterable dataset's length may change by epoch (tar shards split over ranks), so
        # only a map-style one is checked for the same length.
        checked = ("seed", "world_size", "rank", "iterable")
        if not self.iterable:
            checked += ("samples_per_epoch",)
        for key in checked:
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r} but this loader has "
                    f"{key}={mine[key]!r}; the order cannot be resumed exactly. Build the "
                    f"loader with the same dataset, seed and world size (each rank loads "
                    f"its own state)"
                )
        if not self._seeks and state["batch_size"] != self.batch_size:
            raise ValueError(
                f"this loader resumes by replaying batches: saved batch_size "
                f"{state['batch_size']}, this loader {self.batch_size}"
            )
        self.epoch = int(state["epoch"])
        self._samples_seen = int(state["samples_seen"])
        self._batches_seen = int(state["batches_seen"])
        self._resume = (self._samples_seen, self._batches_seen)

    def _resume_elastic(self, state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
        """A state saved with another world size (nodes lost or added): this rank's share of
        what that run had not handed out (DistributedBlockSampler.resume_elastic)."""
        sampler = getattr(self.batch_sampler, "sampler", None)
        if not self._seeks or not hasattr(sampler, "resume_elastic"):
            raise ValueError(
                f"loader state was saved with world_size={state['world_size']}, this loader has "
                f"{mine['world_size']}: resuming with another world size needs a map-style "
                "dataset in gpufeed's order (open_dataset's default for every format, not "
                "map_style=False; no sampler of your own)"
            )
        for key in ("seed", "dataset_len"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={mine[key]!r}: not the same dataset and order; cannot resume"
                )
        epoch, world, seen = int(state["epoch"]), int(state["world_size"]), state["samples_seen"]
        if isinstance(sampler, BlockShuffleSampler):  # one process going on from N ranks
            sampler.resume_elastic(epoch, world, seen, drop_last=self.batch_sampler.drop_last)
        else:
            sampler.resume_elastic(epoch, world, seen)
        self.epoch = int(state["epoch"])
        self._samples_seen = self._batches_seen = 0
        self._resume = (0, 0)

    def __repr__(self) -> str:
        return (
            f"GpufeedLoader(batch_size={self.batch_size}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.world_size}, plan=<{self.plan.reason}>)"
        )
