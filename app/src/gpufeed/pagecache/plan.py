"""What an epoch reads ahead into the page cache, decided once and passed down explicitly.

``make_loader`` builds one :class:`ReadAheadPlan` from the reader's declared capabilities
(``Reader.reads_ranges_ahead``, ``reads_ranges_ahead_in_order``, ``looks_warm``) and the
sampler's settings, and hands it to the batch sampler (``SortedBatchSampler.schedule_epoch``).
Each batch the sampler yields then carries one :class:`BatchReadAhead` (the batch read
``lookahead`` places later, or the blocks of the order announced with it), which the dataset
gives to the reader's one entry point (``Reader.read_ahead_batch``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NO_READ_AHEAD", "BatchReadAhead", "ReadAheadPlan"]


@dataclass(frozen=True)
class ReadAheadPlan:
    """An epoch's read-ahead.

    Attributes:
        lookahead: batches ahead (0: nothing is read ahead). Large samples: each batch
            carries the indices of the batch this many places later (with k workers taking
            batches in turn, the one the same worker reads next).
        range_block: indices a block (0: no blocks). Small samples: each batch carries the
            blocks of this many indices that the batch ``lookahead`` places later reads and
            no earlier batch announced (each block once an epoch, a window ahead).
        looks_warm: asked once at each epoch's start when reading by block; True (the data
            looks cached throughout) makes that epoch's batches carry nothing.
    """

    lookahead: int = 0
    range_block: int = 0
    looks_warm: Callable[[], bool] | None = None

    @property
    def by_block(self) -> bool:
        """Whether batches carry blocks of the order (else the batch ``lookahead`` later)."""
        return self.lookahead >= 1 and self.range_block >= 1


NO_READ_AHEAD = ReadAheadPlan()


@dataclass(frozen=True)
class BatchReadAhead:
    """One batch's read-ahead hints: what the reader starts reading while it copies this batch.

    Attributes:
        ahead: the indices of a batch read later by the same reader, or None.
        ranges: index ranges ``(start, stop)``, whole blocks of the order that batches to
            come read, or None.
    """

    ahead: list[int] | None = None
    ranges: list[tuple[int, int]] | None = None
