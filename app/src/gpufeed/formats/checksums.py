"""The checksums a pack records: crc32 per sample (checked on read and by verify), sha256 per
file (in the manifest)."""

from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np

__all__ = ["crc32", "row_crcs", "sha256_file"]


def crc32(buf) -> int:
    """zlib crc32 of a bytes-like object or a C-contiguous array."""
    return zlib.crc32(buf) & 0xFFFFFFFF


def row_crcs(batch: np.ndarray) -> np.ndarray:
    """crc32 of each row of a C-contiguous [N, ...] array."""
    out = np.empty(len(batch), dtype=np.uint32)
    for j in range(len(batch)):
        out[j] = zlib.crc32(batch[j])
    return out


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
