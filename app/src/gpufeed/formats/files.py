"""Writing files so that a crash or a full disk never leaves one that looks complete.

Every writer in gpufeed writes to a temporary name, fsyncs and renames (:func:`atomic_write_bytes`),
reserves space before it writes through a memory map (:func:`preallocate`: a write into a hole
on a full disk is a SIGBUS, not an error), and turns running out of space into a
:class:`~gpufeed.errors.DiskFullError` naming the file (:func:`no_space_is_an_error`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpufeed.errors import DiskFullError
from gpufeed.system.disk import free_bytes

__all__ = [
    "kernel_copy",
    "start_writeback",
    "atomic_write_bytes",
    "atomic_write_json",
    "file_identity",
    "fsync_dir",
    "is_disk_full",
    "no_space_is_an_error",
    "preallocate",
]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException, path: str | os.PathLike, need: int = 0) -> bool:
    """Whether a failed write ran out of space. errno says so for plain writes and HDF5; for
    errors without one (LMDB reports ENOSPC as "Input/output error", torch.save as "file
    write failed") the free space left where `path` lives decides (under `need` bytes, or
    under 1 MiB)."""
    code = getattr(exc, "errno", None)
    if code in _NO_SPACE or "No space left on device" in str(exc):
        return True
    if code is not None and code != errno.EIO:
        return False
    try:
        return free_bytes(path) < max(int(need), 1 << 20)
    except OSError:
        return False


def preallocate(f, nbytes: int, path: str | os.PathLike) -> None:
    """Reserve `nbytes` for open file `f` before it is written through a memory map (or by a
    library that cannot report ENOSPC cleanly): a full disk is then this DiskFullError, not
    a SIGBUS or a half-written file. Filesystems without fallocate are left to report
    ENOSPC on write."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(f.fileno(), 0, int(nbytes))
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise DiskFullError(path, nbytes) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


@contextlib.contextmanager
def no_space_is_an_error(path: str | os.PathLike, need: int = 0) -> Iterator[None]:
    """Turn running out of space while writing `path` into DiskFullError naming it."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - narrowed by is_disk_full, re-raised otherwise
        if isinstance(e, (OSError, RuntimeError)) and is_disk_full(e, path, need):
            raise DiskFullError(path, need or None) from None
        raise


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from its replacement: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


# copy_file_range's errors that mean it cannot copy between these files (not a failed write)
_NO_KERNEL_COPY = frozenset(
    {errno.ENOSYS, errno.EXDEV, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF}
)


def kernel_copy(src: int, dst: int, size: int, src_at: int, dst_at: int | None = None) -> int:
    """Up to ``size`` bytes of ``src`` from ``src_at`` copied to ``dst`` (at ``dst_at``, or
    its file offset) by the kernel (copy_file_range: no bytes through Python); returns how
    many, fewer where the source ends sooner, 0 where the system or the file systems
    cannot (the caller copies the rest itself)."""
    copy, done = getattr(os, "copy_file_range", None), 0
    try:
        while copy is not None and done < size:
            at = () if dst_at is None else (dst_at + done,)  # none: dst's own offset
            got = copy(src, dst, size - done, src_at + done, *at)
            if got <= 0:
                break
            done += got
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY:
            raise
    return done


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these bytes out now, not wait for them (Linux's
    sync_file_range with SYNC_FILE_RANGE_WRITE): the fsync before the manifest then finds
    little left, and the disk works while the next samples are made instead of after the
    last. Best effort: a no-op where the call is missing or refused."""
    call = _sync_file_range()
    if call is not None and nbytes > 0:
        call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # its result only says if it began


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, shared: bool = False) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new one.

    `shared`: other processes may write the same file at once (a cache several ranks fill),
    so each write has a temporary name of its own; otherwise the caller holds the file's lock
    and the name is fixed (``<name>.tmp``, which a resumed pack recognises as its own)."""
    if shared:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    else:
        tmp = path.with_name(path.name + ".tmp")
    with no_space_is_an_error(path, len(data)), open(tmp, "xb" if shared else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
