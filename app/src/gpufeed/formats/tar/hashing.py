"""Each tar shard's sha256 (the manifest's), made from the bytes as they are written, in a
thread of its own.

Hashing was a third of a Writer's commit thread on fixed-size samples (sha256 of every byte
of every shard, headers and padding included); hashlib releases the GIL while it hashes, so
in a thread it runs while the next run is built and written. The updates of all shards go
through one thread, in the order their bytes were written; a buffer handed to ``update`` is
read by the thread until its job is done (gpufeed.formats.tar.fields.Scratch.hold keeps the
writer from building in it before).

A pack whose shards may be cut again at the end (TarWriter.recut: its count not known yet)
is hashed when its new shards are written, not twice: while so, the hasher is ``deferred``
(no update is hashed); once the cut is settled, the shards written so far are hashed from
their files (``file_digest``, ``resume``), in the thread, and the rest as written.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from gpufeed.formats.checksums import hash_fd

__all__ = ["ShardHasher"]


class ShardHasher:
    """The sha256 of the shard being written (``start`` begins the next one)."""

    def __init__(self, deferred: bool = False) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._hash = None
        self._resumed: Future | None = None  # the read-back of the shard being written
        self.deferred = deferred  # updates not hashed (until resume)

    def start(self) -> None:
        self._hash, self._resumed = hashlib.sha256(), None

    def update(self, data) -> Future | None:
        """``data`` hashed in the thread (after every update before it): the caller leaves
        it as it is until the returned job is done (None: deferred, nothing to wait for)."""
        if self.deferred:
            return None
        return self._submit(self._hash.update, data)

    def file_digest(self, path: Path) -> Future:
        """The hex sha256 of the file ``path`` (a shard written while deferred), made in the
        thread."""
        return self._submit(_file_digest, path)

    def resume(self, path: Path, nbytes: int) -> None:
        """Updates hashed from now on, after the first ``nbytes`` of the shard being written
        (``path``), read back in the thread."""
        self.deferred = False
        self._hash = hashlib.sha256()
        self._resumed = self._submit(_hash_file, self._hash, path, nbytes)

    def _submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-sha256")
        return self._pool.submit(fn, *args)

    def digest(self) -> Future:
        """The shard's hex sha256, once every update before is hashed (the read-back's
        error, if it failed: never the digest of part of the shard)."""
        resumed, self._resumed = self._resumed, None
        return self._submit(_hexdigest, self._hash, resumed)

    def close(self) -> None:
        """The thread ended, after every job given to it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _hash_file(h, path: Path, nbytes: int | None = None) -> None:
    """``h`` updated with the first ``nbytes`` of ``path`` (None: all of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_fd(h, fd, nbytes, path)
    finally:
        os.close(fd)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    _hash_file(h, path)
    return h.hexdigest()


def _hexdigest(h, resumed: Future | None) -> str:
    if resumed is not None:
        resumed.result()  # done: the thread ran it before this
    return h.hexdigest()
