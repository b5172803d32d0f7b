"""Copying a batch's rows out of an array (a mapped file, a pool of slots) into the batch.

One thread copies out of a mapped file at about 8.8 GB/s on the bench machine, two at about
16 (docs/benchmarks.md, "Issue 16: large rows copied on two threads"): memory bandwidth is
not the bound of one copy. So rows of at least ``PARALLEL_COPY_MIN_BYTES`` in the page cache
are split between up to ``COPY_THREADS`` threads of the loading process. The calling thread
copies the rest alone: smaller rows, since handing a part to another thread costs more than
copying it, and rows still on disk, which two faulting threads read 0.6-0.8x as fast as one
(measured, mmap and HDF5). A DataLoader worker copies on its own thread: there the workers
are the parallelism.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

from gpufeed.formats.readahead import Background, rows_cached
from gpufeed.system import sysinfo

__all__ = ["COPY_THREADS", "PARALLEL_COPY_MIN_BYTES", "copy_threads", "take_rows"]

PARALLEL_COPY_MIN_BYTES = 64 << 10
# at most: a few threads saturate memory bandwidth, more only wait on it
COPY_THREADS = 4

_HELPERS = Background(COPY_THREADS - 1)  # the calling thread is the first copier


def take_rows(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[j] = data[indices[j]], on :func:`copy_threads` threads when rows are large.

    numpy's default mode="raise" copies through a buffer when given ``out`` (twice the
    copying, see docs/benchmarks.md); the indices were range-checked by the dataset, so
    "clip" never clips here. numpy releases the GIL while it copies, so the parts run at
    once. A part whose thread has not started when the caller is done with its own is
    copied by the caller, so a batch never waits for a helper thread to be scheduled."""
    n = len(indices)
    parts = 1
    if n > 1 and out.ndim and out[:1].nbytes >= PARALLEL_COPY_MIN_BYTES:
        parts = min(n, copy_threads()) if rows_cached(data, indices) else 1
    if parts == 1:
        return _take(data, indices, out)
    bounds = np.linspace(0, n, parts + 1).astype(int).tolist()
    jobs = [
        (_HELPERS.submit(_take, data, indices[a:b], out[a:b]), a, b)
        for a, b in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    _take(data, indices[: bounds[1]], out[: bounds[1]])
    for job, a, b in jobs:
        if job.cancel():
            _take(data, indices[a:b], out[a:b])
        else:
            job.result()
    return out


def _take(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    return np.take(data, indices, axis=0, out=out, mode="clip")


def copy_threads() -> int:
    """Threads a batch's copy may use in this process: 1 in a DataLoader worker, else the
    loader's CPUs (sysinfo.loader_cpus), at most ``COPY_THREADS``."""
    if _in_dataloader_worker():
        return 1
    return _loader_cpus(os.getpid())


@functools.lru_cache(maxsize=4)
def _loader_cpus(pid: int) -> int:  # once a process: it reads the cgroup files
    return max(1, min(COPY_THREADS, sysinfo.loader_cpus()[0]))


def _in_dataloader_worker() -> bool:
    data = sys.modules.get("torch.utils.data")  # not imported: not in a worker
    return data is not None and data.get_worker_info() is not None
