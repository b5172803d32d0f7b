"""Reading mapped files ahead: ask the kernel for a batch's pages before they are copied.

Samples at least ``READ_AHEAD_MIN_BYTES`` big are asked for ahead (madvise WILLNEED) before a
batch is copied out of a mapped file: cold, the kernel then reads the whole batch with many
requests in flight instead of one page fault (and its read-around) at a time. Smaller samples
are left to the kernel's readahead: for them the call costs more than it saves. A hint only:
failures are ignored, since the copy that follows faults the pages in anyway.

Whole blocks of small samples a window ahead (``Reader.read_ahead_ranges``) are advised from
``Background`` threads: LMDB with ``populate_ahead``; mmap and mapped HDF5 with
``BlocksAhead``, which keeps a job a block so that a batch waits for (or reads itself) only
the blocks it copies, never the queue of blocks announced before them.

Whether a range is cached is mincore's answer (:func:`looks_cached`), except for a file
this process neither owns nor may write, where the readers ask the file instead
(gpufeed.pagecache.probe). Every check here takes the reader's answer (``cached``).

The public interface (what the formats call):

- asking ahead (WILLNEED, returns at once): ``advise_willneed`` (ranges), ``ask`` and
  ``ask_unless_cached`` (one range), ``advise_rows``, ``advise_samples``, ``advise_buffers``
  (a batch's samples, when large and not cached);
- reading in and mapping (MADV_POPULATE_READ, waited for): ``populate``, and
  ``populate_ahead`` on a :class:`Background`'s threads;
- blocks of an epoch's order a window ahead: :class:`BlocksAhead`;
- what is cached: ``looks_cached``, ``rows_cached``, ``looks_warm``, ``map_looks_warm``;
- ``address`` (a buffer's place in its map), ``is_run``, and the constants
  ``READ_AHEAD_MIN_BYTES``, ``READ_AHEAD_THREADS``, ``WARM_PROBES``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import repeat

import numpy as np

from gpufeed.pagecache.probe import checked_points

__all__ = [
    "READ_AHEAD_MIN_BYTES",
    "READ_AHEAD_THREADS",
    "WARM_PROBES",
    "Background",
    "BlocksAhead",
    "address",
    "advise_buffers",
    "advise_rows",
    "advise_samples",
    "advise_willneed",
    "ask",
    "ask_unless_cached",
    "is_run",
    "looks_cached",
    "looks_warm",
    "map_looks_warm",
    "populate",
    "populate_ahead",
    "rows_cached",
]

READ_AHEAD_MIN_BYTES = 64 << 10
# threads a reader populates blocks ahead on: two reads in flight read about twice as fast as
# one (docs/performance/lmdb-reads.md, "Reads in flight: blocks on a line")
READ_AHEAD_THREADS = 2
_MADV_WILLNEED = 3


def _libc_function(name: str, *argtypes):
    """libc's `name` taking (address, length, argtypes...) and returning int; None where absent."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *argtypes]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def _mincore():
    return _libc_function("mincore", ctypes.c_void_p)


def looks_cached(addr: int, length: int) -> bool:
    """Whether the pages of a mapped range that pagecache.checked_points names (its first,
    middle and last) are in the page cache, by mincore. False when it cannot tell."""
    fn = _mincore()
    if fn is None or length <= 0:
        return False
    page = mmap.PAGESIZE
    for at in checked_points(addr, length):
        if fn(at - at % page, page, _VEC) != 0 or not _VEC[0] & 1:
            return False
    return True


_VEC = (ctypes.c_ubyte * 1)()  # mincore's answer for one page

# how a reader tells whether an (address, length) range of its map is cached
Cached = Callable[[int, int], bool]


# pages looked at, spread over a reader's sample bytes, before an epoch read ahead by block
# (Reader.looks_warm): all cached, the epoch announces no block (the checks that find each
# block cached cost warm passes: docs/performance/page-cache-read-ahead.md, "A warm epoch
# announces nothing")
WARM_PROBES = 64


def looks_warm(spans: Iterable[tuple[int, int]], cached: Cached | None = None) -> bool:
    """Whether WARM_PROBES bytes spread evenly over mapped (address, length) ``spans`` (by
    their bytes, first and last included) all lie in cached pages (``cached``,
    :func:`looks_cached` by default). False for no bytes, or when it cannot tell."""
    spans = [(int(a), int(n)) for a, n in spans if n > 0]
    if not spans:
        return False
    ends = np.cumsum([n for _, n in spans])
    check = cached or looks_cached
    at = np.linspace(0, int(ends[-1]) - 1, WARM_PROBES).astype(np.int64)
    which = np.searchsorted(ends, at, side="right")
    for k, i in zip(at.tolist(), which.tolist(), strict=True):
        addr, n = spans[i]
        if not check(addr + k - (int(ends[i]) - n), 1):
            return False
    return True


def map_looks_warm(data, cached: Cached | None = None) -> bool:
    """:func:`looks_warm` over a mapped array's bytes (the handle of an mmap or mapped HDF5
    reader); False for anything else (an h5py dataset read through its cache)."""
    return isinstance(data, np.ndarray) and looks_warm(((data.ctypes.data, data.nbytes),), cached)


def rows_cached(data: np.ndarray, indices: np.ndarray, cached: Cached | None = None) -> bool:
    """Whether the first and last of rows ``indices`` of an array look cached (``cached``,
    :func:`looks_cached` by default); True for no rows and for rows not contiguous in
    themselves (not a mapped file's rows)."""
    if data.ndim == 0 or len(indices) == 0 or len(data) == 0 or not data[0].flags.c_contiguous:
        return True
    stride, size, base = data.strides[0], data[0].nbytes, data.ctypes.data
    cached = cached or looks_cached
    return all(cached(base + int(i) * stride, size) for i in (indices[0], indices[-1]))


@functools.lru_cache(maxsize=1)
def _madvise():
    if not hasattr(mmap, "MADV_WILLNEED"):  # not Linux/BSD: nothing to ask for
        return None
    return _libc_function("madvise", ctypes.c_int)


def is_run(indices: np.ndarray) -> bool:
    """Two or more consecutive indices in increasing order (what sequential epochs read)."""
    n = len(indices)
    return (
        n > 1
        and int(indices[-1]) - int(indices[0]) == n - 1
        and bool(np.all(np.diff(indices) == 1))
    )


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


_MADV_POPULATE_READ = 22  # Linux 5.14+


def populate(addr: int, length: int) -> None:
    """Read an (address, length) range of a mapped file into the page cache *and* map it
    into this process (MADV_POPULATE_READ, Linux 5.14+): what the page faults of a later
    copy would do, done now in the calling thread (the GIL released) and waited for.
    Where the kernel refuses it, WILLNEED (the copy faults the pages in anyway)."""
    fn = _madvise()
    if fn is not None:
        start = addr - addr % mmap.PAGESIZE
        length += addr - start
        if fn(start, length, _MADV_POPULATE_READ) != 0:  # an older kernel, or past the end
            fn(start, length, _MADV_WILLNEED)


def populate_ahead(
    background: Background, regions: Iterable[tuple[int, int]], cached: Cached | None = None
) -> None:
    """Populate (address, length) ranges on ``background``'s threads, one job a range,
    leaving out those that look cached (``cached``, :func:`looks_cached` by default), so a
    warm pass wakes no thread."""
    for addr, length in regions:
        _populate_job(background, addr, length, cached)


def _populate_job(
    background: Background,
    addr: int,
    length: int,
    cached: Cached | None = None,
    work: Callable[[int, int], None] | None = None,
):
    """The job reading a range in on ``background``'s threads (``work``: :func:`populate`
    by default), or None for a range not :func:`_worth_reading`."""
    if _worth_reading(addr, length, cached):
        return background.submit(work or populate, addr, length)
    return None


def _worth_reading(addr: int, length: int, cached: Cached | None = None) -> bool:
    """Whether a mapped range is worth reading in: not empty, and not looking cached
    (``cached``, :func:`looks_cached` by default)."""
    return length > 0 and not (cached or looks_cached)(addr, length)


def ask(addr: int, length: int) -> None:
    """WILLNEED for one (address, length) range: the kernel queues its reads and returns."""
    advise_willneed(((addr, length),))


def ask_unless_cached(addr: int, length: int, cached: Cached | None = None) -> None:
    """:func:`ask`, unless the range looks cached (``cached``, :func:`looks_cached` by
    default): the advice walks every page it names, a cost a warm tar stream felt
    (docs/performance/tar-stream.md, "WILLNEED a run, only for cold runs")."""
    if _worth_reading(addr, length, cached):
        ask(addr, length)


def advise_rows(data: np.ndarray, indices: np.ndarray, cached: Cached | None = None) -> None:
    """WILLNEED for rows ``indices`` of a C-contiguous mapped array, when rows are large and
    not already cached (:func:`rows_cached`: the advice walks every page it names, a cost a
    warm batch's copy of large rows felt: docs/performance/raw-copies.md)."""
    row = data.strides[0] if data.ndim else 0
    if row < READ_AHEAD_MIN_BYTES or not data.flags.c_contiguous or len(indices) < 2:
        return
    if rows_cached(data, indices, cached):
        return
    base = data.ctypes.data
    advise_willneed((base + int(i) * row, row) for i in np.sort(indices))


def _sample_range_spans(data: np.ndarray, offsets: np.ndarray | None, ranges):
    """(first index, address, length) of the samples of index ranges ``[start, stop)`` of a
    mapped array (stops past the end are clipped; empty ranges left out): rows of
    fixed-shape samples (``offsets`` None, C-contiguous arrays only), else the encoded bytes
    from ``offsets[start]`` to ``offsets[stop]``."""
    base = data.ctypes.data
    if offsets is None:
        if data.ndim == 0 or not data.flags.c_contiguous:
            return
        n, row = len(data), data.strides[0]
        for a, b in ranges:
            a, b = int(a), min(int(b), n)
            if b > a:
                yield a, base + a * row, (b - a) * row
        return
    n = len(offsets) - 1
    for a, b in ranges:
        a, b = int(a), min(int(b), n)
        if b > a:
            lo, hi = int(offsets[a]), int(offsets[b])
            if hi > lo:
                yield a, base + lo, hi - lo


def advise_samples(
    data: np.ndarray, offsets: np.ndarray | None, indices: np.ndarray, cached: Cached | None = None
) -> None:
    """WILLNEED for samples ``indices`` of a mapped array: rows of fixed-shape samples
    (``offsets`` None), else the encoded spans ``data[offsets[i]:offsets[i + 1]]``."""
    if offsets is None:
        advise_rows(data, indices, cached)
    else:
        advise_buffers([data[offsets[i] : offsets[i + 1]] for i in indices], cached=cached)


def advise_buffers(
    buffers: Sequence, sizes: Sequence[int] | None = None, cached: Cached | None = None
) -> None:
    """WILLNEED for buffers that point into a mapped file (LMDB values, memmap slices), when
    they are large and the first and last do not both look cached (see advise_rows)."""
    if len(buffers) < 2:
        return
    if sizes is None:
        sizes = list(map(len, buffers))
    if sum(sizes) < READ_AHEAD_MIN_BYTES * len(sizes):
        return
    cached = cached or looks_cached
    if all(cached(address(buffers[j]), sizes[j]) for j in (0, -1) if sizes[j]):
        return
    advise_willneed(
        (np.frombuffer(b, dtype=np.uint8).ctypes.data, n)
        for b, n in zip(buffers, sizes, strict=True)
        if n
    )


def address(buffer) -> int:
    """Where a buffer's bytes lie in memory (an LMDB value's place in its map)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


class Background:
    """Page-cache work (:func:`populate`) run on a few threads of this process, so that
    its reads and page mappings wait there, not in the thread that copies batches, and
    several reads are in flight at once.

    The pool is made on first use in the process that submits (threads do not survive a
    fork: a child makes its own), drained before every fork (no thread holds a lock the
    child inherits) and by ``drain``, which a reader calls before it closes what the jobs
    read. Pickled without its pool. Job errors are dropped: a hint that fails leaves the
    read that follows to fault its pages itself.
    """

    def __init__(self, threads: int = 1):
        self.threads = int(threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None

    def submit(self, fn: Callable, *args) -> Future:
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpufeed-ahead")
            self._pid = pid
            _LIVE.add(self)
        return self._pool.submit(fn, *args)

    def drain(self) -> None:
        """Cancel the jobs not started, wait for the running ones, end the threads."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self):
        return {"threads": self.threads, "_pool": None, "_pid": None}


class BlocksAhead:
    """Blocks of samples asked for ahead on ``threads`` threads, in the order announced, one
    job a block kept by the block's first index, and a batch's own blocks made ready before
    it is copied (:meth:`ready`): a job not started is cancelled and the block populated by
    the batch's thread (it does not wait behind the blocks announced before it), a running
    one is waited for. A job asks for its block (:func:`ask`, WILLNEED): the kernel keeps
    every announced block's reads in flight, and the pages are not mapped into the process
    until copied. Populating them on the threads instead (MADV_POPULATE_READ, up to
    ``threads`` blocks in flight, mapped) read cold shuffled map-style passes no faster, and
    slower under a memory limit smaller than the pack
    (docs/performance/page-cache-read-ahead.md, "Blocks asked for, not populated");
    a tar stream's runs are still populated (``announce(mapped=True)``). Blocks that look
    cached are skipped when announced (a warm pass wakes no thread). Drained with its pool
    (before every fork, and by the reader before it closes its map).
    """

    def __init__(self, threads: int = READ_AHEAD_THREADS):
        self.background = Background(threads)
        self._jobs: dict[int, tuple[Future, int, int]] = {}
        self._block = 0  # indices a block (the first range's length)
        self._pid = os.getpid()
        self.cached: Cached | None = None  # how to tell a cached block (looks_cached)

    def announce(self, spans: Iterable[tuple[int, int, int]], mapped: bool = False) -> None:
        """Start reading (first index, address, length) spans of blocks of equal size in:
        asked for (:func:`ask`), or populated when ``mapped`` (a stream's runs, read next
        and in order: pages asked for but not mapped were evicted before their run under a
        memory limit; docs/performance/page-cache-read-ahead.md)."""
        self._own_process()
        work = populate if mapped else ask
        for first, addr, length in spans:
            if first not in self._jobs:
                job = _populate_job(self.background, addr, length, self.cached, work)
                if job is not None:
                    self._jobs[first] = (job, addr, length)

    def announce_ranges(self, data: np.ndarray, offsets: np.ndarray | None, ranges) -> None:
        """:meth:`announce` for index ranges ``[start, stop)`` of a mapped array."""
        ranges = list(ranges)
        self.announce_blocks(ranges, _sample_range_spans(data, offsets, ranges))

    def announce_blocks(self, ranges: list, spans: Iterable[tuple[int, int, int]]) -> None:
        """:meth:`announce` the spans of blocks ``ranges`` (index ranges ``[start, stop)``
        of one size, each span keyed by its block's start), so that :meth:`ready` finds a
        batch's blocks by its indices."""
        if ranges and not self._block:
            self._block = int(ranges[0][1]) - int(ranges[0][0])
        self.announce(spans)

    def ready(self, indices: np.ndarray) -> None:
        """Make the blocks holding ``indices`` resident before they are copied."""
        if not self._jobs or self._block < 1:
            return
        firsts = np.unique(np.asarray(indices, dtype=np.int64) // self._block) * self._block
        self.ready_blocks(firsts.tolist())

    def ready_blocks(self, firsts: Iterable[int]) -> None:
        """Make the blocks announced as starting at ``firsts`` resident (:meth:`ready` for
        blocks of any size, such as a stream's runs of samples)."""
        if not self._jobs:
            return
        self._own_process()
        jobs = [job for job in map(self._jobs.pop, firsts, repeat(None)) if job]
        running = []
        for future, addr, length in reversed(jobs):  # the threads take the queue's front
            if future.cancel():
                populate(addr, length)
            else:
                running.append(future)
        for future in running:
            _wait(future)

    def forget(self, firsts: Iterable[int]) -> None:
        """Drop blocks that will not be read after all (a stream stopped early): those not
        started are cancelled, running ones finish on their own."""
        self._own_process()
        for first in firsts:
            job = self._jobs.pop(first, None)
            if job is not None:
                job[0].cancel()

    def pending(self) -> int:
        """Blocks announced and not yet made ready by a batch."""
        return len(self._jobs)

    def drain(self) -> None:
        """Cancel the jobs not started, wait for the running ones, forget every block."""
        self.background.drain()
        self._jobs.clear()

    def _own_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's jobs are not its own
            self._jobs, self._pid = {}, os.getpid()

    def __getstate__(self):
        return {
            "background": self.background,
            "_jobs": {},
            "_block": 0,
            "_pid": None,
            "cached": self.cached,
        }


def _wait(future: Future) -> None:
    """Wait for a job; its error is dropped (the copy faults the pages in itself)."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - a hint that failed
        pass


_LIVE: weakref.WeakSet[Background] = weakref.WeakSet()


def _drain_all() -> None:
    for background in list(_LIVE):
        background.drain()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_drain_all)
