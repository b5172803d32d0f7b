"""When and how long to wait before trying a failed request again (exponential backoff)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpufeed.errors import StorageError
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import TransientError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `retries` more tries after a transient failure, waiting base_s * 2**n (with
    jitter, at most max_s) before try n+1: the defaults ride out about a minute of outage."""

    retries: int = 10
    base_s: float = 0.25
    max_s: float = 15.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based)."""
        full = min(self.max_s, self.base_s * 2 ** (attempt - 1))
        return full / 2 + random.uniform(0, full / 2)

    def after_failure(self, error: TransientError, attempt: int, stats: StorageStats) -> None:
        """Count retry number `attempt` and wait for it, or raise once the retries are spent."""
        if attempt > self.retries:
            raise StorageError(f"{error} (gave up after {self.retries} retries)") from error
        stats.add(retries=1)
        time.sleep(self.delay(attempt))


def with_retries(call: Callable[[], T], policy: RetryPolicy, stats: StorageStats) -> T:
    """call(), tried again after each TransientError up to policy.retries times (counted)."""
    attempt = 0
    while True:
        try:
            return call()
        except TransientError as e:
            attempt += 1
            policy.after_failure(e, attempt, stats)
