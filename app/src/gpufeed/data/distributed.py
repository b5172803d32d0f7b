"""Rank/world sharding for torchrun: a stream's samples split by node and worker into equal
shares (split_samples), shard lists split whole (split_shards), block-shuffled distributed
sampling for map-style datasets.

Every function here reads the process's place in the job the same way
(:func:`rank_and_world`): ``torch.distributed`` when it is initialised, else the ``RANK`` and
``WORLD_SIZE`` variables that torchrun exports, else a single process (0 of 1).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence, Sized
from typing import TypeVar

import numpy as np
from torch.utils.data import Sampler

from gpufeed.data.order import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUFFER_BLOCKS,
    block_shuffle_order,
    rank_slice,
    remaining_after,
)
from gpufeed.errors import ShardSplitWarning

T = TypeVar("T")

__all__ = [
    "DistributedBlockSampler",
    "rank_and_world",
    "rank_counts_by_shards",
    "shard_rng",
    "split_samples",
    "split_shards",
    "worker_and_count",
]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; torchrun sets it to the "
            f"process's {name.lower()}, unset it or fix the launcher"
        ) from None


def rank_and_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the explicit values if given, else ``torch.distributed`` when
    initialised, else env ``RANK``/``WORLD_SIZE``, else ``(0, 1)``."""
    if rank is None or world_size is None:
        d_rank, d_world = None, None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                d_rank, d_world = dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover - torch always ships distributed on Linux
            pass
        if d_rank is None:
            d_rank, d_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if rank is None:
            rank = d_rank if d_rank is not None else 0
        if world_size is None:
            world_size = d_world if d_world is not None else 1
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


def worker_and_count(
    worker_id: int | None = None, num_workers: int | None = None
) -> tuple[int, int]:
    """``(worker_id, num_workers)`` of the current DataLoader worker; ``(0, 1)`` in the main
    process."""
    if worker_id is None or num_workers is None:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if worker_id is None:
            worker_id = info.id if info is not None else 0
        if num_workers is None:
            num_workers = info.num_workers if info is not None else 1
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} is not in [0, num_workers={num_workers})")
    return worker_id, num_workers


def shard_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator all ranks build identically for ``(seed, epoch)``.

    Seeded from the pair, not from ``seed + epoch``, so ``(1, 0)`` and ``(0, 1)`` differ.
    """
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([int(seed), int(epoch)])


def split_shards(
    shards: Sequence[T],
    *,
    seed: int,
    epoch: int,
    rank: int | None = None,
    world_size: int | None = None,
    worker_id: int | None = None,
    num_workers: int | None = None,
    shuffle: bool = True,
) -> list[T]:
    """This (rank, DataLoader worker)'s share of ``shards`` for ``epoch``.

    All ranks shuffle the full list the same way (seeded by ``(seed, epoch)``), then rank ``r``
    takes every ``world_size``-th shard starting at ``r``, and worker ``w`` of that rank takes
    every ``num_workers``-th shard of the rank's share starting at ``w``. Over all ranks and
    workers each shard is read exactly once per epoch, and the assignment changes each epoch.

    Rank and world come from :func:`rank_and_world`, the worker from
    ``torch.utils.data.get_worker_info()``; pass them explicitly to override.

    Too few shards: splitting is by whole shards, never by samples inside a shard, so a shard
    is read sequentially by one reader (that is what makes tar shards fast).

    - ``len(shards) < world_size`` raises ``ValueError``: some rank would get no data at all
      and DDP would hang waiting for it at the first collective. Repack into more shards.
    - ``len(shards) < world_size * num_workers`` warns (:class:`ShardSplitWarning`) and the
      surplus workers get an empty list: they finish at once, the result is still correct,
      but only ``len(shards)`` readers work. Repack into more shards or use fewer workers.
    - ``len(shards)`` not a multiple of ``world_size``, or shards of different sizes: ranks
      get different sample counts. Every sample is still read once, but a rank that runs out
      first leaves the others waiting at their next collective: DDP hangs unless the training
      loop handles it (``Join``). That is why gpufeed's tar stream splits samples by default
      (:func:`split_samples`) and uses this split only with ``split="shards"``.
    """
    shards = list(shards)
    rank, world_size = rank_and_world(rank, world_size)
    worker_id, num_workers = worker_and_count(worker_id, num_workers)
    n = len(shards)
    if n < world_size:
        raise ValueError(
            f"{n} shard(s) cannot be split over {world_size} ranks: a rank without data stalls "
            f"distributed training; repack into at least {world_size} shards "
            f"(ideally a multiple of {world_size} x the DataLoader workers)"
        )
    if n < world_size * num_workers and worker_id == 0 and rank == 0:
        warnings.warn(
            f"{n} shard(s) for {world_size} rank(s) x {num_workers} DataLoader workers: "
            f"{world_size * num_workers - n} worker(s) get no shard and idle; repack into at "
            f"least {world_size * num_workers} shards or use num_workers="
            f"{max(1, n // world_size)}",
            ShardSplitWarning,
            stacklevel=2,
        )
    shards = [shards[i] for i in _shard_order(n, seed, epoch, shuffle)]
    mine = shards[rank::world_size]
    return mine[worker_id::num_workers]


def split_samples(
    sizes: Sequence[int],
    *,
    seed: int,
    epoch: int,
    rank: int | None = None,
    world_size: int | None = None,
    worker_id: int | None = None,
    num_workers: int | None = None,
    shuffle: bool = True,
) -> list[tuple[int, int, int]]:
    """This (rank, DataLoader worker)'s runs of samples for ``epoch``, in reading order:
    ``(shard, first, stop)`` reads positions ``first..stop-1`` of shard ``shard``, which holds
    ``sizes[shard]`` samples.

    All ranks order the shards alike (shuffled by ``(seed, epoch)`` as :func:`split_shards`
    does) and see their samples as one sequence of ``n = sum(sizes)``. Rank ``r`` reads the
    ``r``-th contiguous ``n // world_size`` of it; the last ``n % world_size`` (fewer than the
    ranks) are not read that epoch (others each epoch when the shards are shuffled). Worker
    ``w`` of the rank reads the ``w``-th contiguous share of the rank's, the first
    ``(n // world_size) % num_workers`` workers one sample more. A worker's count depends on
    its number alone, so every rank yields as many samples, and batches, from each worker:
    DDP never waits on a rank that ran out. Shares are contiguous, so reads stay
    sequential and at most ``world_size * num_workers - 1`` shards are split between two
    readers.

    Fewer samples than ranks raises ``ValueError`` (every rank would read nothing).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    rank, world_size = rank_and_world(rank, world_size)
    worker_id, num_workers = worker_and_count(worker_id, num_workers)
    n = int(sizes.sum())
    if 0 < n < world_size:
        raise ValueError(
            f"{n} sample(s) cannot be split over {world_size} ranks: every rank would read "
            f"none; use fewer ranks or a larger dataset"
        )
    lo, hi = _worker_share(n // world_size, worker_id, num_workers)
    base = rank * (n // world_size)
    return _runs_in(sizes, _shard_order(len(sizes), seed, epoch, shuffle), base + lo, base + hi)


def _worker_share(count: int, worker_id: int, num_workers: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of worker ``worker_id``'s contiguous share of ``count``."""
    each, extra = divmod(count, num_workers)
    lo = worker_id * each + min(worker_id, extra)
    return lo, lo + each + (worker_id < extra)


def _shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order every rank reads ``n`` shards in for ``epoch``."""
    return shard_rng(seed, epoch).permutation(n) if shuffle else np.arange(n)


def _runs_in(sizes: np.ndarray, order: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(shard, first, stop)`` covering positions ``[lo, hi)`` of the shards' samples
    concatenated in ``order``."""
    ordered = sizes[order]
    ends = np.cumsum(ordered)
    starts = ends - ordered
    hit = np.flatnonzero((starts < hi) & (ends > lo) & (ordered > 0))
    return [
        (
            int(order[k]),
            max(lo, int(starts[k])) - int(starts[k]),
            min(hi, int(ends[k])) - int(starts[k]),
        )
        for k in hit.tolist()
    ]


def rank_counts_by_shards(
    sizes: Sequence[int], *, seed: int, epoch: int, world_size: int, shuffle: bool = True
) -> list[int]:
    """The samples each rank reads in ``epoch`` when ranks get whole shards
    (:func:`split_shards`): unequal ones leave DDP waiting on the rank that ran out."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = _shard_order(len(sizes), seed, epoch, shuffle)
    return [int(sizes[order[r::world_size]].sum()) for r in range(world_size)]


class DistributedBlockSampler(Sampler[int]):
    """``DistributedSampler`` with block-shuffled order, for map-style datasets under torchrun.

    All ranks compute the same global block-shuffled permutation of ``range(dataset_len)``
    from ``(seed, epoch)`` (see :func:`gpufeed.data.order.block_shuffle_order`) and rank ``r``
    takes the ``r``-th contiguous slice of it. Contiguous slices, rather than
    ``DistributedSampler``'s every-``world``-th index, keep each rank's reads in the same long
    runs that make block shuffle fast.

    When ``dataset_len`` is not divisible by ``num_replicas``: with ``drop_last=False`` the
    permutation is padded by repeating its first indices until every rank has
    ``ceil(len / world)`` samples (so a few samples are seen twice per epoch, exactly like
    ``DistributedSampler``); with ``drop_last=True`` the tail is dropped so every rank has
    ``len // world`` and a few samples are not seen that epoch (different ones each epoch).
    Either way every rank yields the same number of samples, so DDP never waits on a rank
    that ran out.

    Call :meth:`set_epoch` each epoch (``make_loader`` does). :meth:`iter_from` resumes
    mid-epoch.
    """

    def __init__(
        self,
        dataset_len: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
        epoch: int = 0,
    ) -> None:
        self.dataset_len = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        self.rank, self.num_replicas = rank_and_world(rank, num_replicas)
        self.block_size = int(block_size)
        self.buffer_blocks = int(buffer_blocks)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = int(epoch)
        if drop_last:
            self.num_samples = self.dataset_len // self.num_replicas
        else:
            self.num_samples = -(-self.dataset_len // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        if self.dataset_len > 0 and self.num_samples == 0:
            raise ValueError(
                f"{self.dataset_len} samples with drop_last=True over {self.num_replicas} ranks "
                f"leaves every rank empty; use drop_last=False or a larger dataset"
            )
        self._elastic: tuple[int, np.ndarray] | None = None  # (epoch, this rank's share)
        self.order()  # validate now

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_order(self) -> np.ndarray:
        """The padded (or truncated) permutation shared by all ranks, ``total_size`` long."""
        n = self.dataset_len
        if self.shuffle:
            order = block_shuffle_order(
                n,
                block_size=self.block_size,
                buffer_blocks=self.buffer_blocks,
                seed=self.seed,
                epoch=self.epoch,
            )
        else:
            order = np.arange(n, dtype=np.int64)
        if self.total_size > n and n > 0:
            reps = -(-(self.total_size - n) // n)
            order = np.concatenate([order, np.tile(order, reps)[: self.total_size - n]])
        return order[: self.total_size]

    def order(self) -> np.ndarray:
        if self._elastic is not None and self._elastic[0] == self.epoch:
            return self._elastic[1]
        start = self.rank * self.num_samples
        return self.global_order()[start : start + self.num_samples]

    def resume_elastic(self, epoch: int, world: int, seen: int) -> None:
        """Make ``epoch`` deliver what a run with ``world`` ranks had not handed out when each
        of them had handed out ``seen`` samples (ranks step in lockstep), split over this
        sampler's ranks: every sample of the epoch exactly once over the two runs (but the
        padding of uneven splits). Later epochs are as usual."""
        old = DistributedBlockSampler(
            self.dataset_len, world, 0, self.block_size, self.seed, self.shuffle,
            self.drop_last, self.buffer_blocks, epoch,
        )  # fmt: skip
        rest = remaining_after(old.global_order(), world, old.num_samples, int(seen))
        self._elastic = (int(epoch), rank_slice(rest, self.rank, self.num_replicas, self.drop_last))

    def iter_from(self, start: int) -> Iterator[int]:
        return iter(self.order()[start:].tolist())

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def __len__(self) -> int:
        return len(self.order()) if self._elastic is not None else self.num_samples
