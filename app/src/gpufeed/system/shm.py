"""The /dev/shm rule, in one place: DataLoader workers hand every batch to the main process
through shared memory, so ``workers x prefetch_factor`` batches must fit in what is free, and
a /dev/shm smaller than ``GPUFEED_MIN_SHM_MB`` (the thresholds file) gets a warning even when
this loader fits: larger batches or more workers die with "Bus error".

``make_loader`` (a ShmBudgetWarning), ``gpufeed doctor`` (its shm check) and the shell
preflight (``entrypoints/preflight.d/20-shm.sh``, the floor only) apply it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from gpufeed.system import sysinfo

__all__ = ["ShmBudget", "shm_budget"]


@dataclass(frozen=True)
class ShmBudget:
    """``workers`` x ``prefetch`` batches of ``batch_bytes`` against the shared memory at
    ``path`` (``total_bytes``, ``free_bytes`` now) and the floor ``floor_bytes``."""

    path: str
    total_bytes: int
    free_bytes: int
    workers: int
    prefetch: int
    batch_bytes: int
    floor_bytes: int

    @property
    def need_bytes(self) -> int:
        return self.workers * self.prefetch * self.batch_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes

    @property
    def below_floor(self) -> bool:
        return self.total_bytes < self.floor_bytes

    def suggested_gib(self) -> int:
        """A --shm-size (GiB, a power of two) that holds twice what these workers need."""
        return max(1, 2 ** math.ceil(math.log2(max(1, 2 * self.need_bytes) / (1 << 30))))

    def workers_that_fit(self) -> int:
        """The most workers whose prefetched batches fit in what is free."""
        return max(0, int(self.free_bytes // max(1, self.prefetch * self.batch_bytes)))


def shm_budget(
    workers: int,
    prefetch: int,
    batch_bytes: int,
    floor_bytes: int,
    path: str | os.PathLike = "/dev/shm",
) -> ShmBudget | None:
    """The budget at ``path`` now, None when it does not exist."""
    info = sysinfo.shm_info(path)
    if info is None:
        return None
    return ShmBudget(
        str(path), info.total_bytes, info.free_bytes, workers, prefetch, batch_bytes, floor_bytes
    )
