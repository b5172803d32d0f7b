"""Counters of one process's storage activity, safe to update from the download threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class StorageStats:
    """hits/misses: cache look-ups; retries: failed requests tried again; bytes_fetched: bytes
    received from the store (retried bytes included); evictions: files removed for space."""

    hits: int = 0
    misses: int = 0
    retries: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}

    def __getstate__(self):
        return self.as_dict()

    def __setstate__(self, state):
        self.__init__(**state)
