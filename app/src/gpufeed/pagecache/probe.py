"""Telling which pages of a mapped file are cached where mincore cannot.

For a file a process neither owns nor may write, mincore answers "every page resident"
(mm/mincore.c, can_do_mincore: no page-cache side channel), so a cold pack looks warm and
advise.py would read nothing ahead: a dataset owned by another user, or mounted
read-only, read by a container running as a non-root user (ours do). Such a reader asks the
file itself (:class:`FileProbe`, :func:`file_cached`: preadv2 with RWF_NOWAIT)
(docs/performance/page-cache-read-ahead.md, "Reading ahead as a non-root user").
"""

from __future__ import annotations

import os

__all__ = ["FileProbe", "cache_probe", "checked_points", "file_cached", "map_delta", "mincore_sees"]


def checked_points(start: int, length: int) -> tuple[int, ...]:
    """Where a range is checked for being cached, by mincore or by the file: its first,
    middle and last byte (a whole range's check costs as much as the advice it saves); the
    one byte of a range of one."""
    if length == 1:
        return (start,)
    return (start, start + length // 2, start + length - 1)


def mincore_sees(path: str | os.PathLike) -> bool:
    """Whether mincore tells this process which pages of file ``path`` are cached: it owns
    the file or may open it for writing (see the module's docstring). Root is taken to have
    CAP_FOWNER. True when ``path`` cannot be looked at (nothing is known to be wrong)."""
    try:
        st = os.stat(path)
    except OSError:
        return True
    euid = os.geteuid()
    if euid in (0, st.st_uid):
        return True
    return os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids)


_PROBE_BYTE = bytearray(1)  # where a probe's one byte lands (its value is never used)


class FileProbe:
    """Whether a range of a map of a file that mincore cannot see (:func:`mincore_sees`) is
    cached, asked of the file itself: a one-byte preadv2(RWF_NOWAIT) fails with EAGAIN
    where the page is not in the page cache, without waiting for the disk (RWF_NOWAIT
    implies IOCB_NOIO: a probe of a cold MiB left at most 4 pages cached in tests). The
    first, middle and last page, as readahead.looks_cached. For one map: a file offset is the
    address plus ``delta``. False when it cannot tell (the range is then read ahead). Its
    descriptor is this process's (pickled without it)."""

    def __init__(self, path: str | os.PathLike, delta: int):
        self.path, self.delta = str(path), int(delta)
        self._fd: int | None = None
        self._pid: int | None = None

    def __call__(self, addr: int, length: int) -> bool:
        fd = self._own_fd()
        return fd is not None and file_cached(fd, addr + self.delta, length)

    def _own_fd(self) -> int | None:
        if self._pid != os.getpid():
            self._fd, self._pid = None, os.getpid()  # an inherited descriptor is the parent's
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            os.close(fd)

    def __getstate__(self):
        return {"path": self.path, "delta": self.delta, "_fd": None, "_pid": None}


def file_cached(fd: int, offset: int, length: int) -> bool:
    """Whether the pages of ``length`` bytes at ``offset`` of file ``fd`` that
    :func:`checked_points` names are cached (a one-byte preadv2(RWF_NOWAIT) each, see
    :class:`FileProbe`); False when it cannot tell."""
    if length <= 0:
        return False
    for at in checked_points(offset, length):
        try:
            os.preadv(fd, [_PROBE_BYTE], at, os.RWF_NOWAIT)
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: this filesystem cannot say
            return False
    return True


def cache_probe(path: str | os.PathLike, addr: int) -> FileProbe | None:
    """How to tell which ranges are cached of a map of file ``path`` holding address
    ``addr``: None where mincore sees the file (readahead.looks_cached does), else a
    :class:`FileProbe` placed by the map's line in /proc/self/maps. None too where that
    cannot be found or RWF_NOWAIT does not exist (mincore's answer stands)."""
    if not hasattr(os, "RWF_NOWAIT") or mincore_sees(path):
        return None
    delta = map_delta(addr)
    return None if delta is None else FileProbe(path, delta)


def map_delta(addr: int, maps: str | os.PathLike = "/proc/self/maps") -> int | None:
    """File offset minus address in the file mapping holding ``addr``, None where none does."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()
                start, _, end = fields[0].partition("-")
                if int(start, 16) <= addr < int(end, 16) and len(fields) >= 6:
                    return int(fields[2], 16) - int(start, 16)
    except (OSError, ValueError, IndexError):
        return None
    return None
