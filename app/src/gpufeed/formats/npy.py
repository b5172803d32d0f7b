"""Arrays as .npy bytes and headers (LMDB's index keys, tar members, mmap's files)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from gpufeed.errors import DataError

__all__ = ["NPY_HEADER_MAX", "npy_bytes", "npy_from_bytes", "npy_header", "npy_shape"]


def npy_bytes(arr: np.ndarray) -> bytes:
    """An array as the bytes of a .npy file (what np.save would write)."""
    b = io.BytesIO()
    np.save(b, np.require(arr, requirements="C"), allow_pickle=False)  # 0-d stays 0-d
    return b.getvalue()


def npy_from_bytes(data) -> np.ndarray:
    return np.load(io.BytesIO(bytes(data)), allow_pickle=False)


NPY_HEADER_MAX = 4096  # np.save's headers are 64-byte aligned, a few hundred bytes


def npy_header(head: bytes, where) -> tuple[tuple[int, ...], int]:
    """(shape, offset of the data) from the first bytes of a .npy file (`where` names it)."""
    f = io.BytesIO(head)
    return _read_header(f, where), f.tell()


def npy_shape(path: Path) -> tuple[int, ...]:
    """The shape a .npy file's header declares (nothing else is read)."""
    with open(path, "rb") as f:
        return _read_header(f, path)


def _read_header(f, where) -> tuple[int, ...]:
    """The shape in the .npy header at `f`'s position, `f` left at the data."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, _ = read(f)
    except ValueError as e:
        raise DataError(f"{where}: not a readable .npy file: {e}") from None
    return shape
