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

__all__ = ["crc32", "raw_crc32", "row_crcs", "sha256_file"]


def crc32(buf) -> int:
    """zlib's crc32 of a bytes-like object or a C-contiguous array (an unsigned int)."""
    return raw_crc32(buf) & 0xFFFFFFFF


def row_crcs(batch: np.ndarray) -> np.ndarray:
    """crc32 of each row of a C-contiguous [N, ...] array."""
    if not len(batch):
        return np.zeros(0, np.uint32)
    rows = batch.reshape(len(batch), -1)
    return np.fromiter(map(raw_crc32, rows), np.uint32, len(rows))


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
