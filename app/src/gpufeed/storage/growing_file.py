"""A download in progress, readable before it lands: the bytes written so far of its .part file.

The cache lands a file whole and verified (sha256) before anyone reads it. A reader that can
check what it reads itself (the mmap pack's crc32 per sample) may instead take the bytes
already written while the rest downloads: an mmap pack's samples are one object, and its first
batch would otherwise wait for all of it. Only the process downloading the file sees its
Landing (another process waits for the file to land, as before), and only until the download
ends: then read() answers None and the reader maps the landed file (or the fetch reports why
it failed). No byte is fetched twice: the reads come from the one download's own file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any


class Landing:
    """The .part file (descriptor `fd`, `size` bytes when whole) of a download in progress."""

    def __init__(self, fd: int, size: int):
        self.size = size
        self._fd = fd
        self._written = 0
        self._wanted = 0  # the end a reader waits for: advance() wakes it only then
        self._done = False
        self._cond = threading.Condition()
        self._pid = os.getpid()

    def advance(self, written: int) -> None:
        """Bytes [0, written) are in the file (a restart from 0 moves it back)."""
        with self._cond:
            self._written = written
            if self._wanted and written >= self._wanted:
                self._cond.notify_all()

    def finish(self) -> None:
        """The download ended (landed or failed): reads answer False from now on, and the
        descriptor may be closed."""
        with self._cond:
            self._done = True
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._done or self._pid != os.getpid()

    def read_into(self, reads: Sequence[tuple[int, Any]]) -> bool:
        """Fill each buffer with the file's bytes from its offset, waiting until the download
        has written them; False when the download ended first (or in a forked child, whose
        copy of this object no thread advances)."""
        if self._pid != os.getpid():  # checked before the lock: a fork may have copied it held
            return False
        reads = [(offset, memoryview(buf).cast("B")) for offset, buf in reads]
        end = max((offset + buf.nbytes for offset, buf in reads), default=0)
        if end > self.size:
            raise ValueError(f"a read ends at {end}, past the file's {self.size} bytes")
        with self._cond:
            while not self._done and self._written < end:
                self._wanted = end
                self._cond.wait()
            self._wanted = 0
            if self._done:
                return False
            for offset, buf in reads:
                if os.preadv(self._fd, [buf], offset) != buf.nbytes:
                    raise OSError(f"a short read of a download in progress at {offset}")
            return True
