"""Samplers over the block-shuffled order (gpufeed.data.order): random-order epochs that
still read storage in long runs, and batches sorted inside for cheaper reads.

A uniformly random permutation makes every read a seek. FFCV's quasi-random order instead
shuffles *blocks* of neighbouring indices, then shuffles the indices of a few consecutive
blocks together (the "buffer"), so each stretch of the epoch touches only ``buffer_blocks``
regions of the file while batches still mix samples from far-apart parts of the dataset.

Orders are numpy arrays computed from ``(seed, epoch)`` alone, so every rank and every resumed
run computes the same order without communicating.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sized

import numpy as np
from torch.utils.data import Sampler

from gpufeed.data.distributed import DistributedBlockSampler
from gpufeed.data.order import DEFAULT_BLOCK_SIZE, DEFAULT_BUFFER_BLOCKS, block_shuffle_order
from gpufeed.pagecache.plan import NO_READ_AHEAD, BatchReadAhead, ReadAheadPlan

__all__ = ["BlockShuffleSampler", "LookaheadBatch", "SortedBatchSampler"]


class BlockShuffleSampler(Sampler[int]):
    """Every index of ``range(n)`` exactly once per epoch, in block-shuffled order.

    ``n`` may be a length or a sized dataset. Call :meth:`set_epoch` before each epoch for a
    new order (the loader from :func:`gpufeed.make_loader` does it for you).
    ``shuffle=False`` gives ``0..n-1`` in order. :meth:`iter_from` starts mid-epoch, for
    resumption, without computing or discarding the skipped part one by one.
    """

    def __init__(
        self,
        n: int | Sized,
        block_size: int = DEFAULT_BLOCK_SIZE,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
    ) -> None:
        self.n = n if isinstance(n, int) else len(n)
        self.block_size = int(block_size)
        self.buffer_blocks = int(buffer_blocks)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = shuffle
        self._elastic: tuple[int, np.ndarray] | None = None  # (epoch, what is left of it)
        self.order()  # validate arguments now, not at the first epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume_elastic(self, epoch: int, world: int, seen: int, drop_last: bool = False) -> None:
        """Make ``epoch`` deliver what a run of ``world`` ranks had not handed out when each
        had handed out ``seen`` samples: one process going on from a distributed checkpoint
        (:meth:`DistributedBlockSampler.resume_elastic` with one rank)."""
        one = DistributedBlockSampler(
            self.n, 1, 0, self.block_size, self.seed, self.shuffle, drop_last,
            self.buffer_blocks, epoch,
        )  # fmt: skip
        one.resume_elastic(epoch, world, seen)
        self._elastic = (int(epoch), one.order())

    def order(self) -> np.ndarray:
        if self._elastic is not None and self._elastic[0] == self.epoch:
            return self._elastic[1]
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        return block_shuffle_order(
            self.n,
            block_size=self.block_size,
            buffer_blocks=self.buffer_blocks,
            seed=self.seed,
            epoch=self.epoch,
        )

    def iter_from(self, start: int) -> Iterator[int]:
        return iter(self.order()[start:].tolist())

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def __len__(self) -> int:
        return len(self.order()) if self._elastic is not None else self.n


class LookaheadBatch(list):
    """A batch of indices that also carries its read-ahead hints, ``read_ahead`` (a
    :class:`~gpufeed.pagecache.plan.BatchReadAhead`: the indices of a batch that comes
    later to the same reader, or whole blocks of the order that batches to come read), which
    the dataset gives the reader so that the kernel starts reading them while this batch is
    copied. Pickles like a list plus the hints (to workers)."""

    def __init__(self, indices: Iterable[int], read_ahead: BatchReadAhead) -> None:
        super().__init__(indices)
        self.read_ahead = read_ahead

    @property
    def ahead(self) -> list[int] | None:
        return self.read_ahead.ahead

    @property
    def ranges(self) -> list[tuple[int, int]] | None:
        return self.read_ahead.ranges

    def __reduce__(self):
        return (LookaheadBatch, (list(self), self.read_ahead))


class SortedBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices from ``sampler``, each batch sorted ascending.

    The set of indices in each batch is what ``sampler`` gives; only their order inside the
    batch changes, which a training step does not see. Sorted reads are cheaper for HDF5
    chunks, memory maps and LMDB pages. ``sort=False`` keeps the sampler's order (a plain
    ``BatchSampler``). ``start`` skips that many indices of the epoch (resumption).
    ``read_ahead`` (a :class:`~gpufeed.pagecache.plan.ReadAheadPlan`, given here or once by
    :meth:`set_read_ahead`; make_loader builds it) makes it yield :class:`LookaheadBatch` es:
    with ``lookahead=k`` (k >= 1), each carries the batch k places later (``ahead``): with k
    DataLoader workers taking batches in turn, that is the batch the same worker reads next
    (large samples). With ``range_block=b`` (b >= 1) as well, batches carry ``ranges``
    instead: the blocks of ``b`` indices that the batch ``lookahead`` places later reads and
    no earlier batch announced, so the dataset asks for each block once an epoch, a window
    ahead (small samples: one large read a block instead of a fault a sample), unless the
    plan's ``looks_warm()`` says at the epoch's start that the data is cached throughout
    (then its batches are plain lists: nothing is left to ask for).
    """

    def __init__(
        self,
        sampler: Iterable[int],
        batch_size: int,
        drop_last: bool = False,
        sort: bool = True,
        read_ahead: ReadAheadPlan = NO_READ_AHEAD,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.sort = sort
        self.start = 0
        self.read_ahead = read_ahead

    def set_read_ahead(self, plan: ReadAheadPlan) -> None:
        """Read ahead by ``plan`` from the next epoch on (make_loader calls it once, when it
        knows the worker count)."""
        self.read_ahead = plan

    @property
    def lookahead(self) -> int:
        """Batches read ahead (the plan's; 0: none)."""
        return self.read_ahead.lookahead

    @property
    def range_block(self) -> int:
        """Indices a block read ahead (the plan's; 0: no blocks)."""
        return self.read_ahead.range_block

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _indices(self) -> Iterator[int]:
        if self.start and hasattr(self.sampler, "iter_from"):
            return self.sampler.iter_from(self.start)
        it = iter(self.sampler)
        for _ in range(self.start):
            if next(it, None) is None:
                break
        return it

    def _batches(self) -> Iterator[list[int]]:
        for batch in self._batch_arrays():
            yield batch.tolist() if isinstance(batch, np.ndarray) else batch

    def _batch_arrays(self) -> Iterator[np.ndarray | list[int]]:
        order = getattr(self.sampler, "order", None)
        if callable(order):
            # gpufeed's samplers hand over the epoch as one array: batches are slices of it
            # (a Python loop over every index cost more than reading small samples)
            idx = np.asarray(order(), dtype=np.int64)[self.start :]
            bs = self.batch_size
            stop = len(idx) - len(idx) % bs if self.drop_last else len(idx)
            for lo in range(0, stop, bs):
                chunk = idx[lo : lo + bs]
                yield np.sort(chunk) if self.sort else chunk
            return
        batch: list[int] = []
        for i in self._indices():
            batch.append(int(i))
            if len(batch) == self.batch_size:
                yield sorted(batch) if self.sort else batch
                batch = []
        if batch and not self.drop_last:
            yield sorted(batch) if self.sort else batch

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.read_ahead  # one plan for the whole epoch
        if plan.lookahead < 1:
            yield from self._batches()
            return
        if plan.by_block:
            warm = plan.looks_warm is not None and plan.looks_warm()
            yield from self._batches() if warm else self._with_ranges(plan)
            return
        window: deque[list[int]] = deque()
        for batch in self._batches():
            window.append(batch)
            if len(window) > plan.lookahead:
                yield LookaheadBatch(window.popleft(), BatchReadAhead(ahead=batch))
        while window:
            yield LookaheadBatch(window.popleft(), BatchReadAhead())

    def _with_ranges(self, plan: ReadAheadPlan) -> Iterator[LookaheadBatch]:
        # the epoch at once in numpy (a set and np.unique per batch slowed a warm pass of
        # small samples: docs/performance/page-cache-read-ahead.md): each block's first
        # batch, announced `lookahead` batches before
        b = plan.range_block
        batches = [np.asarray(a, dtype=np.int64) for a in self._batch_arrays()]
        if not batches:
            return
        sizes = np.fromiter(map(len, batches), np.int64, len(batches))
        flat = np.concatenate(batches)
        blocks, first = np.unique(flat // b, return_index=True)
        when = np.maximum(np.repeat(np.arange(len(batches)), sizes)[first] - plan.lookahead, 0)
        # in the order first read (not block order): the first batch's blocks lead the
        # populate threads' queue, so they are read in parallel with the batch's own thread
        by_use = np.argsort(first, kind="stable")
        blocks, when = blocks[by_use] * b, when[by_use]
        cuts = np.searchsorted(when, np.arange(len(batches) + 1)).tolist()
        starts = blocks.tolist()
        for j, batch in enumerate(batches):
            lo, hi = cuts[j], cuts[j + 1]
            ranges = [(a, a + b) for a in starts[lo:hi]] if hi > lo else None
            yield LookaheadBatch(batch.tolist(), BatchReadAhead(ranges=ranges))

    def samples_per_epoch(self) -> int:
        """Indices this sampler yields in a full epoch (after ``drop_last``)."""
        n = len(self.sampler)  # type: ignore[arg-type]
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        n = len(self.sampler) - self.start  # type: ignore[arg-type]
        n = max(0, n)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
