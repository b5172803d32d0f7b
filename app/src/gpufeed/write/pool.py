"""The pack's readers: :func:`load_item` over the source, in order, in-process or in a pool
of worker processes started only when they pay off."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections import deque
from collections.abc import Iterable, Iterator

from gpufeed.errors import PackWorkerError
from gpufeed.write.items import LoadOptions, load_item

__all__ = [
    "CHUNK_BYTES",
    "MAX_CHUNK",
    "chunk_inputs",
    "default_workers",
    "die_with_parent",
    "ordered_map",
]

MAX_DEFAULT_WORKERS = 8
# workers=None reads the first items in-process for up to this long, then starts worker
# processes only if the rest would outlast starting them
PROBE_S = 0.25
# what starting one spawned pack worker (numpy, PIL and torch imported) costs; measured in
# docs/performance/conversion.md. A forked one (where the platform forks) has them already
WORKER_START_S = 2.0
FORK_START_S = 0.25
PR_SET_PDEATHSIG = 1
# a worker chunk carries about this many bytes back, of at most MAX_CHUNK inputs
CHUNK_BYTES = 1 << 20
MAX_CHUNK = 256


# --------------------------------------------------------------------------- pack
def default_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_DEFAULT_WORKERS))


def _run_chunk(paths: list[str], opts: LoadOptions) -> list[tuple]:
    return [load_item(p, opts) for p in paths]


def die_with_parent(parent: int) -> None:
    """Pack worker initializer: the kernel kills this worker when the pack process dies,
    however it dies (kill -9 included), so no worker outlives it holding the caller's
    stdout or the resource tracker's pipe. Linux only (prctl); elsewhere a no-op."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)


def ordered_map(
    paths: Iterable[str],
    opts: LoadOptions,
    workers: int,
    chunk: int = 16,
    measure_total: int | None = None,
) -> Iterator[tuple]:
    """load_item over paths, results in input order, at most a few chunks per worker in
    flight (memory stays bounded however large the source).

    With measure_total (the number of paths), the first items are read in-process for
    PROBE_S and the pool starts only if the rest, split over the workers, saves more than
    WORKER_START_S (for small sources, starting workers costs more than they save: see
    docs/performance/conversion.md)."""
    it = iter(paths)
    if workers > 1 and measure_total is not None:
        done, spent = 0, 0.0
        for p in it:
            t = time.perf_counter()
            res = load_item(p, opts)
            spent += time.perf_counter() - t
            done += 1
            yield res
            if spent >= PROBE_S:
                break
        rest_s = spent / max(done, 1) * (measure_total - done)
        start_s = FORK_START_S if _start_method() == "fork" else WORKER_START_S
        if rest_s * (1 - 1 / workers) <= start_s:
            workers = 1
    if workers <= 1:
        for p in it:
            yield load_item(p, opts)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from itertools import islice

    size = [chunk]  # items a chunk: re-sized from the bytes that come back
    chunks = iter(lambda: list(islice(it, size[0])), [])
    from concurrent.futures.process import BrokenProcessPool

    # forked where the platform forks, as gpufeed.pack(fn, inputs)'s workers: a spawned one
    # imports numpy, PIL and whatever the caller's script imports (torch) again
    # (docs/performance/conversion.md);
    # a worker only reads files and returns bytes (no torch threads, CUDA or h5py handles of
    # the parent's are used), and leaves by os._exit (nothing of the parent's is flushed)
    with ProcessPoolExecutor(
        workers,
        mp_context=mp.get_context(_start_method()),
        initializer=die_with_parent,
        initargs=(os.getpid(),),
    ) as ex:
        pending = deque(ex.submit(_run_chunk, c, opts) for c in islice(chunks, workers * 4))
        while pending:
            try:
                results = pending.popleft().result()
            except BrokenProcessPool:
                raise PackWorkerError(
                    "a pack worker process died (killed, out of memory, or it failed to "
                    "start: where workers are spawned, a script calling gpufeed.pack() needs "
                    "`if __name__ == '__main__':`); committed parts are kept, rerun with "
                    "--resume (or workers=1 to read in-process)"
                ) from None
            loaded = sum(len(r[2]) for r in results if r[0] == "ok")
            size[0] = chunk_inputs(loaded, len(results))
            nxt = next(chunks, None)
            if nxt is not None:
                pending.append(ex.submit(_run_chunk, nxt, opts))
            yield from results


def _start_method() -> str:
    import multiprocessing as mp

    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def chunk_inputs(nbytes: int, count: int) -> int:
    """Inputs a worker chunk holds, from the bytes ``count`` inputs gave: about CHUNK_BYTES
    (each chunk's round trip through a process pool costs the parent and the worker: small
    chunks cost a share of a conversion's CPU, docs/performance/conversion.md), at most
    MAX_CHUNK inputs."""
    per_input = max(nbytes / max(count, 1), 1.0)
    return int(min(MAX_CHUNK, max(1, CHUNK_BYTES // per_input)))
