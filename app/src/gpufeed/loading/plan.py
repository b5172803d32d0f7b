"""The worker plan: measure in-process loading against loading through workers, pick the
faster, and say why (:class:`LoaderPlan`).

For cheap samples the worker IPC (one shared-memory segment and a pickle per batch) costs
more than loading in-process; for decode-bound ones workers win. So ``num_workers="auto"``
measures both paths on the dataset (a few batches in-process, a short probe with workers),
once per dataset and batch size in a process.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from gpufeed.batch import batch_nbytes, collate, iter_tensors
from gpufeed.errors import ShardSplitWarning
from gpufeed.loading.cpu_budget import loader_cpus, worker_count_for
from gpufeed.loading.settings import SETTINGS_KEYS
from gpufeed.loading.workers import MapProxy, loader_dataset

__all__ = [
    "LoaderPlan",
    "cached_plans",
    "clear_plan_cache",
    "decoder_threads",
    "default_multiprocessing_context",
    "fast_path",
    "iter_batches",
    "plan_workers",
]

# Workers must beat in-process loading by this factor to be chosen: in-process loading needs no
# shared memory, no startup and no extra copies of the dataset's state.
_WORKER_MARGIN = 1.10
# Steady-state span the worker probe times (after start-up), at least: shorter spans on a
# shared machine misjudged workers (docs/performance/worker-plan.md).
_WORKER_SPAN_S = 0.3

Plan = tuple[int, str, dict[str, float], int | None]


@dataclass
class LoaderPlan:
    """What ``make_loader`` decided and why. ``str(plan)`` is a readable summary;
    :meth:`settings` gives the tunable part in the settings-file format."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    multiprocessing_context: str | None
    block_size: int
    buffer_blocks: int
    sorted_batches: bool
    cpus: int
    cpu_source: str
    reason: str
    measured: dict[str, float] = field(default_factory=dict)
    batch_bytes: int | None = None
    shm_free_bytes: int | None = None
    from_settings: tuple[str, ...] = ()
    lookahead: int = 0  # batches read ahead (madvise WILLNEED); 0 = off (small samples)
    decoder_threads: int | str = "auto"  # per loading process (RandomResizedCrop native)

    def settings(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in SETTINGS_KEYS}

    def __str__(self) -> str:
        lines = [
            f"num_workers={self.num_workers} ({self.reason})",
            f"usable CPUs: {self.cpus} ({self.cpu_source})",
            f"pin_memory={self.pin_memory} persistent_workers={self.persistent_workers} "
            f"prefetch_factor={self.prefetch_factor} context={self.multiprocessing_context}",
            f"block_size={self.block_size} buffer_blocks={self.buffer_blocks} "
            f"sorted_batches={self.sorted_batches} lookahead={self.lookahead} "
            f"decoder_threads={self.decoder_threads}",
        ]
        if self.measured:
            lines.append("measured: " + ", ".join(f"{k}={v:.4g}" for k, v in self.measured.items()))
        if self.from_settings:
            lines.append("from settings: " + ", ".join(self.from_settings))
        return "\n".join(lines)


_PLAN_CACHE: dict[tuple, Plan] = {}


def clear_plan_cache() -> None:
    """Forget the measured worker decisions (they are cached per dataset and batch size)."""
    _PLAN_CACHE.clear()


def cached_plans() -> list[Plan]:
    """The worker plans measured in this process, oldest first: ``(num_workers, reason,
    measured, batch_bytes)`` each (the bench suite reports the last one)."""
    return list(_PLAN_CACHE.values())


def default_multiprocessing_context() -> str | None:
    """``"fork"`` on Linux unless CUDA is initialised in this process, then ``"spawn"``.

    Fork starts a worker in milliseconds and shares the parent's memory (the dataset's numpy
    index, say) copy-on-write; spawn starts a fresh interpreter that re-imports torch (seconds
    per worker) and receives the dataset pickled. But CUDA does not survive a fork: a forked
    child that touches CUDA fails with "Cannot re-initialize CUDA in forked subprocess", and
    a fork taken while driver threads hold locks can hang the child. So once the parent has
    initialised CUDA (``model.cuda()`` before building the loader) spawn is the safe default.
    A dataset read by URL forks too: obstore's tokio runtime does not survive a fork, so a
    forked worker fetches through a helper process (:mod:`gpufeed.storage.helper`); fork still
    reaches the first batch well before spawn, cold or warm (``python -m
    bench.studies.url_workers``; docs/performance/object-storage-fetch.md).
    Other platforms keep Python's default (spawn on macOS and Windows).
    """
    if not sys.platform.startswith("linux"):
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def _fingerprint(dataset) -> tuple:
    fp = getattr(dataset, "fingerprint", None)
    if callable(fp):
        fp = fp()
    if fp is not None:
        return ("fp", type(dataset).__qualname__, str(fp))
    try:
        n = len(dataset)
    except TypeError:
        n = None
    return ("id", type(dataset).__module__, type(dataset).__qualname__, n, id(dataset))


def fast_path(dataset, collate_fn: Callable | None) -> bool:
    """Whether make_loader reads ``dataset`` through its batched fast path: a map-style
    dataset with ``get_batch`` or an iterable one with ``iter_batches``, and no ``collate_fn``
    of the user's (which, by DataLoader's contract, receives the list of samples)."""
    if collate_fn is not None:
        return False
    method = "iter_batches" if isinstance(dataset, IterableDataset) else "get_batch"
    return callable(getattr(dataset, method, None))


def decoder_threads(dataset, num_workers: int) -> int:
    """Threads the dataset's batch decoder runs in each loading process when the loader has
    ``num_workers`` workers (gpufeed.data.decoders.RandomResizedCrop.threads_for); 1 for a
    dataset whose decoding does not thread."""
    threads_for = getattr(getattr(dataset, "decode", None), "threads_for", None)
    return int(threads_for(num_workers)) if callable(threads_for) else 1


def _fetch(dataset, indices, collate, batched: bool):
    if batched:
        return dataset.get_batch(indices)
    getitems = getattr(dataset, "__getitems__", None)
    data = getitems(indices) if getitems else [dataset[i] for i in indices]
    return collate(data)


def iter_batches(dataset, batch_size, collate, batched: bool) -> Iterator:
    if batched:
        yield from dataset.iter_batches(batch_size)
        return
    it = iter(dataset)
    while True:
        chunk = list(itertools.islice(it, batch_size))
        if not chunk:
            return
        yield collate(chunk)


def _measure_in_process(batches: Iterator, budget_s: float, max_batches: int = 16):
    """Seconds per batch loading in this process (the median, so one stall from the rest of
    the machine does not decide), the first batch (for its size) and how many were timed.

    The first batch is not timed: it pays for opening files and warming caches.
    """
    first = next(batches, None)
    if first is None:
        return None, None, 0
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    t0 = time.perf_counter()
    for _ in batches:
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
        if len(times) >= max_batches or t1 > t_end:
            break
    return (float(np.median(times)) if times else None), first, len(times)


def _ipc_seconds(batch, repeats: int = 5) -> float:
    """What moving one batch from a worker costs: the worker copies every tensor into a new
    shared-memory segment and pickles the handles, the main process maps them back.
    The fastest of a few tries: other load on the machine only ever adds to it."""
    from multiprocessing.reduction import ForkingPickler

    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        clone = [t.clone() for t in iter_tensors(batch)] or [batch]
        pickle.loads(ForkingPickler.dumps(clone))
        best = min(best, time.perf_counter() - t0)
    return best


def _measure_workers(make_dl: Callable[[], DataLoader], workers: int, budget_s: float):
    """Steady-state seconds per batch through ``workers`` workers, and startup seconds.

    Startup (process start, first batch) is timed apart: persistent workers pay it once per
    run, not per batch. Batches the workers had prefetched while the first one was being
    made arrive at once, so the rate is taken over the second half of the arrivals only.
    Returns ``(None, startup)`` when the budget ran out before a steady rate could be seen.
    """
    t_start = time.perf_counter()
    dl = make_dl()
    it = iter(dl)
    arrivals: list[float] = []
    deadline = t_start + budget_s
    need = max(8, 4 * workers + 4)
    try:
        for _ in it:
            arrivals.append(time.perf_counter())
            # a steady rate needs a few hundred ms (_WORKER_SPAN_S)
            if len(arrivals) >= need and arrivals[-1] - arrivals[0] > _WORKER_SPAN_S:
                break
            if arrivals[-1] > deadline:
                break
    except RuntimeError as exc:
        if "timed out" not in str(exc):  # a worker's own error: the user must see it
            raise
        # else the DataLoader timeout fired: no batch within the budget
    finally:
        del it
    startup = (arrivals[0] - t_start) if arrivals else budget_s
    if len(arrivals) < 4:
        return None, startup
    half = len(arrivals) // 2
    span = arrivals[-1] - arrivals[half]
    if span <= 0:
        return None, startup
    return span / (len(arrivals) - 1 - half), startup


def plan_workers(
    dataset,
    batch_size: int,
    *,
    batch_indices: Iterator[list[int]] | None = None,
    collate_fn: Callable | None = None,
    cpus: int | None = None,
    multiprocessing_context: str | None = None,
    budget_s: float = 1.5,
    use_cache: bool = True,
    batched: bool | None = None,
) -> Plan:
    """Measure in-process loading against loading through workers and pick the faster.

    Returns ``(num_workers, reason, measured, batch_bytes)``; ``measured`` holds the numbers
    (batches/s in-process and with workers, worker startup, the IPC cost of one batch).
    ``batch_indices`` are the index batches to read for a map-style dataset (default: the
    first batches in order). Decisions are cached per (dataset fingerprint, batch size,
    CPUs, context, path) for this process; ``use_cache=False`` measures again. ``batched``:
    read through the dataset's fast path (``get_batch``/``iter_batches``) as make_loader
    does; None decides as make_loader (:func:`fast_path`).
    """
    if batched is None:
        batched = fast_path(dataset, collate_fn)
    workers = worker_count_for(loader_cpus()[0] if cpus is None else cpus)
    key = (_fingerprint(dataset), batch_size, workers, multiprocessing_context, batched)
    if use_cache and key in _PLAN_CACHE:
        return _PLAN_CACHE[key]
    probe = _Probe(
        dataset,
        batch_size,
        collate_fn or collate,
        batched,
        workers,
        multiprocessing_context,
        budget_s,
    )
    try:
        with _probe_warnings():
            result = probe.run(batch_indices)
    finally:
        probe.close()
    _PLAN_CACHE[key] = result
    return result


@contextlib.contextmanager
def _probe_warnings() -> Iterator[None]:
    """Silence, for the probe only, the warnings about its own worker count: a pack with fewer
    shards than the probe's workers warns (ShardSplitWarning) of a run the user did not ask
    for, and may not get. Forked workers inherit these filters; the user's run warns as usual."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=ShardSplitWarning)
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        yield


@dataclass
class _Probe:
    """One measurement of in-process loading against ``workers`` workers."""

    dataset: Any
    batch_size: int
    collate: Callable
    batched: bool
    workers: int
    context: str | None
    budget_s: float
    measured: dict[str, float] = field(default_factory=dict)
    sources: tuple = ()

    def run(self, batch_indices) -> Plan:
        inproc, again, worker_batches = self._sources(batch_indices)
        t_begin = time.perf_counter()
        in_budget = self.budget_s * 0.25
        t_in, first, n_timed = _measure_in_process(inproc, in_budget)
        batch_bytes = batch_nbytes(first) if first is not None else None
        if first is None:
            return (0, "the dataset is empty", self.measured, batch_bytes)
        if t_in is None:
            reason = "too few batches to measure; loading in-process"
            return (0, reason, self.measured, batch_bytes)
        self._in_process(t_in, n_timed)
        ipc = _ipc_seconds(first)
        self.measured["ipc_ms_per_batch"] = ipc * 1e3
        w_budget = max(_WORKER_SPAN_S + 0.5, self.budget_s - 2 * (time.perf_counter() - t_begin))
        t_w, unmeasured = self._probe_workers(worker_batches, w_budget)
        # A second in-process round after the probe; the faster of the two counts. On a
        # shared machine a burst of someone else's work only ever slows a round down.
        t_in2, _, n2 = _measure_in_process(again, in_budget)
        if t_in2 is not None and t_in2 < t_in:
            t_in = t_in2
            self._in_process(t_in, n2)
        t_w, how = self._worker_seconds(t_w, t_in, ipc, unmeasured)
        return self._decide(t_in, t_w, how, batch_bytes)

    def _sources(self, batch_indices):
        """(in-process batches, the second round's, the worker probe's index batches)."""
        ds, collate, batched = self.dataset, self.collate, self.batched
        if isinstance(ds, IterableDataset):
            inproc: Iterator = iter_batches(ds, self.batch_size, collate, batched)
            self.sources = (inproc,)
            return inproc, inproc, None  # the second round reads on from the first
        if batch_indices is None:
            n, bs = len(ds), self.batch_size
            batch_indices = (list(range(s, min(s + bs, n))) for s in range(0, n, bs))
        # Every round reads the same batches: the first in-process round brings them into the
        # page cache, so workers and the second round compare warm reads. A plan measured
        # while the pages were on disk would be kept for the warm epochs after it (made once
        # per pack and process), and there workers lose to in-process for cheap samples
        # (docs/performance/worker-plan.md); cold, large samples are read ahead instead
        # (SortedBatchSampler.lookahead).
        in_batches = list(itertools.islice(iter(batch_indices), 17))
        # enough for _WORKER_SPAN_S of cheap batches; the probe stops on time, not on count
        need = 8 * max(16, 8 * self.workers + 8)
        worker_batches = list(itertools.islice(itertools.cycle(in_batches), need))
        inproc = (_fetch(ds, b, collate, batched) for b in in_batches)
        again = (_fetch(ds, b, collate, batched) for b in in_batches)
        self.sources = (inproc, again)
        return inproc, again, worker_batches

    def _in_process(self, t_in: float, n_timed: int) -> None:
        self.measured["in_process_batches_per_s"] = 1.0 / t_in
        self.measured["in_process_batches_timed"] = n_timed

    def _make_dataloader(self, worker_batches) -> DataLoader:
        kw: dict[str, Any] = dict(
            num_workers=self.workers,
            collate_fn=self.collate,
            multiprocessing_context=self.context,
            prefetch_factor=2,
            persistent_workers=False,
            timeout=max(1.0, self.budget_s),
        )
        if isinstance(self.dataset, IterableDataset):
            ds, size = loader_dataset(self.dataset, self.batch_size, False, self.batched)
            return DataLoader(ds, batch_size=size, **kw)
        proxy = MapProxy(self.dataset, None, 0, 0, self.batched)
        return DataLoader(proxy, batch_sampler=worker_batches, **kw)

    def _probe_workers(self, worker_batches, budget_s: float) -> tuple[float | None, str]:
        """(seconds per batch through the workers, or None; why it was not measured)."""
        if self.context in (None, "fork") and sys.platform.startswith("linux"):
            make = lambda: self._make_dataloader(worker_batches)  # noqa: E731
            t_w, startup = _measure_workers(make, self.workers, budget_s)
            self.measured["worker_startup_s"] = startup
            return t_w, "probe did not reach a steady rate within the budget"
        # Spawned workers re-import torch (seconds each) and a worker still starting cannot
        # be stopped quickly, so a bounded probe would measure only start-up: estimate.
        return None, f"{self.context} workers start too slowly to probe"

    def _worker_seconds(self, t_w, t_in: float, ipc: float, unmeasured: str):
        """(seconds per batch with workers, how it was found)."""
        workers = self.workers
        # the model: the in-process cost spread over the workers, plus the IPC of one batch.
        # A threaded decoder already spreads it over its threads in-process; the workers
        # share those CPUs (each gets cpus // workers threads), so count threads, not processes
        in_threads = decoder_threads(self.dataset, 0)
        worker_threads = workers * decoder_threads(self.dataset, workers)
        if in_threads > 1:
            self.measured["decoder_threads_in_process"] = in_threads
            self.measured["decoder_threads_per_worker"] = worker_threads // workers
        t_model = t_in * in_threads / worker_threads + ipc
        if t_w is None:
            # The probe ran out of budget (slow start, e.g. spawn): the model estimates.
            self.measured[f"workers{workers}_batches_per_s_estimated"] = 1.0 / t_model
            return t_model, f"estimated ({unmeasured})"
        self.measured[f"workers{workers}_batches_per_s"] = 1.0 / t_w
        # In-process counts its faster round; the workers get the same allowance (a short
        # probe on a busy machine undersells them, docs/performance/worker-plan.md): the
        # model stands in when it is faster, but only where the measurement has workers at
        # least as fast as in-process. Workers measured slower stay slower: a model never
        # overturns a measurement in the direction the measurement contradicts.
        if t_model < t_w <= t_in:
            self.measured[f"workers{workers}_batches_per_s_model"] = 1.0 / t_model
            return t_model, "modelled (the measurement was slower)"
        return t_w, "measured"

    def _decide(self, t_in: float, t_w: float, how: str, batch_bytes) -> Plan:
        workers, bs = self.workers, self.batch_size
        ratio = t_in / t_w
        self.measured["speedup_workers_vs_in_process"] = ratio
        if ratio > _WORKER_MARGIN:
            reason = (
                f"{workers} workers {how} {ratio:.2f}x faster than in-process "
                f"({1 / t_w:.1f} vs {1 / t_in:.1f} batches/s of {bs})"
            )
            return (workers, reason, self.measured, batch_bytes)
        reason = (
            f"in-process {1 / ratio:.2f}x as fast as {workers} workers ({how}: "
            f"{1 / t_in:.1f} vs {1 / t_w:.1f} batches/s of {bs}); "
            f"worker IPC outweighs the parallel loading"
        )
        return (0, reason, self.measured, batch_bytes)

    def close(self) -> None:
        for src in self.sources:
            close = getattr(src, "close", None)
            if close is not None:
                close()  # an iterable dataset's open files, held by a suspended generator
