"""Each tar shard's sha256 (the manifest's), made from the bytes as they are written, in a
thread of its own.

Hashing was a third of a Writer's commit thread on fixed-size samples (sha256 of every byte
of every shard, headers and padding included); hashlib releases the GIL while it hashes, so
in a thread it runs while the next run is built and written. The updates of all shards go
through one thread, in the order their bytes were written; a buffer handed to ``update`` is
read by the thread until its job is done (gpufeed.formats.tar.fields.Scratch.hold keeps the
writer from building in it before).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["ShardHasher"]


class ShardHasher:
    """The sha256 of the shard being written (``start`` begins the next one)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._hash = None

    def start(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data) -> Future:
        """``data`` hashed in the thread (after every update before it): the caller leaves
        it as it is until the returned job is done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-sha256")
        self._last = self._pool.submit(self._hash.update, data)
        return self._last

    def update_now(self, data) -> None:
        """``data`` hashed before this returns (a buffer the caller reuses at once)."""
        self.wait()
        self._hash.update(data)

    def digest(self) -> Future:
        """The shard's hex sha256, once every update before is hashed."""
        if self._pool is None:
            done: Future = Future()
            done.set_result(self._hash.hexdigest())
            return done
        self._last = self._pool.submit(self._hash.hexdigest)
        return self._last

    def wait(self) -> None:
        """Every update so far hashed (the first error raised)."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """The thread ended, after every job given to it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._last = None
