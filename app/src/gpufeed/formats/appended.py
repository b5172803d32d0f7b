"""A format file written as a stream: a fixed-size head, then the samples' bytes appended as
each part is committed (gpufeed.write.assemble.Stream), the head written last when the count
is known (an .npy header's shape; HDF5 moves the bytes into its file).

The bytes go in by os.pwrite from the caller's buffer (no map: a write into a hole on a full
disk through a map is a SIGBUS, a pwrite an ENOSPC), into room reserved ahead in large steps
(formats.files.preallocate), so a full disk is a DiskFullError naming the file. Nothing is
fsynced until :meth:`AppendedFile.finish` (a resume checks every sample the parts name against
its crc32: gpufeed.write.direct).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gpufeed.errors import DiskFullError
from gpufeed.formats.checksums import HASH_CHUNK, sha256_fd
from gpufeed.formats.files import kernel_copy, preallocate, start_writeback

__all__ = [
    "STREAMED_HDF5",
    "AppendedFile",
    "copy_range",
    "npy_head",
    "synced_and_hashed",
]

# Part.where's first column for a sample in a streamed HDF5 pack's data.h5 (gpufeed.formats.hdf5;
# mmap's: formats.mmap.writer.STREAMED_MMAP; gpufeed.write.direct)
STREAMED_HDF5 = -3

# room reserved past the end at a time: at least this much, or a quarter of what is there
# (few fallocate calls, and little given back by the truncate at the end)
RESERVE_STEP = 64 << 20


def npy_head(dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy header np.lib.format.open_memmap writes for an array of ``dtype`` and
    ``shape`` (format 1.0, else 2.0 when it does not fit). numpy pads it so the first axis
    may grow to GROWTH_AXIS_MAX_DIGITS digits: a header written for 0 rows has the length of
    the one for the final count, and is rewritten in place."""
    fmt = np.lib.format
    header = {"descr": fmt.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(shape)}  # fmt: skip
    buf = io.BytesIO()
    try:
        fmt.write_array_header_1_0(buf, header)
    except ValueError:  # over 65,535 bytes: the 2.0 header, as open_memmap picks
        buf = io.BytesIO()
        fmt.write_array_header_2_0(buf, header)
    return buf.getvalue()


def synced_and_hashed(fd: int, size: int, hashed: bool = True) -> Future:
    """In threads: ``fd`` fsynced and, where ``hashed``, the sha256 of its first ``size``
    bytes made meanwhile (from the page cache), then ``fd`` closed. Returns the future of
    the sha256 (None unless hashed), which raises the fsync's error."""
    pool = ThreadPoolExecutor(2, thread_name_prefix="gpufeed-finish")
    synced = pool.submit(os.fsync, fd)
    done = pool.submit(_hash_and_close, fd, size, hashed, synced)
    pool.shutdown(wait=False)
    return done


def copy_range(src: int, dst: int, size: int, src_at: int, dst_at: int) -> None:
    """``size`` bytes of ``src`` at ``src_at`` written to ``dst`` at ``dst_at``: by the kernel
    (files.kernel_copy), or read and written where it cannot (another file system, an old
    kernel); never short."""
    done = kernel_copy(src, dst, size, src_at, dst_at)
    if done == size:
        return
    buf = np.empty(min(HASH_CHUNK, size - done), np.uint8)
    view = memoryview(buf)
    while done < size:
        got = os.preadv(src, [view[: min(len(buf), size - done)]], src_at + done)
        if got <= 0:
            raise OSError(f"the file to copy is cut short at byte {src_at + done:,}")
        put = 0
        while put < got:
            put += os.pwrite(dst, view[put:got], dst_at + done + put)
        done += got


def _hash_and_close(fd: int, size: int, hashed: bool, synced: Future) -> str | None:
    """The file's sha256 (``hashed``), once it is fsynced (``synced``, raised), then closed."""
    try:
        digest = sha256_fd(fd, size) if hashed else None
        synced.result()
        return digest
    finally:
        os.close(fd)


class AppendedFile:
    """One file: ``head_size`` bytes kept for a head written at the end, then the bytes of
    :meth:`append` back to back. ``end``: where the next byte goes (the file's size once
    finished)."""

    def __init__(self, path: Path, head: bytes):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.head_size = len(head)
        self.reserved = 0
        self.end = 0
        self.append(head)  # a placeholder: a crash leaves a file its reader refuses

    def fileno(self) -> int:
        return self.fd

    def append(self, buf) -> int:
        """``buf``'s bytes at the end; returns the file offset they start at."""
        view = memoryview(buf).cast("B")
        at, end = self.end, self.end + len(view)
        if end > self.reserved:
            self._reserve(end)
        while view:
            done = os.pwrite(self.fd, view, at)
            view, at = view[done:], at + done
        start, self.end = self.end, end
        start_writeback(self.fd, start, end - start)
        return start

    def _reserve(self, need: int) -> None:
        """Room for ``need`` bytes and a step more; when the step does not fit, exactly
        ``need`` (the disk full only when the samples themselves do not fit)."""
        ahead = max(need, self.reserved + max(RESERVE_STEP, self.reserved // 4))
        try:
            preallocate(self, ahead, self.path)
        except DiskFullError:
            preallocate(self, need, self.path)
            ahead = need
        self.reserved = ahead

    def finish(self, head: bytes | None, hashed: bool = True) -> Future:
        """The reserved room past the end given back and ``head`` written over the
        placeholder (the same size); then, in a thread, the file fsynced (durable before the
        manifest names it) and, where ``hashed``, its sha256 made from the page cache while
        the fsync writes it out; the file closed. Returns that thread's future: the sha256
        (or None), which the caller waits for before it writes the manifest, so the one read
        of the file overlaps the rest of the pack's finishing."""
        if head is not None:
            if len(head) != self.head_size:
                raise RuntimeError(
                    f"{self.path}: the final header is {len(head)} bytes, the space kept for "
                    f"it {self.head_size} (numpy's .npy header padding changed?)"
                )
            os.pwrite(self.fd, head, 0)
        os.ftruncate(self.fd, self.end)
        fd, self.fd = self.fd, -1  # the thread's now: it closes it
        return synced_and_hashed(fd, self.end, hashed)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
