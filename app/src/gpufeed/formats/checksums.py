"""The checksums a pack records: crc32 per sample (checked on read and by verify), sha256 per
file (in the manifest)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

try:  # ISA-L's crc32 is zlib's checksum, 4-15x faster on x86-64 and arm64 (carry-less multiply)
    from isal.isal_zlib import crc32 as raw_crc32
except ImportError:  # a platform without its wheel: zlib's, the same values
    from zlib import crc32 as raw_crc32

__all__ = [
    "HASH_CHUNK",
    "crc32",
    "hash_fd",
    "raw_crc32",
    "row_crcs",
    "sha256_fd",
    "sha256_file",
]


def crc32(buf) -> int:
    """zlib's crc32 of a bytes-like object or a C-contiguous array (an unsigned int)."""
    return raw_crc32(buf) & 0xFFFFFFFF


def row_crcs(batch: np.ndarray) -> np.ndarray:
    """crc32 of each row of a C-contiguous [N, ...] array."""
    if not len(batch):
        return np.zeros(0, np.uint32)
    rows = batch.reshape(len(batch), -1)
    return np.fromiter(map(raw_crc32, rows), np.uint32, len(rows))


# bytes read at a time when a file is hashed: a buffer that stays in the CPU's cache and is
# cheap to make (every new page is a fault: a 4 MiB buffer took ~50 ms to make on the 2-CPU
# test VM, a pack's whole close for 25k samples), sized down to a smaller file
HASH_CHUNK = 1 << 20


def hash_fd(h, fd: int, nbytes: int | None = None, where="the file") -> int:
    """``h`` (a hashlib object) updated with the first ``nbytes`` of the file open as ``fd``
    (None: all of it), read at positions (the fd's offset is not moved); returns the bytes
    hashed. OSError when the file ends before ``nbytes``."""
    want = os.fstat(fd).st_size if nbytes is None else nbytes
    buf = np.empty(max(1, min(HASH_CHUNK, want)), np.uint8)
    view, at = memoryview(buf), 0
    while nbytes is None or at < nbytes:
        got = os.preadv(fd, [view if nbytes is None else view[: min(len(view), nbytes - at)]], at)
        if got <= 0:
            if nbytes is None:
                return at
            raise OSError(f"{where} ends at byte {at:,}, before the {nbytes:,} to hash")
        h.update(view[:got])
        at += got
    return at


def sha256_fd(fd: int, size: int | None = None, where="the file") -> str:
    """The sha256 of the first ``size`` bytes of the file open as ``fd`` (None: all)."""
    h = hashlib.sha256()
    hash_fd(h, fd, size, where)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return sha256_fd(fd, None, path)
    finally:
        os.close(fd)
