"""What runs in DataLoader workers: each seeded from (seed, epoch, rank, worker id), and the
proxies make_loader's DataLoader reads through (the epoch kept in step in persistent workers,
whole batches from the dataset's fast path)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from gpufeed.pagecache.copy import set_copy_threads

__all__ = [
    "BatchedStream",
    "EpochSync",
    "IterProxy",
    "MapProxy",
    "WorkerInit",
    "loader_dataset",
    "seed_everything",
    "worker_seed",
]


def worker_seed(seed: int, epoch: int, rank: int, worker_id: int) -> int:
    """The 64-bit seed of one worker in one epoch: distinct per (seed, epoch, rank, worker)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(rank), int(worker_id)])
    a, b = state.generate_state(2, dtype=np.uint32)
    return (int(a) << 32) | int(b)


def seed_everything(s: int) -> None:
    random.seed(s)
    np.random.seed(s % (1 << 32))
    torch.manual_seed(s)


class WorkerInit:
    """Seeds python/numpy/torch in each worker, has it copy batches on one thread
    (pagecache.copy), then runs the user's ``worker_init_fn``.
    A class rather than a closure so spawn can pickle it."""

    def __init__(self, seed, epoch_value, rank, user_fn):
        self.seed, self.epoch_value, self.rank, self.user_fn = seed, epoch_value, rank, user_fn

    def __call__(self, worker_id: int) -> None:
        seed_everything(worker_seed(self.seed, self.epoch_value.value, self.rank, worker_id))
        set_copy_threads(1)  # the workers are the parallelism: each copies on its own thread
        if self.user_fn is not None:
            self.user_fn(worker_id)


class EpochSync:
    """Mixin for the dataset proxies: persistent workers outlive epochs, so the epoch travels
    through a shared value and each worker reseeds (and calls ``set_epoch``) when it changes."""

    def _sync(self) -> int | None:
        if self._epoch_value is None:  # in-process: the loader sets the epoch itself
            return None
        epoch = self._epoch_value.value
        if epoch != self._seen_epoch:
            self._seen_epoch = epoch
            info = torch.utils.data.get_worker_info()
            if info is not None:
                seed_everything(worker_seed(self._seed, epoch, self._rank, info.id))
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
        return epoch


class MapProxy(EpochSync, Dataset):
    """What make_loader's DataLoader reads a map-style dataset through: keeps the epoch in
    step in workers and, on the fast path (``batched``), answers the DataLoader's batched
    fetch with the dataset's ``get_batch`` (a ready Batch that the collate passes through)
    instead of its list of samples."""

    def __init__(self, dataset, epoch_value, seed, rank, batched: bool):
        self.dataset, self._epoch_value, self._seed, self._rank = dataset, epoch_value, seed, rank
        self._seen_epoch = epoch_value.value if epoch_value is not None else None
        self.batched = batched

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self._sync()
        return self.dataset[i]

    def __getitems__(self, indices):
        self._sync()
        if self.batched:
            return self.dataset.get_batch(indices)
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]


class BatchedStream(IterableDataset):
    """An iterable dataset that makes its own batches (``iter_batches``, as gpufeed's tar
    stream does: a whole batch per read, shuffle and decode), for a DataLoader with
    ``batch_size=None``."""

    def __init__(self, dataset, batch_size: int, drop_last: bool):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last

    def __iter__(self):
        return iter(self.dataset.iter_batches(self.batch_size, self.drop_last))


def loader_dataset(dataset, batch_size: int, drop_last: bool, batched: bool):
    """(dataset, batch_size) for the DataLoader over an iterable dataset: batches made by the
    dataset where it can (then the DataLoader batches nothing), else the DataLoader's."""
    if batched:
        return BatchedStream(dataset, batch_size, drop_last), None
    return dataset, batch_size


class IterProxy(EpochSync, IterableDataset):
    def __init__(self, dataset, epoch_value, seed, rank):
        self.dataset, self._epoch_value, self._seed, self._rank = dataset, epoch_value, seed, rank
        self._seen_epoch = None  # always sync: set_epoch before every pass

    def __iter__(self):
        self._sync()
        self._seen_epoch = None
        return iter(self.dataset)

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        self._sync()
        self._seen_epoch = None
        return self.dataset.iter_batches(batch_size, drop_last)
