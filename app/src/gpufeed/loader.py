"""``make_loader()``: a DataLoader with measured defaults, block-shuffled order, distributed
sharding and mid-epoch resumption. It takes DataLoader's arguments under DataLoader's names,
in its order and with its defaults, except where its docstring says why not; it reads gpufeed
datasets through their batched fast path (``get_batch``/``iter_batches``), any other dataset
as DataLoader does.

What it decides, and from what:

- worker count: the CPUs this process may really use (affinity and cgroup quota, divided
  among the ``LOCAL_WORLD_SIZE`` ranks of this node), and whether workers help at all. With
  ``num_workers="auto"`` both paths are *measured* on the dataset (a few batches in-process,
  a short probe with workers) and the faster wins: for cheap samples the worker IPC (one
  shared-memory segment and a pickle per batch) costs more than loading in-process.
  ``loader.plan`` records the numbers and a reason.
- ``pin_memory`` only when CUDA is available; persistent workers when there are workers.
- order: :class:`~gpufeed.samplers.BlockShuffleSampler` (or
  :class:`~gpufeed.distributed.DistributedBlockSampler` under torchrun), batches sorted
  inside when the dataset says sorted reads are cheaper.
- ``/dev/shm``: warns when workers x prefetch x batch bytes will not fit.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import pickle
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from gpufeed import sysinfo, thresholds
from gpufeed.batch import collate
from gpufeed.distributed import DistributedBlockSampler, rank_and_world
from gpufeed.formats.common import PREFETCH_MIN_BYTES
from gpufeed.samplers import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUFFER_BLOCKS,
    BlockShuffleSampler,
    SortedBatchSampler,
)
from gpufeed.settings import (
    SETTINGS_ENV,
    SETTINGS_KEYS,
    WorkerOutlook,
    load_settings,
    loader_cpus,
    worker_count_for,
    worker_outlook,
)

__all__ = [
    "SETTINGS_ENV",
    "SETTINGS_KEYS",
    "GpufeedLoader",
    "LoaderPlan",
    "ShmBudgetWarning",
    "WorkerOutlook",
    "clear_plan_cache",
    "default_collate",
    "default_multiprocessing_context",
    "fast_path",
    "loader_cpus",
    "make_loader",
    "plan_workers",
    "worker_count_for",
    "worker_outlook",
    "worker_seed",
]

_STATE_FORMAT = "gpufeed.loader/1"
# Workers must beat in-process loading by this factor to be chosen: in-process loading needs no
# shared memory, no startup and no extra copies of the dataset's state.
_WORKER_MARGIN = 1.10
# Steady-state span the worker probe times (after start-up), at least.
_WORKER_SPAN_S = 0.3


class ShmBudgetWarning(UserWarning):
    """/dev/shm is too small for the planned workers: they would die with "Bus error"."""


# --------------------------------------------------------------------------- plan


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
            f"sorted_batches={self.sorted_batches} lookahead={self.lookahead}",
        ]
        if self.measured:
            lines.append("measured: " + ", ".join(f"{k}={v:.4g}" for k, v in self.measured.items()))
        if self.from_settings:
            lines.append("from settings: " + ", ".join(self.from_settings))
        return "\n".join(lines)


_PLAN_CACHE: dict[tuple, tuple[int, str, dict[str, float], int | None]] = {}


def clear_plan_cache() -> None:
    """Forget the measured worker decisions (they are cached per dataset and batch size)."""
    _PLAN_CACHE.clear()


def default_multiprocessing_context() -> str | None:
    """``"fork"`` on Linux unless CUDA is initialised in this process, then ``"spawn"``.

    Fork starts a worker in milliseconds and shares the parent's memory (the dataset's numpy
    index, say) copy-on-write; spawn starts a fresh interpreter that re-imports torch (seconds
    per worker) and receives the dataset pickled. But CUDA does not survive a fork: a forked
    child that touches CUDA fails with "Cannot re-initialize CUDA in forked subprocess", and
    a fork taken while driver threads hold locks can hang the child. So once the parent has
    initialised CUDA (``model.cuda()`` before building the loader) spawn is the safe default.
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


def iter_tensors(obj) -> Iterator[torch.Tensor]:
    """Every tensor in a batch (tensors, numpy arrays, nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif isinstance(obj, np.ndarray):
        yield torch.from_numpy(obj)


def batch_nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def _batch_len(batch) -> int | None:
    labels = getattr(batch, "labels", None)
    if isinstance(labels, torch.Tensor) and labels.dim() >= 1:
        return int(labels.shape[0])
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()), None)
        return None if batch is None else _batch_len(batch)
    if isinstance(batch, (list, tuple)) and batch:
        first = _batch_len(batch[0])
        return first if isinstance(batch[0], (torch.Tensor, Mapping)) else len(batch)
    return None


# ---------------------------------------------------------------------- collate


def default_collate(data):
    """The loader's ``collate_fn`` when none is given: a :class:`~gpufeed.batch.Batch` that the
    fast path (``get_batch``, ``iter_batches``) built passes through; a list of
    ``(tensor, int)`` samples becomes a Batch; anything else goes to torch's
    ``default_collate`` (see :func:`gpufeed.batch.collate`)."""
    return collate(data)


def fast_path(dataset, collate_fn: Callable | None) -> bool:
    """Whether make_loader reads ``dataset`` through its batched fast path: a map-style
    dataset with ``get_batch`` or an iterable one with ``iter_batches``, and no ``collate_fn``
    of the user's (which, by DataLoader's contract, receives the list of samples)."""
    if collate_fn is not None:
        return False
    method = "iter_batches" if isinstance(dataset, IterableDataset) else "get_batch"
    return callable(getattr(dataset, method, None))


# ------------------------------------------------------------------- measuring


def _fetch(dataset, indices, collate, batched: bool):
    if batched:
        return dataset.get_batch(indices)
    getitems = getattr(dataset, "__getitems__", None)
    data = getitems(indices) if getitems else [dataset[i] for i in indices]
    return collate(data)


def _iter_batches(dataset, batch_size, collate, batched: bool) -> Iterator:
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
            # a steady rate needs a few hundred ms: shorter spans on a shared machine made
            # 2 workers look 1.2x in-process where they run 1.7x (decode-bound JPEGs)
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
) -> tuple[int, str, dict[str, float], int | None]:
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
    collate = collate_fn or default_collate
    iterable = isinstance(dataset, IterableDataset)
    if cpus is None:
        cpus = loader_cpus()[0]
    workers = worker_count_for(cpus)
    key = (_fingerprint(dataset), batch_size, workers, multiprocessing_context, batched)
    if use_cache and key in _PLAN_CACHE:
        return _PLAN_CACHE[key]

    if iterable:
        inproc_src: Iterator = _iter_batches(dataset, batch_size, collate, batched)
        inproc_again: Iterator = inproc_src  # the second round reads on from the first
        worker_batches = None
    else:
        if batch_indices is None:
            n = len(dataset)
            batch_indices = (
                list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)
            )
        # Every round reads the same batches: the first in-process round brings them into the
        # page cache, so workers and the second round compare warm reads. A plan measured
        # while the pages were on disk would be kept for the warm epochs after it (made once
        # per pack and process), and there workers lose up to 5x to in-process for cheap
        # samples; cold, large samples are read ahead instead (SortedBatchSampler.lookahead).
        in_batches = list(itertools.islice(iter(batch_indices), 17))
        # enough for _WORKER_SPAN_S of cheap batches; the probe stops on time, not on count
        need = 8 * max(16, 8 * workers + 8)
        worker_batches = list(itertools.islice(itertools.cycle(in_batches), need))
        again = in_batches
        inproc_src = (_fetch(dataset, b, collate, batched) for b in in_batches)
        inproc_again = (_fetch(dataset, b, collate, batched) for b in again)

    t_begin = time.perf_counter()
    in_budget = budget_s * 0.25
    t_in, first, n_timed = _measure_in_process(inproc_src, in_budget)
    measured: dict[str, float] = {}
    batch_bytes = batch_nbytes(first) if first is not None else None
    if first is None:
        result = (0, "the dataset is empty", measured, batch_bytes)
        _PLAN_CACHE[key] = result
        return result
    if t_in is None:
        result = (0, "too few batches to measure; loading in-process", measured, batch_bytes)
        _PLAN_CACHE[key] = result
        return result
    measured["in_process_batches_per_s"] = 1.0 / t_in
    measured["in_process_batches_timed"] = n_timed
    ipc = _ipc_seconds(first)
    measured["ipc_ms_per_batch"] = ipc * 1e3

    def make_dl() -> DataLoader:
        kw: dict[str, Any] = dict(
            num_workers=workers,
            collate_fn=collate,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=2,
            persistent_workers=False,
            timeout=max(1.0, budget_s),
        )
        if iterable:
            ds, size = _loader_dataset(dataset, batch_size, False, batched)
            return DataLoader(ds, batch_size=size, **kw)
        proxy = _MapProxy(dataset, None, 0, 0, batched)
        return DataLoader(proxy, batch_sampler=worker_batches, **kw)

    w_budget = max(_WORKER_SPAN_S + 0.5, budget_s - 2 * (time.perf_counter() - t_begin))
    if multiprocessing_context in (None, "fork") and sys.platform.startswith("linux"):
        t_w, startup = _measure_workers(make_dl, workers, w_budget)
        measured["worker_startup_s"] = startup
        unmeasured = "probe did not reach a steady rate within the budget"
    else:
        # Spawned workers re-import torch (seconds each) and a worker still starting cannot
        # be stopped quickly, so a bounded probe would measure only start-up: estimate.
        t_w, unmeasured = None, f"{multiprocessing_context} workers start too slowly to probe"
    # A second in-process round after the probe; the faster of the two counts. On a shared
    # machine a burst of someone else's work only ever slows a round down.
    t_in2, _, n2 = _measure_in_process(inproc_again, in_budget)
    if t_in2 is not None and t_in2 < t_in:
        t_in, n_timed = t_in2, n2
        measured["in_process_batches_per_s"] = 1.0 / t_in
        measured["in_process_batches_timed"] = n_timed
    if t_w is not None:
        measured[f"workers{workers}_batches_per_s"] = 1.0 / t_w
        how = "measured"
        # In-process counts its faster round; the workers get the same allowance: a short
        # worker probe on a busy machine read 2 workers at 1.2x in-process where they run
        # 1.7x. The model (the in-process cost spread over the workers, plus the measured IPC
        # of one batch) stands in when it is faster; it still keeps cheap samples in-process.
        t_model = t_in / workers + ipc
        if t_model < t_w:
            measured[f"workers{workers}_batches_per_s_model"] = 1.0 / t_model
            t_w, how = t_model, "modelled (the measurement was slower)"
    else:
        # The probe ran out of budget (slow start, e.g. spawn): estimate from the in-process
        # cost spread over the workers plus the measured per-batch IPC cost.
        t_w = t_in / workers + ipc
        measured[f"workers{workers}_batches_per_s_estimated"] = 1.0 / t_w
        how = f"estimated ({unmeasured})"
    for src in (inproc_src, inproc_again):
        close = getattr(src, "close", None)
        if close is not None:
            close()  # an iterable dataset's open files, held by a suspended generator
    ratio = t_in / t_w
    measured["speedup_workers_vs_in_process"] = ratio
    if ratio > _WORKER_MARGIN:
        reason = (
            f"{workers} workers {how} {ratio:.2f}x faster than in-process "
            f"({1 / t_w:.1f} vs {1 / t_in:.1f} batches/s of {batch_size})"
        )
        result = (workers, reason, measured, batch_bytes)
    else:
        reason = (
            f"in-process {1 / ratio:.2f}x as fast as {workers} workers ({how}: "
            f"{1 / t_in:.1f} vs {1 / t_w:.1f} batches/s of {batch_size}); "
            f"worker IPC outweighs the parallel loading"
        )
        result = (0, reason, measured, batch_bytes)
    _PLAN_CACHE[key] = result
    return result


# ------------------------------------------------------------ worker seeding


def worker_seed(seed: int, epoch: int, rank: int, worker_id: int) -> int:
    """The 64-bit seed of one worker in one epoch: distinct per (seed, epoch, rank, worker)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(rank), int(worker_id)])
    a, b = state.generate_state(2, dtype=np.uint32)
    return (int(a) << 32) | int(b)


def _seed_everything(s: int) -> None:
    random.seed(s)
    np.random.seed(s % (1 << 32))
    torch.manual_seed(s)


class _WorkerInit:
    """Seeds python/numpy/torch in each worker, then runs the user's ``worker_init_fn``.
    A class rather than a closure so spawn can pickle it."""

    def __init__(self, seed, epoch_value, rank, user_fn):
        self.seed, self.epoch_value, self.rank, self.user_fn = seed, epoch_value, rank, user_fn

    def __call__(self, worker_id: int) -> None:
        _seed_everything(worker_seed(self.seed, self.epoch_value.value, self.rank, worker_id))
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _EpochSync:
    """Mixin for the dataset proxies: persistent workers outlive epochs, so the epoch travels
    through a shared value and each worker reseeds (and calls ``set_epoch``) when it changes."""

    def _sync(self) -> int | None:
        if self._epoch_value is None:  # in-process: the loader sets the epoch itself
            return None
        epoch = self._epoch_value.value
        if epoch != self._seen_epoch:
            self._seen_epoch = epoch
            info = torch.utils.data.get_worker_info()
            if info is not None:
                _seed_everything(worker_seed(self._seed, epoch, self._rank, info.id))
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
        return epoch


class _MapProxy(_EpochSync, Dataset):
    """What make_loader's DataLoader reads a map-style dataset through: keeps the epoch in
    step in workers and, on the fast path (``batched``), answers the DataLoader's batched
    fetch with the dataset's ``get_batch`` (a ready Batch that the collate passes through)
    instead of its list of samples."""

    def __init__(self, dataset, epoch_value, seed, rank, batched: bool):
        self.dataset, self._epoch_value, self._seed, self._rank = dataset, epoch_value, seed, rank
        self._seen_epoch = epoch_value.value if epoch_value is not None else None
        self.batched = batched

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self._sync()
        return self.dataset[i]

    def __getitems__(self, indices):
        self._sync()
        if self.batched:
            return self.dataset.get_batch(indices)
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(indices) if getitems else [self.dataset[i] for i in indices]


class _Batched(IterableDataset):
    """An iterable dataset that makes its own batches (``iter_batches``, as gpufeed's tar
    stream does: a whole batch per read, shuffle and decode), for a DataLoader with
    ``batch_size=None``."""

    def __init__(self, dataset, batch_size: int, drop_last: bool):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last

    def __iter__(self):
        return iter(self.dataset.iter_batches(self.batch_size, self.drop_last))


def _loader_dataset(dataset, batch_size: int, drop_last: bool, batched: bool):
    """(dataset, batch_size) for the DataLoader over an iterable dataset: batches made by the
    dataset where it can (then the DataLoader batches nothing), else the DataLoader's."""
    if batched:
        return _Batched(dataset, batch_size, drop_last), None
    return dataset, batch_size


class _IterProxy(_EpochSync, IterableDataset):
    def __init__(self, dataset, epoch_value, seed, rank):
        self.dataset, self._epoch_value, self._seed, self._rank = dataset, epoch_value, seed, rank
        self._seen_epoch = None  # always sync: set_epoch before every pass

    def __iter__(self):
        self._sync()
        self._seen_epoch = None
        return iter(self.dataset)

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        self._sync()
        self._seen_epoch = None
        return self.dataset.iter_batches(batch_size, drop_last)


# --------------------------------------------------------------- the loader


class GpufeedLoader:
    """Iterable over batches, built by :func:`make_loader`.

    Epochs: ``set_epoch(e)`` picks the order of the next pass; a pass that runs to the end
    advances the epoch by one by itself, so forgetting ``set_epoch`` does not repeat the same
    order. A pass abandoned midway (``break``) leaves the epoch where it was.

    Resumption: ``state_dict()`` records the epoch, the seed and how many samples this rank
    has handed to *you* (counted as each batch is yielded; what workers prefetched is not
    counted). After ``load_state_dict(state)`` the next pass yields exactly the samples of
    that epoch not yet yielded, then epochs continue as usual. Each rank saves and restores
    its own state. Map-style datasets in gpufeed's order skip to the position directly;
    iterable datasets and your own ``batch_sampler`` replay: the skipped batches are read
    again and dropped (correct when the order is a function of the epoch, as gpufeed's tar
    shards are). Exact only with ``in_order=True``.
    """

    def __init__(
        self,
        dataset,
        *,
        batch_size: int,
        plan: LoaderPlan,
        batch_sampler,
        collate_fn: Callable,
        drop_last: bool,
        seed: int,
        rank: int,
        world_size: int,
        worker_init_fn: Callable | None,
        timeout: float,
        batched: bool = False,
        dataloader_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.plan = plan
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.batched = batched
        self._user_worker_init = worker_init_fn
        self._timeout = timeout
        self._dataloader_options = dict(dataloader_options or {})
        self.epoch = 0
        self._samples_seen = 0
        self._batches_seen = 0
        self._resume: tuple[int, int] | None = None  # (samples, batches) to skip next pass
        self._dl: DataLoader | None = None
        self._epoch_value = None

    # -- properties users reach for
    @property
    def num_workers(self) -> int:
        return self.plan.num_workers

    @property
    def pin_memory(self) -> bool:
        return self.plan.pin_memory

    @property
    def prefetch_factor(self) -> int | None:
        return self.plan.prefetch_factor

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def _seeks(self) -> bool:
        """Resumes by starting its own sampler mid-epoch (else: replays batches)."""
        return isinstance(self.batch_sampler, SortedBatchSampler)

    @property
    def dataloader(self) -> DataLoader:
        """The underlying ``torch.utils.data.DataLoader`` (built on first use)."""
        if self._dl is None:
            self._dl = self._build()
        return self._dl

    def _build(self) -> DataLoader:
        p = self.plan
        kw: dict[str, Any] = dict(
            num_workers=p.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=p.pin_memory,
            timeout=self._timeout,
            **self._dataloader_options,
        )
        if p.num_workers > 0:
            ctx = multiprocessing.get_context(p.multiprocessing_context)
            self._epoch_value = ctx.RawValue("q", self.epoch)
            kw.update(
                multiprocessing_context=ctx,
                persistent_workers=p.persistent_workers,
                prefetch_factor=p.prefetch_factor,
                worker_init_fn=_WorkerInit(
                    self.seed, self._epoch_value, self.rank, self._user_worker_init
                ),
            )
        elif self._user_worker_init is not None:
            warnings.warn(
                "worker_init_fn is not called: loading in-process (0 workers)", stacklevel=3
            )
        if self.iterable:
            dataset = self.dataset
            if self._epoch_value is not None:
                dataset = _IterProxy(dataset, self._epoch_value, self.seed, self.rank)
            dataset, size = _loader_dataset(dataset, self.batch_size, self.drop_last, self.batched)
            return DataLoader(dataset, batch_size=size, drop_last=self.drop_last, **kw)
        proxy = _MapProxy(self.dataset, self._epoch_value, self.seed, self.rank, self.batched)
        return DataLoader(proxy, batch_sampler=self.batch_sampler, **kw)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next pass (and drop a pending resume of another
        epoch)."""
        epoch = int(epoch)
        if self._resume is not None and epoch != self.epoch:
            self._resume = None
        self.epoch = epoch

    def samples_per_epoch(self) -> int | None:
        """Samples this rank yields in a full epoch (None where unknown: iterable datasets
        without len, your own batch_sampler)."""
        if self._seeks:
            return self.batch_sampler.samples_per_epoch()
        if self.batch_sampler is not None:
            return None
        try:
            n = len(self.dataset)
        except TypeError:
            return None
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches in a full epoch on this rank."""
        if self.batch_sampler is not None and not self._seeks:
            return len(self.batch_sampler)
        n = self.samples_per_epoch()
        if n is None:
            raise TypeError(f"{type(self.dataset).__name__} has no len(); neither has its loader")
        return -(-n // self.batch_size)

    def _prepare_pass(self) -> tuple[int, int]:
        skip_samples, skip_batches = self._resume or (0, 0)
        self._resume = None
        if self._seeks:
            self.batch_sampler.set_epoch(self.epoch)
            self.batch_sampler.start = skip_samples
            skip_batches = 0  # the sampler starts at the right index; nothing to replay
        elif self.batch_sampler is not None:
            # your batch sampler, or a DistributedSampler inside torch's BatchSampler
            for obj in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
                if callable(getattr(obj, "set_epoch", None)):
                    obj.set_epoch(self.epoch)
        else:
            # in-process this is the copy that is read; with workers it keeps len() (which
            # may depend on the epoch's shard split) in step; workers get it via _IterProxy
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.epoch)
        if self._epoch_value is not None:
            self._epoch_value.value = self.epoch
        return skip_samples, skip_batches

    def __iter__(self) -> Iterator:
        dl = self.dataloader
        skip_samples, replay = self._prepare_pass()
        self._samples_seen = skip_samples
        # gpufeed's sampler starts at the right index; a replay counts its batches up again
        self._batches_seen = -(-skip_samples // self.batch_size) if self._seeks else 0
        total = self.samples_per_epoch()
        for batch in dl:
            if replay > 0:
                replay -= 1
                self._batches_seen += 1
                continue
            self._batches_seen += 1
            if self._seeks and total is not None:
                self._samples_seen = min(total, self._samples_seen + self.batch_size)
            else:
                self._samples_seen += _batch_len(batch) or self.batch_size
            yield batch
        self.epoch += 1
        self._samples_seen = self._batches_seen = 0

    # -- resumption
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": _STATE_FORMAT,
            "epoch": self.epoch,
            "seed": self.seed,
            "samples_seen": self._samples_seen,
            "batches_seen": self._batches_seen,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples_per_epoch": self.samples_per_epoch(),
            "iterable": self.iterable,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"not a gpufeed loader state (format {state.get('format')!r}, expected "
                f"{_STATE_FORMAT!r})"
            )
        mine = self.state_dict()
        # An iterable dataset's length may change by epoch (tar shards split over ranks), so
        # only a map-style one is checked for the same length.
        checked = ("seed", "world_size", "rank", "iterable")
        if not self.iterable:
            checked += ("samples_per_epoch",)
        for key in checked:
            if state[key] != mine[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r} but this loader has "
                    f"{key}={mine[key]!r}; the order cannot be resumed exactly. Build the "
                    f"loader with the same dataset, seed and world size (each rank loads "
                    f"its own state)"
                )
        if not self._seeks and state["batch_size"] != self.batch_size:
            raise ValueError(
                f"this loader resumes by replaying batches: saved batch_size "
                f"{state['batch_size']}, this loader {self.batch_size}"
            )
        self.epoch = int(state["epoch"])
        self._samples_seen = int(state["samples_seen"])
        self._batches_seen = int(state["batches_seen"])
        self._resume = (self._samples_seen, self._batches_seen)

    def __repr__(self) -> str:
        return (
            f"GpufeedLoader(batch_size={self.batch_size}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.world_size}, plan=<{self.plan.reason}>)"
        )


# --------------------------------------------------------------- settings


def _check_shm(workers: int, prefetch: int, batch_bytes: int, shm_path: str) -> int | None:
    info = sysinfo.shm_info(shm_path)
    if info is None or workers == 0:
        return None if info is None else info.free_bytes
    need = workers * prefetch * batch_bytes
    try:
        floor = thresholds.min_shm_bytes()
    except (OSError, KeyError, ValueError):
        floor = 0
    if need > info.free_bytes:
        suggest_gib = max(1, 2 ** math.ceil(math.log2(max(1, 2 * need) / (1 << 30))))
        warnings.warn(
            f"{shm_path} has {info.free_bytes / 2**20:.0f} MiB free but {workers} workers x "
            f"prefetch_factor {prefetch} x {batch_bytes / 2**20:.1f} MiB batches need "
            f"~{need / 2**20:.0f} MiB: workers will fail with 'Bus error'. Give the container "
            f"more shared memory (docker run --shm-size={suggest_gib}g, compose `shm_size: "
            f"{suggest_gib}gb`), or use fewer workers (num_workers="
            f"{max(0, int(info.free_bytes // max(1, prefetch * batch_bytes)))}), a smaller "
            f"batch or prefetch_factor",
            ShmBudgetWarning,
            stacklevel=3,
        )
    elif info.total_bytes < floor:
        warnings.warn(
            f"{shm_path} is {info.total_bytes / 2**20:.0f} MiB, below GPUFEED_MIN_SHM_MB="
            f"{floor >> 20}; enough for this loader now, but larger batches or more workers "
            f"will fail with 'Bus error'. Use docker run --shm-size or compose `shm_size`",
            ShmBudgetWarning,
            stacklevel=3,
        )
    return info.free_bytes


def _sample_bytes(dataset, batch_size, collate, batched: bool) -> int | None:
    try:
        if isinstance(dataset, IterableDataset):
            batch = next(_iter_batches(dataset, batch_size, collate, batched), None)
            return None if batch is None else batch_nbytes(batch)
        if len(dataset) == 0:
            return None
        return batch_nbytes(dataset[0]) * batch_size
    except Exception as exc:  # sizing is advisory; the real error surfaces when iterating
        warnings.warn(f"could not size a batch for the /dev/shm check: {exc!r}", stacklevel=3)
        return None


# ------------------------------------------------------------- make_loader


_DEFAULTS = dict(
    num_workers="auto",
    pin_memory="auto",
    persistent_workers=True,
    prefetch_factor=None,
    multiprocessing_context=None,
    block_size="auto",
    buffer_blocks=DEFAULT_BUFFER_BLOCKS,
    sorted_batches="auto",
)


def _check_dataloader_args(batch_size, shuffle, sampler, batch_sampler, drop_last, prefetch):
    """DataLoader's own rules for its arguments, with its wording, raised before anything
    is measured."""
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last"
            )
    elif isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size must be a positive int, got {batch_size!r} (make_loader always "
            f"batches; DataLoader's batch_size=None has no counterpart here)"
        )
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if prefetch is not None and (
        isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1
    ):
        raise ValueError(f"prefetch_factor must be None or an int >= 1, got {prefetch!r}")


def _seed_from(seed: int | None, generator: torch.Generator | None) -> int:
    """make_loader's seed: the one given, else one draw from ``generator`` (as DataLoader
    draws its workers' base seed from it), else 0."""
    if seed is not None and generator is not None:
        raise ValueError("give seed or generator, not both")
    if seed is not None:
        return int(seed)
    if generator is not None:
        return int(torch.randint(0, 2**62, (), generator=generator))
    return 0


def _iterable_for_rank(dataset, shuffle: bool | None, rank: int, world: int):
    """An iterable dataset read by this rank, in the order ``shuffle`` asks for. gpufeed's tar
    stream takes both as options (a copy is made; yours is left as it is); any other
    IterableDataset orders and shards itself, and ``shuffle=True`` is DataLoader's error."""
    from gpufeed.datasets import TarShardDataset

    if not isinstance(dataset, TarShardDataset):
        if shuffle:
            raise ValueError(
                f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
                f"shuffle={shuffle} ({type(dataset).__name__} orders itself)"
            )
        return dataset
    changes: dict[str, Any] = {"rank": rank, "world_size": world}
    if shuffle is False:
        changes.update(shuffle_buffer=0, shuffle_shards=False)
    elif shuffle and dataset.shuffle_buffer <= 1 and not dataset.shuffle_shards:
        changes.update(shuffle_buffer=TarShardDataset.DEFAULT_SHUFFLE_BUFFER, shuffle_shards=True)
    return dataset.replace(**changes)


def _dataloader_options(in_order: bool, pin_memory_device: str) -> dict[str, Any]:
    """DataLoader options passed only when set: torch before 2.6 has no ``in_order``."""
    import inspect

    options: dict[str, Any] = {}
    if pin_memory_device:
        options["pin_memory_device"] = pin_memory_device
    if not in_order:
        if "in_order" not in inspect.signature(DataLoader).parameters:
            raise ValueError(f"in_order=False needs torch >= 2.6 (this is {torch.__version__})")
        options["in_order"] = False
    return options


def make_loader(
    dataset,
    batch_size: int = 1,
    shuffle: bool | None = None,
    sampler=None,
    batch_sampler=None,
    num_workers: int | str = "auto",
    collate_fn: Callable | None = None,
    pin_memory: bool | str = "auto",
    drop_last: bool = False,
    timeout: float = 0,
    worker_init_fn: Callable | None = None,
    multiprocessing_context: str | None = None,
    generator: torch.Generator | None = None,
    *,
    prefetch_factor: int | None = None,
    persistent_workers: bool = True,
    pin_memory_device: str = "",
    in_order: bool = True,
    seed: int | None = None,
    block_size: int | str = "auto",
    buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    sorted_batches: bool | str = "auto",
    distributed: bool | str = "auto",
    rank: int | None = None,
    world_size: int | None = None,
    settings: str | os.PathLike | Mapping | None = None,
    probe_budget_s: float = 1.5,
    shm_path: str = "/dev/shm",
    check_shm: bool = True,
) -> GpufeedLoader:
    """``DataLoader``'s arguments, names, order and defaults, with measured settings, block
    shuffle, sharding by rank and mid-epoch resumption (see :class:`GpufeedLoader`).

    ``DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)`` and
    ``make_loader(dataset, 32, True, num_workers=4)`` read the same samples each epoch.
    Where the two differ, and why:

    - ``num_workers="auto"`` (DataLoader: 0): measures in-process loading against workers on
      this dataset and batch size (about ``probe_budget_s`` seconds, once per dataset and
      batch size per process; see :func:`plan_workers`); for cheap samples the worker IPC
      costs more than it saves. An int is used as given.
    - ``pin_memory="auto"`` (DataLoader: False): pins when CUDA is available.
    - ``persistent_workers=True`` (DataLoader: False): workers start once, not every epoch
      (seconds each under spawn); only meaningful with workers.
    - ``multiprocessing_context=None``: fork on Linux unless CUDA is initialised, then spawn
      (:func:`default_multiprocessing_context`); DataLoader leaves it to Python.
    - ``collate_fn=None``: the fast path. gpufeed datasets hand over a whole batch at once
      (``get_batch``/``iter_batches``: one stacked tensor, one shared-memory segment per
      batch from a worker); batches are :class:`~gpufeed.batch.Batch` ``(samples, labels)``
      named tuples, which unpack as DataLoader's ``[samples, labels]`` do. Other datasets'
      samples go through :func:`gpufeed.batch.collate`. A ``collate_fn`` of yours gets the
      list of samples, as with DataLoader.
    - ``shuffle`` (default None, as DataLoader: off) shuffles map-style datasets in blocks
      (:class:`~gpufeed.samplers.BlockShuffleSampler`: random order read in long runs);
      ``block_size=1`` is a uniform permutation. gpufeed's tar stream takes it as its own
      option (False: storage order; None: as the dataset was opened); any other
      IterableDataset with ``shuffle=True`` is an error, as in DataLoader.
    - the order is a function of ``seed`` (default 0) and the epoch, the same on every rank
      and after a restart (what resumption needs); ``generator`` (DataLoader: the source of
      the random order), when given instead of ``seed``, draws the seed once.
    - ``in_order=False`` hands out batches as workers finish them; resumption is then not
      exact. ``pin_memory_device`` is passed on (deprecated by torch).

    gpufeed's own arguments (keyword only):

    - ``sampler``/``batch_sampler``: yours replace the block shuffle, and distributed
      sharding is then yours too; gpufeed still sorts the indices inside each batch of your
      ``sampler`` when ``sorted_batches`` (not those of your ``batch_sampler``).
    - ``prefetch_factor``: batches in flight per worker; None gives torch's 2.
    - ``block_size``/``buffer_blocks``: the block shuffle (see :mod:`gpufeed.samplers`);
      ``"auto"`` takes the dataset's ``preferred_block_size`` attribute if it has one, else
      256.
    - ``sorted_batches``: sort indices inside each batch (cheaper HDF5/mmap reads);
      ``"auto"`` follows the dataset's ``prefers_sorted_reads`` attribute.
    - ``distributed``, ``rank``, ``world_size``: ``"auto"`` shards by rank when the world
      size (the explicit arguments, else ``torch.distributed``, else env ``RANK`` /
      ``WORLD_SIZE``) is above 1: map-style datasets by
      :class:`~gpufeed.distributed.DistributedBlockSampler`, gpufeed's tar stream by whole
      shards; ``False`` reads everything on every rank.
    - ``settings``: a dict or a JSON file with any of :data:`SETTINGS_KEYS` (what ``gpufeed
      tune`` writes), default the file named by env ``GPUFEED_LOADER_SETTINGS``. A setting
      applies where the argument was left at its default; explicit arguments win.
    - ``worker_init_fn``: runs in each worker after gpufeed seeds python, numpy and torch
      from ``(seed, epoch, rank, worker id)``.
    - ``check_shm``: warn (:class:`ShmBudgetWarning`) when ``/dev/shm`` cannot hold
      workers x prefetch_factor batches.
    """
    _check_dataloader_args(batch_size, shuffle, sampler, batch_sampler, drop_last, prefetch_factor)
    seed = _seed_from(seed, generator)
    iterable = isinstance(dataset, IterableDataset)
    args = dict(
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        multiprocessing_context=multiprocessing_context,
        block_size=block_size,
        buffer_blocks=buffer_blocks,
        sorted_batches=sorted_batches,
    )
    tuned, _ = load_settings(settings)
    from_settings = []
    for key, value in tuned.items():
        if args[key] == _DEFAULTS[key] and type(args[key]) is type(_DEFAULTS[key]):
            args[key] = value
            from_settings.append(key)

    if args["multiprocessing_context"] is None:
        args["multiprocessing_context"] = default_multiprocessing_context()
    if args["multiprocessing_context"] not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(
            f"multiprocessing_context must be 'fork', 'spawn' or 'forkserver', got "
            f"{args['multiprocessing_context']!r}"
        )
    if args["block_size"] == "auto":
        args["block_size"] = int(getattr(dataset, "preferred_block_size", DEFAULT_BLOCK_SIZE))
    if args["sorted_batches"] == "auto":
        args["sorted_batches"] = bool(getattr(dataset, "prefers_sorted_reads", False))
    if args["pin_memory"] == "auto":
        args["pin_memory"] = torch.cuda.is_available()
    batched = fast_path(dataset, collate_fn)
    collate = collate_fn or default_collate
    dataloader_options = _dataloader_options(in_order, pin_memory_device)

    yours = sampler if sampler is not None else batch_sampler  # an order of your own
    rank_, world = rank_and_world(rank, world_size)
    use_dist = distributed is True or (distributed == "auto" and world > 1)
    if iterable:
        if batch_sampler is not None or sampler is not None:
            raise ValueError("DataLoader with IterableDataset: expected unspecified sampler option")
        dataset = _iterable_for_rank(dataset, shuffle, *((rank_, world) if use_dist else (0, 1)))
    elif batch_sampler is None:
        batch_sampler = _batches(
            dataset,
            batch_size,
            bool(shuffle),
            sampler,
            drop_last,
            seed,
            args,
            use_dist,
            rank_,
            world,
        )
    if yours is not None and world > 1 and distributed is not False:
        _warn_unsharded(yours, world)

    cpus, cpu_source = loader_cpus()
    measured: dict[str, float] = {}
    batch_bytes = None
    nw = args["num_workers"]
    if nw == "auto":
        probe_indices = None
        if isinstance(batch_sampler, SortedBatchSampler):
            batch_sampler.set_epoch(0)
        if batch_sampler is not None:
            probe_indices = iter(batch_sampler)
        nw, reason, measured, batch_bytes = plan_workers(
            dataset,
            batch_size,
            batch_indices=probe_indices,
            collate_fn=collate_fn,
            cpus=cpus,
            multiprocessing_context=args["multiprocessing_context"],
            budget_s=probe_budget_s,
            batched=batched,
        )
    elif isinstance(nw, int) and not isinstance(nw, bool) and nw >= 0:
        reason = "from settings" if "num_workers" in from_settings else "as requested"
    else:
        raise ValueError(f"num_workers must be 'auto' or an int >= 0, got {nw!r}")

    prefetch = args["prefetch_factor"] if nw > 0 else None
    if nw > 0 and prefetch is None:
        prefetch = 2
    shm_free = None
    if check_shm and nw > 0:
        if batch_bytes is None:
            batch_bytes = _sample_bytes(dataset, batch_size, collate, batched)
        if batch_bytes:
            shm_free = _check_shm(nw, prefetch, batch_bytes, shm_path)

    # Large samples: each reader asks the kernel for its next batch while copying this one,
    # so cold reads keep many requests in flight (small ones: readahead does it already).
    lookahead = 0
    reader = getattr(dataset, "reader", None)
    if (
        isinstance(batch_sampler, SortedBatchSampler)
        and hasattr(reader, "mean_sample_bytes")
        and reader.mean_sample_bytes() >= PREFETCH_MIN_BYTES
    ):
        lookahead = max(1, nw)
        batch_sampler.lookahead = lookahead

    plan = LoaderPlan(
        num_workers=nw,
        pin_memory=bool(args["pin_memory"]),
        persistent_workers=bool(args["persistent_workers"]) and nw > 0,
        prefetch_factor=prefetch,
        multiprocessing_context=args["multiprocessing_context"] if nw > 0 else None,
        block_size=args["block_size"],
        buffer_blocks=args["buffer_blocks"],
        sorted_batches=args["sorted_batches"],
        cpus=cpus,
        cpu_source=cpu_source,
        reason=reason,
        measured=measured,
        batch_bytes=batch_bytes,
        shm_free_bytes=shm_free,
        from_settings=tuple(from_settings),
        lookahead=lookahead,
    )
    return GpufeedLoader(
        dataset,
        batch_size=batch_size,
        plan=plan,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        drop_last=drop_last,
        seed=seed,
        rank=rank_,
        world_size=world,
        worker_init_fn=worker_init_fn,
        timeout=timeout,
        batched=batched,
        dataloader_options=dataloader_options,
    )


def _batches(dataset, batch_size, shuffle, sampler, drop_last, seed, args, use_dist, rank, world):
    """gpufeed's batch sampler for a map-style dataset: block-shuffled (or in order), split
    by rank when distributed, over ``sampler`` when you gave one; indices sorted inside each
    batch when ``sorted_batches``."""
    if sampler is None:
        common = dict(block_size=args["block_size"], buffer_blocks=args["buffer_blocks"])
        if use_dist:
            sampler = DistributedBlockSampler(
                len(dataset),
                num_replicas=world,
                rank=rank,
                seed=seed,
                shuffle=shuffle,
                drop_last=drop_last,
                **common,
            )
        else:
            sampler = BlockShuffleSampler(len(dataset), seed=seed, shuffle=shuffle, **common)
    return SortedBatchSampler(sampler, batch_size, drop_last=drop_last, sort=args["sorted_batches"])


def _warn_unsharded(sampler, world: int) -> None:
    inner = getattr(sampler, "sampler", sampler)
    if not hasattr(sampler, "num_replicas") and not hasattr(inner, "num_replicas"):
        warnings.warn(
            f"world size {world} but the sampler {type(sampler).__name__} is not "
            f"distributed: every rank reads the same samples. Leave sampler=None (gpufeed "
            f"shards by rank) or pass a DistributedSampler / DistributedBlockSampler",
            stacklevel=3,
        )
