"""Copying a batch's rows out of an array (a mapped file, a pool of slots) into the batch.

Two threads copy out of a mapped file nearly twice as fast as one
(docs/performance/raw-copies.md, "Large rows copied on two threads"): memory bandwidth is not
the bound of one copy. So rows of at least ``PARALLEL_COPY_MIN_BYTES`` in the page cache are
split between up to ``COPY_THREADS`` threads of the loading process. The calling thread
copies the rest alone: smaller rows, since handing a part to another thread costs more than
copying it, and rows still on disk, which two faulting threads read slower than one (mmap
and HDF5). A DataLoader worker copies on its own thread: there the workers
are the parallelism. Whoever knows a process is a worker says so (:func:`set_copy_threads`:
make_loader's worker init, and a gpufeed dataset read in a plain DataLoader's worker);
this module does not look for torch.

Public: ``take_rows``, ``copy_buffers``, ``copy_threads``, ``set_copy_threads``,
``COPY_THREADS``, ``PARALLEL_COPY_MIN_BYTES``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from gpufeed.pagecache.advise import Background, address, looks_cached, rows_cached
from gpufeed.system import sysinfo

__all__ = [
    "COPY_THREADS",
    "PARALLEL_COPY_MIN_BYTES",
    "copy_buffers",
    "copy_threads",
    "set_copy_threads",
    "take_rows",
]

PARALLEL_COPY_MIN_BYTES = 64 << 10
# at most: a few threads saturate memory bandwidth, more only wait on it
COPY_THREADS = 4

_HELPERS = Background(COPY_THREADS - 1)  # the calling thread is the first copier


def take_rows(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[j] = data[indices[j]], on :func:`copy_threads` threads when rows are large and
    cached.

    numpy's default mode="raise" copies through a buffer when given ``out`` (twice the
    copying, see docs/performance/raw-copies.md); the indices were range-checked by the
    dataset, so "clip" never clips here. numpy releases the GIL while it copies, so the parts run at
    once."""
    n = len(indices)
    large = n > 1 and out.ndim and out[:1].nbytes >= PARALLEL_COPY_MIN_BYTES
    parts = min(n, copy_threads()) if large and rows_cached(data, indices) else 1
    _in_parts(n, parts, lambda a, b: _take(data, indices[a:b], out[a:b]))
    return out


def copy_buffers(buffers: Sequence, out: np.ndarray) -> np.ndarray:
    """out[j] = buffers[j] for buffers of ``out[j].nbytes`` bytes each (LMDB values, rows of
    a tar shard's map): ``out`` viewed as [len(buffers), row bytes] uint8. On
    :func:`copy_threads` threads when they are large and the first and last look cached
    (numpy releases the GIL for each row's copy)."""
    n = len(buffers)
    rows = out.reshape(n, -1).view(np.uint8)
    large = n > 1 and rows.shape[1] >= PARALLEL_COPY_MIN_BYTES
    parts = min(n, copy_threads()) if large and _buffers_cached(buffers) else 1
    _in_parts(n, parts, lambda a, b: _assign(buffers, a, b, rows))
    return out


def _in_parts(n: int, parts: int, copy: Callable[[int, int], object]) -> None:
    """copy(a, b) for ``parts`` consecutive parts of range(n): the first on this thread, the
    others on helper threads. A part whose thread has not started when this thread is done
    with its own is copied here, so a batch never waits for a helper to be scheduled."""
    if parts <= 1:
        copy(0, n)
        return
    bounds = np.linspace(0, n, parts + 1).astype(int).tolist()
    jobs = [
        (_HELPERS.submit(copy, a, b), a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    copy(0, bounds[1])
    for job, a, b in jobs:
        if job.cancel():
            copy(a, b)
        else:
            job.result()


def _take(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    return np.take(data, indices, axis=0, out=out, mode="clip")


def _assign(buffers: Sequence, a: int, b: int, rows: np.ndarray) -> None:
    for j in range(a, b):
        rows[j] = np.frombuffer(buffers[j], dtype=np.uint8)


def _buffers_cached(buffers: Sequence) -> bool:
    return all(looks_cached(address(b), len(b)) for b in (buffers[0], buffers[-1]))


def copy_threads() -> int:
    """Threads a batch's copy may use in this process: what :func:`set_copy_threads` set
    here (1 in a DataLoader worker), else the loader's CPUs (sysinfo.process_loader_cpus),
    at most ``COPY_THREADS``."""
    pid, threads = _SET
    if threads is not None and pid == os.getpid():
        return threads
    return max(1, min(COPY_THREADS, sysinfo.process_loader_cpus()))


def set_copy_threads(threads: int | None) -> None:
    """The copy threads of this process from now on (None: the default of
    :func:`copy_threads`); a child forked later does not inherit it."""
    global _SET
    _SET = (os.getpid(), None if threads is None else max(1, int(threads)))


_SET: tuple[int | None, int | None] = (None, None)  # (the process that set it, its threads)
