"""Fetch files ahead of the order they will be read in, with a bounded pool of downloads."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from gpufeed.errors import UsageError
from gpufeed.storage.cache import FileEntry, Pin

DEFAULT_WORKERS = 8
DEFAULT_AHEAD = 16


class FetchAhead:
    """Pins of `entries` in their order (the sampler's), fetched by up to `workers` concurrent
    downloads and at most `ahead` files in front of the consumer, so disk use stays within
    `ahead` files and memory within `workers` streaming buffers. The consumer releases each
    pin when done with its file; close() (or leaving a `with`) releases the rest."""

    def __init__(
        self,
        get: Callable[[FileEntry], Pin],
        entries: Iterable[FileEntry],
        *,
        workers: int = DEFAULT_WORKERS,
        ahead: int = DEFAULT_AHEAD,
    ):
        if workers < 1 or ahead < 1:
            raise UsageError(f"fetch-ahead workers={workers}, ahead={ahead}: both must be >= 1")
        self._get = get
        self._todo = iter(entries)
        self._ahead = ahead
        self._pool = ThreadPoolExecutor(min(workers, ahead), thread_name_prefix="gpufeed-fetch")
        self._pending: deque[Future[Pin]] = deque()
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._ahead:
            entry = next(self._todo, None)
            if entry is None:
                return
            self._pending.append(self._pool.submit(self._get, entry))

    def __iter__(self) -> Iterator[Pin]:
        return self

    def __next__(self) -> Pin:
        if not self._pending:
            self.close()
            raise StopIteration
        pin = self._pending.popleft().result()  # a fetch's error surfaces here, in order
        self._fill()
        return pin

    def close(self) -> None:
        for fut in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True)
        for fut in self._pending:
            if not fut.cancelled() and fut.exception() is None:
                fut.result().release()
        self._pending.clear()

    def __enter__(self) -> FetchAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
