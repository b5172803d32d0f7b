"""Reading mapped files ahead: ask the kernel for a batch's pages before they are copied.

Samples at least ``PREFETCH_MIN_BYTES`` big are asked for ahead (madvise WILLNEED) before a
batch is copied out of a mapped file: cold, the kernel then reads the whole batch with many
requests in flight instead of one page fault (and its read-around) at a time. Smaller samples
are left to the kernel's readahead: for them the call costs more than it saves. A hint only:
failures are ignored, since the copy that follows faults the pages in anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "IN_FLIGHT_BATCHES",
    "IN_FLIGHT_THREADS",
    "PREFETCH_MIN_BYTES",
    "ReadsInFlight",
    "advise_buffers",
    "advise_rows",
    "advise_samples",
    "advise_willneed",
    "byte_runs",
    "is_cached",
    "read_rows_ahead",
    "read_spans_ahead",
    "reads_in_flight",
    "is_run",
    "take_rows",
]

PREFETCH_MIN_BYTES = 64 << 10
_MADV_WILLNEED = 3


@functools.lru_cache(maxsize=1)
def _madvise():
    if not hasattr(mmap, "MADV_WILLNEED"):  # not Linux/BSD: nothing to ask for
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def is_run(indices: np.ndarray) -> bool:
    """Two or more consecutive indices in increasing order (what sequential epochs read)."""
    n = len(indices)
    return (
        n > 1
        and int(indices[-1]) - int(indices[0]) == n - 1
        and bool(np.all(np.diff(indices) == 1))
    )


def take_rows(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[j] = data[indices[j]]. numpy's default mode="raise" copies through a buffer when
    given ``out`` (twice the copying, see docs/benchmarks.md); the indices were range-checked
    by the dataset, so "clip" never clips here."""
    return np.take(data, indices, axis=0, out=out, mode="clip")


def advise_willneed(regions: Iterable[tuple[int, int]]) -> None:
    """Start reading (address, length) ranges of memory-mapped files into the page cache.

    A hint only: it returns at once (the reads complete in the background) and failures are
    ignored, since the copy that follows faults the pages in anyway.
    """
    fn = _madvise()
    if fn is None:
        return
    page = mmap.PAGESIZE
    for addr, length in regions:
        start = addr - addr % page
        fn(start, length + (addr - start), _MADV_WILLNEED)


def advise_rows(data: np.ndarray, indices: np.ndarray) -> None:
    """WILLNEED for rows ``indices`` of a C-contiguous mapped array, when rows are large."""
    row = data.strides[0] if data.ndim else 0
    if row < PREFETCH_MIN_BYTES or not data.flags.c_contiguous or len(indices) < 2:
        return
    base = data.ctypes.data
    advise_willneed((base + int(i) * row, row) for i in np.sort(indices))


def advise_samples(data: np.ndarray, offsets: np.ndarray | None, indices: np.ndarray) -> None:
    """WILLNEED for samples ``indices`` of a mapped array: rows of fixed-shape samples
    (``offsets`` None), else the encoded spans ``data[offsets[i]:offsets[i + 1]]``."""
    if offsets is None:
        advise_rows(data, indices)
    else:
        advise_buffers([data[offsets[i] : offsets[i + 1]] for i in indices])


def advise_buffers(buffers: Sequence, sizes: Sequence[int] | None = None) -> None:
    """WILLNEED for buffers that point into a mapped file (LMDB values, memmap slices)."""
    if len(buffers) < 2:
        return
    if sizes is None:
        sizes = list(map(len, buffers))
    if sum(sizes) < PREFETCH_MIN_BYTES * len(sizes):
        return
    advise_willneed(
        (np.frombuffer(b, dtype=np.uint8).ctypes.data, n)
        for b, n in zip(buffers, sizes, strict=True)
        if n
    )


# ------------------------------------------------------------------ reads in flight

# Cold random reads in one stream wait for each page fault in turn; FFCV keeps several reads
# in flight on threads. A reader with reads in flight has IN_FLIGHT_THREADS threads pread the
# byte runs of the batches IN_FLIGHT_BATCHES ahead into the page cache (into a scratch buffer
# each, so memory stays bounded), while the batch at hand is copied out of the map.
IN_FLIGHT_THREADS = 4
IN_FLIGHT_BATCHES = 4
_SCRATCH_BYTES = 1 << 20
# runs closer than this are read as one (the gap costs less than another request)
_RUN_GAP = 64 << 10


def byte_runs(starts: np.ndarray, ends: np.ndarray, gap: int = _RUN_GAP) -> list[tuple[int, int]]:
    """(offset, length) runs covering the byte ranges [starts, ends), sorted, ranges less than
    ``gap`` apart merged."""
    order = np.argsort(starts, kind="stable")
    starts, ends = np.asarray(starts)[order], np.maximum.accumulate(np.asarray(ends)[order])
    if len(starts) == 0:
        return []
    breaks = np.flatnonzero(starts[1:] > ends[:-1] + gap) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks - 1, [len(starts) - 1]))
    return [(int(starts[a]), int(ends[b] - starts[a])) for a, b in zip(firsts, lasts, strict=True)]


def is_cached(fd: int, offset: int, probe: bytearray | None = None) -> bool:
    """Whether the page at ``offset`` of ``fd`` is in the page cache: a one-byte read that
    must not wait (RWF_NOWAIT) into ``probe``."""
    probe = bytearray(1) if probe is None else probe
    try:
        return os.preadv(fd, [probe], offset, os.RWF_NOWAIT) > 0
    except BlockingIOError:
        return False
    except OSError:
        return False  # RWF_NOWAIT refused (old kernel, some filesystems): read it


class ReadsInFlight:
    """A bounded pool of threads that bring byte runs of one file into the page cache ahead
    of the copy that needs them: :meth:`submit` returns at once; at most ``threads`` reads
    run and ``threads * depth`` wait; more are dropped (the copy faults those pages in
    anyway). Runs already cached are skipped after one non-blocking probe. Per process:
    a forked child makes its own (threads do not survive fork)."""

    def __init__(self, path, threads: int = IN_FLIGHT_THREADS, depth: int = IN_FLIGHT_BATCHES):
        self.path, self.threads, self.depth = str(path), threads, depth
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gpufeed-read")
        self._pending: deque = deque()
        self._local = threading.local()

    def submit(self, runs: Sequence[tuple[int, int]]) -> bool:
        """Read ``runs`` ((offset, length), sorted) in the background; False when dropped."""
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        if len(self._pending) >= self.threads * self.depth or not runs:
            return False
        for part in np.array_split(np.arange(len(runs)), min(self.threads, len(runs))):
            self._pending.append(self._pool.submit(self._read, [runs[i] for i in part]))
        return True

    def _read(self, runs: list[tuple[int, int]]) -> None:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = (bytearray(_SCRATCH_BYTES), bytearray(1))
        buf, probe = memoryview(scratch[0]), scratch[1]
        for offset, length in runs:
            if is_cached(self._fd, offset, probe) and is_cached(
                self._fd, offset + length - 1, probe
            ):
                continue
            end = offset + length
            while offset < end:
                n = os.preadv(self._fd, [buf[: min(end - offset, _SCRATCH_BYTES)]], offset)
                if n <= 0:
                    break
                offset += n

    def drain(self) -> None:
        """Wait for the reads submitted so far (their errors are dropped: hints only)."""
        while self._pending:
            self._pending.popleft().exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        os.close(self._fd)


_IN_FLIGHT: dict[tuple[int, str], ReadsInFlight] = {}


def reads_in_flight(path) -> ReadsInFlight:
    """This process's :class:`ReadsInFlight` for the file ``path`` (one per file and process:
    a forked child makes its own)."""
    key = (os.getpid(), str(path))
    found = _IN_FLIGHT.get(key)
    if found is None:
        found = _IN_FLIGHT[key] = ReadsInFlight(path)
    return found


def read_rows_ahead(path, data_offset: int, row_bytes: int, indices: np.ndarray) -> None:
    """Reads in flight for rows ``indices`` of fixed-size rows starting at ``data_offset``."""
    starts = data_offset + np.asarray(indices, dtype=np.int64) * row_bytes
    reads_in_flight(path).submit(byte_runs(starts, starts + row_bytes))


def read_spans_ahead(path, data_offset: int, offsets: np.ndarray, indices: np.ndarray) -> None:
    """Reads in flight for the spans ``offsets[i]:offsets[i + 1]`` (from ``data_offset``)."""
    indices = np.asarray(indices, dtype=np.int64)
    starts, ends = offsets[indices] + data_offset, offsets[indices + 1] + data_offset
    reads_in_flight(path).submit(byte_runs(starts, ends))
