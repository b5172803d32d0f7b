"""Parts of a streamed pack: each sample written once, into the format's file.

A fresh tar, LMDB, mmap (.npy) or uncompressed HDF5 pack's samples go into its shards
(data.mdb, encoded.npy or samples.npy, data.h5) as each part is committed
(gpufeed.write.assemble.Stream; by gpufeed.write.writer, and by gpufeed.write.staging for a
source folder), so the part file keeps only the index: each sample's record size, label,
crc32, input, and its place (Part.where: tar shard, offset, size; -1, the LMDB key's index,
-1; -2, the offset in the .npy file, size; or -3, the offset in data.h5, size), not its
bytes. Neither the part nor a shard is fsynced before the pack is finished (an LMDB
transaction is, when committed; records not yet in one are lost with the process): after a
crash, a resume moves the streamed files aside
(DEST.partial/streamed/), reads every kept part's records back from them and checks each
against its crc32; a part that does not check (torn by a power loss, or its shard bytes
lost) is redone: a Writer's first such part with every part after it, a source folder's
(fixed ranges of items) each on its own. The resumed pack is
assembled from the parts as before (gpufeed.write.assemble), and streamed/ is deleted with
DEST.partial when it is finished. A tar pack cut again when it closes (its count known only
then: TarWriter.recut) moves its shards to streamed/ the same way before copying them into the
new cut, so a crash during the copy leaves what a resume reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gpufeed.formats.appended import STREAMED_HDF5
from gpufeed.formats.checksums import raw_crc32
from gpufeed.formats.mmap import data_name
from gpufeed.formats.mmap.writer import STREAMED_MMAP
from gpufeed.formats.npy import parse_header
from gpufeed.formats.parts import Part
from gpufeed.formats.record import record_from_members
from gpufeed.formats.tar.writer import SHARD_FORMAT
from gpufeed.write.ownership import OUT_DIR, STREAMED_DIR

__all__ = ["check_part", "keep_streamed", "load_part"]


def keep_streamed(partial: Path) -> None:
    """On resume: the shards the first run streamed, kept aside for its parts (a later
    resume keeps the same ones: only a fresh pack streams)."""
    out, kept = partial / OUT_DIR, partial / STREAMED_DIR
    if out.exists() and not kept.exists():
        os.rename(out, kept)


def load_part(path: Path, partial: Path) -> Part:
    """The part at ``path``, its payload read back from the streamed shards if it was saved
    without it (ValueError or OSError when they do not hold it)."""
    part = Part.load(path)
    if part.where is None or not len(part):
        return part
    if int(part.where[0, 0]) in (STREAMED_MMAP, STREAMED_HDF5):
        part.payload = _from_appended(part, partial)
        return part
    if int(part.where[0, 0]) < 0:
        records = _from_lmdb(part.where[:, 1], partial / STREAMED_DIR)
    else:
        records = _from_shards(part.spec.schema, part.where, partial / STREAMED_DIR)
    if not np.array_equal(np.diff(part.offsets), [len(r) for r in records]):
        raise ValueError(f"{path}: the shards' records are not the sizes the part recorded")
    part.payload = np.frombuffer(b"".join(records), dtype=np.uint8)
    return part


def _from_appended(part: Part, partial: Path) -> np.ndarray:
    """The part's payload from the streamed file (formats.appended) kept in streamed/:
    mmap's .npy file, or HDF5's data.h5. Its samples' (marker, offset, size) rows checked
    first (the part file is untrusted: every span inside the file, past an .npy header, the
    sizes the part recorded), then read in one pread where they lie back to back, as the
    writer put them."""
    marker = int(part.where[0, 0])
    mmap = marker == STREAMED_MMAP
    path = partial / STREAMED_DIR / (data_name(part.spec.kind) if mmap else _hdf5_name())
    where = np.asarray(part.where)
    if where.ndim != 2 or where.shape != (len(part), 3) or where.dtype.kind not in "iu":
        raise ValueError(f"{path}: the part's places are {where.dtype}{list(where.shape)}")
    where = where.astype(np.int64, copy=False)
    starts, sizes = where[:, 1], where[:, 2]
    if (where[:, 0] != marker).any() or not np.array_equal(sizes, np.diff(part.offsets)):
        raise ValueError(f"{path}: the part's places are not its samples' in this file")
    fd = os.open(path, os.O_RDONLY)
    try:
        head = _npy_data_start(fd) if mmap else 0
        size = os.fstat(fd).st_size
        outside = (starts < head) | (sizes < 0) | (starts > size - sizes)  # no sum to wrap
        if outside.any():
            raise ValueError(f"{path}: a sample the part names lies outside its data")
        if len(starts) < 2 or np.array_equal(starts[1:], starts[:-1] + sizes[:-1]):
            span = _pread(fd, int(sizes.sum()), int(starts[0]) if len(starts) else head)
        else:
            span = b"".join(
                _pread(fd, b, a) for a, b in zip(starts.tolist(), sizes.tolist(), strict=True)
            )
    finally:
        os.close(fd)
    return np.frombuffer(span, dtype=np.uint8)


def _hdf5_name() -> str:
    from gpufeed.formats.hdf5 import FILE_NAME  # h5py: imported where an HDF5 pack resumes

    return FILE_NAME


def _pread(fd: int, size: int, offset: int) -> bytearray:
    """``size`` bytes at ``offset``, in reads of at most 1 GiB (one read stops short of 2 GiB)."""
    span, at = bytearray(size), 0
    view = memoryview(span)
    while at < size:
        got = os.preadv(fd, [view[at : at + (1 << 30)]], offset + at)
        if got <= 0:
            raise ValueError(f"the streamed file is cut short at byte {offset + at:,}")
        at += got
    return span


def _from_shards(schema, where: np.ndarray, kept: Path) -> list[bytes]:
    """Records from tar shards: each sample's members at (shard, offset, size), or (no
    schema: a folder's files, gpufeed.write.staging) its one member's data there."""
    fds: dict[int, int] = {}
    records = []
    try:
        for shard, offset, size in where.tolist():
            if shard not in fds:
                fds[shard] = os.open(kept / SHARD_FORMAT.format(shard), os.O_RDONLY)
            span = os.pread(fds[shard], size, offset)
            if len(span) != size:
                raise ValueError(f"shard {shard} is cut short")
            records.append(record_from_members(schema, span) if schema is not None else span)
    finally:
        for fd in fds.values():
            os.close(fd)
    return records


def _from_lmdb(indices: np.ndarray, kept: Path) -> list[bytes]:
    """Records from the streamed data.mdb, by key (records of a transaction not committed
    before the crash are missing: a KeyError)."""
    import lmdb

    from gpufeed.formats.lmdb.keys import keys

    env = lmdb.open(str(kept), subdir=True, readonly=True, lock=False, readahead=False)
    try:
        with env.begin() as txn:
            records = [txn.get(k) for k in keys(indices)]
    finally:
        env.close()
    if any(r is None for r in records):
        raise KeyError("a record the part names is not in the streamed data.mdb")
    return records


def check_part(path: Path, partial: Path) -> Part | None:
    """The part at ``path`` read whole (its payload from the streamed shards if need be) and
    checked, or None when it is torn: unreadable (a zip member's CRC-32 included), its index
    arrays of the wrong lengths, or a sample whose crc32 is not the one recorded. What a
    resume trusts of a part that was not fsynced."""
    try:
        part = load_part(path, partial)
    except Exception:  # noqa: BLE001 - any failure to read it back: the part is torn
        return None
    n = len(part.labels)
    lengths = (len(part.offsets) - 1, len(part.crc32), len(part.items), len(part.exts))
    if any(k != n for k in lengths) or (n and int(part.offsets[-1]) != len(part.payload)):
        return None
    if n and (int(part.offsets[0]) != 0 or bool((np.diff(part.offsets) < 0).any())):
        return None
    view = memoryview(part.payload)
    bounds = part.offsets.tolist()
    for j, want in enumerate(part.crc32.tolist()):
        if raw_crc32(view[bounds[j] : bounds[j + 1]]) != want:
            return None
    return part


def _npy_data_start(fd: int) -> int:
    """Where the samples start in the streamed .npy file open as ``fd`` (after its header,
    read by the one parser of untrusted .npy headers; ValueError when it has none)."""
    with open(os.dup(fd), "rb") as f:
        parse_header(f)
        return f.tell()
