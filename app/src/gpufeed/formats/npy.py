"""Arrays as .npy bytes and headers (LMDB's index keys, tar members, mmap's files)."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from tokenize import TokenError

import numpy as np

from gpufeed.errors import DataError

__all__ = [
    "NPY_HEADER_MAX",
    "npy_bytes",
    "npy_from_bytes",
    "npy_header",
    "npy_shape",
    "parse_header",
    "read_npy_vector",
    "read_npz_vectors",
]


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


def parse_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy header at ``f``'s position, ``f`` left at
    the data: the one parser of untrusted .npy headers. Any damage is a ValueError (numpy's
    own parser raises several kinds: a mangled header reaches its literal evaluator)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except (ValueError, EOFError, SyntaxError, TypeError, TokenError) as e:
        raise ValueError(f"not a .npy array: {e}") from None
    return tuple(shape), fortran, dtype


def _read_header(f, where) -> tuple[int, ...]:
    """The shape in the .npy header at `f`'s position, `f` left at the data."""
    try:
        return parse_header(f)[0]
    except ValueError as e:
        raise DataError(f"{where}: not a readable .npy file: {e}") from None


def read_npz_vectors(path: Path, names: tuple[str, ...], length: int) -> list[np.ndarray]:
    """The 1-D integer arrays ``names`` of the .npz file ``path`` (np.savez's members
    NAME.npy), each of ``length`` entries. What the zip and each .npy header declare is
    checked before anything is allocated (np.load sizes its buffers from them: a small
    crafted file could ask for gigabytes); no pickle is ever loaded."""
    try:
        with zipfile.ZipFile(path) as z:
            return [_vector(z, path, name, length) for name in names]
    except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file: {e}") from None


def read_npy_vector(path: Path, length: int) -> np.ndarray:
    """The 1-D integer array of ``length`` entries in the .npy file ``path``, checked as
    read_npz_vectors checks a member (the file's size, then its header, before reading)."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            return _read_vector(f, size, f"{path}", length)
    except OSError as e:
        raise DataError(f"{path}: cannot be read: {e}") from None


def _vector(z: zipfile.ZipFile, path: Path, name: str, length: int) -> np.ndarray:
    member = f"{name}.npy"
    try:
        info = z.getinfo(member)
    except KeyError:
        raise DataError(f"{path}: has no {member}; the file is damaged (re-pack it)") from None
    with z.open(info) as f:
        return _read_vector(f, info.file_size, f"{path}: {member}", length)


def _read_vector(f, size: int, where: str, length: int) -> np.ndarray:
    """A .npy array of ``size`` bytes (as its zip entry or the file system says) at ``f``,
    to be ``length`` integers: the size and the header are checked before anything is
    allocated (np.load sizes its buffers from the header alone)."""
    bound = NPY_HEADER_MAX + 8 * length  # integer entries are 8 bytes at most
    if size > bound:
        raise DataError(
            f"{where} declares {size:,} bytes, more than {length:,} entries take (at most "
            f"{bound:,}); the file is damaged or crafted (re-pack it)"
        )
    try:
        shape, _, dtype = parse_header(f)
    except ValueError as e:
        raise DataError(f"{where} is not a readable .npy array: {e}") from None
    if shape != (length,) or dtype.kind not in "iu" or dtype.itemsize > 8:
        raise DataError(
            f"{where} holds {dtype} {list(shape)}, the manifest says {length:,} integers; "
            "the file is damaged or crafted (re-pack it)"
        )
    out = np.empty(length, dtype=dtype)
    got = f.readinto(out.view(np.uint8)) if out.nbytes else 0
    if got != out.nbytes:
        raise DataError(f"{where} ends after {got:,} of its {out.nbytes:,} bytes")
    return out
