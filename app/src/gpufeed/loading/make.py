"""``make_loader()``: a DataLoader with measured defaults, block-shuffled order, distributed
sharding and mid-epoch resumption. It takes DataLoader's arguments under DataLoader's names,
in its order and with its defaults, except where its docstring says why not; it reads gpufeed
datasets through their batched fast path (``get_batch``/``iter_batches``), any other dataset
as DataLoader does.

What it decides, and from what:

- worker count: the CPUs this process may really use (affinity and cgroup quota, divided
  among the ``LOCAL_WORLD_SIZE`` ranks of this node), and whether workers help at all
  (``num_workers="auto"``: measured, gpufeed.loading.plan). ``loader.plan`` records the
  numbers and a reason.
- ``pin_memory`` only when CUDA is available; persistent workers when there are workers.
- order: :class:`~gpufeed.data.samplers.BlockShuffleSampler` (or
  :class:`~gpufeed.data.distributed.DistributedBlockSampler` under torchrun), batches sorted
  inside when the dataset says sorted reads are cheaper.
- ``/dev/shm``: warns when workers x prefetch x batch bytes will not fit (gpufeed.system.shm).
- every tunable setting, its default and its check: gpufeed.loading.settings.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from gpufeed.batch import batch_nbytes, collate
from gpufeed.data.distributed import DistributedBlockSampler, rank_and_world
from gpufeed.data.order import DEFAULT_BLOCK_SIZE
from gpufeed.data.samplers import BlockShuffleSampler, SortedBatchSampler
from gpufeed.data.streaming import TarShardDataset
from gpufeed.errors import ShmBudgetWarning, UsageError
from gpufeed.loading.cpu_budget import loader_cpus
from gpufeed.loading.loader import GpufeedLoader
from gpufeed.loading.plan import (
    LoaderPlan,
    default_multiprocessing_context,
    fast_path,
    iter_batches,
    plan_workers,
)
from gpufeed.loading.settings import (
    DEFAULTS,
    LoaderSettings,
    resolve_settings,
    with_given_arguments,
)
from gpufeed.pagecache.advise import READ_AHEAD_MIN_BYTES
from gpufeed.pagecache.plan import NO_READ_AHEAD, ReadAheadPlan
from gpufeed.system import thresholds
from gpufeed.system.shm import shm_budget

__all__ = ["make_loader"]

# small samples: read the blocks of the order a window ahead (see _read_ahead_plan); a module
# switch so that a benchmark can measure the loader with and without it
READ_AHEAD_RANGES = True


@with_given_arguments
def make_loader(
    dataset,
    batch_size: int = 1,
    shuffle: bool | None = None,
    sampler=None,
    batch_sampler=None,
    num_workers: int | str = DEFAULTS.num_workers,
    collate_fn: Callable | None = None,
    pin_memory: bool | str = DEFAULTS.pin_memory,
    drop_last: bool = False,
    timeout: float = 0,
    worker_init_fn: Callable | None = None,
    multiprocessing_context: str | None = DEFAULTS.multiprocessing_context,
    generator: torch.Generator | None = None,
    *,
    prefetch_factor: int | None = DEFAULTS.prefetch_factor,
    persistent_workers: bool = DEFAULTS.persistent_workers,
    pin_memory_device: str = "",
    in_order: bool = True,
    seed: int | None = None,
    block_size: int | str = DEFAULTS.block_size,
    buffer_blocks: int = DEFAULTS.buffer_blocks,
    sorted_batches: bool | str = DEFAULTS.sorted_batches,
    decoder_threads: int | str = DEFAULTS.decoder_threads,
    distributed: bool | str = "auto",
    rank: int | None = None,
    world_size: int | None = None,
    settings: str | os.PathLike | Mapping | None = None,
    probe_budget_s: float = 1.5,
    shm_path: str = "/dev/shm",
    check_shm: bool = True,
    given: frozenset[str] = frozenset(),
) -> GpufeedLoader:
    """``DataLoader``'s arguments, names, order and defaults, with measured settings, block
    shuffle, sharding by rank and mid-epoch resumption (see :class:`GpufeedLoader`).

    ``DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)`` and
    ``make_loader(dataset, 32, True, num_workers=4)`` read the same samples each epoch.
    Defaults that differ from DataLoader's: ``num_workers="auto"`` (DataLoader: 0),
    ``pin_memory="auto"`` (False), ``persistent_workers=True`` (False); why, below.

    The tunable arguments (those of :class:`~gpufeed.loading.settings.LoaderSettings`) may
    also come from ``settings``: an argument you pass wins, even one equal to its default.

    Args:
        dataset: a map-style or iterable dataset; gpufeed datasets hand over a whole batch
            at once (``get_batch``/``iter_batches``).
        batch_size: samples per batch.
        shuffle: None (as DataLoader: off) or True shuffles map-style datasets in blocks
            (:class:`~gpufeed.data.samplers.BlockShuffleSampler`: random order read in long
            runs; ``block_size=1`` is a uniform permutation). gpufeed's tar stream takes it
            as its own option (False: storage order; None: as the dataset was opened); any
            other IterableDataset with ``shuffle=True`` is an error, as in DataLoader.
        sampler: yours replaces the block shuffle, and distributed sharding is then yours
            too; gpufeed still sorts the indices inside each batch when
            ``sorted_batches``.
        batch_sampler: yours replaces the block shuffle and the sharding; its batches are
            read as given (not sorted).
        num_workers: ``"auto"`` measures in-process loading against workers on this dataset
            and batch size (about ``probe_budget_s`` seconds, once per dataset and batch size
            per process; see :func:`~gpufeed.loading.plan.plan_workers`): for cheap samples
            the worker IPC costs more than it saves. An int is used as given.
        collate_fn: None is the fast path: batches are :class:`~gpufeed.batch.Batch`
            ``(samples, labels)`` named tuples (one stacked tensor, one shared-memory
            segment per batch from a worker), which unpack as DataLoader's ``[samples,
            labels]`` do; other datasets' samples go through :func:`gpufeed.batch.collate`.
            A ``collate_fn`` of yours gets the list of samples, as with DataLoader.
        pin_memory: ``"auto"`` pins when CUDA is available.
        drop_last: as DataLoader's.
        timeout: as DataLoader's.
        worker_init_fn: runs in each worker after gpufeed seeds python, numpy and torch from
            ``(seed, epoch, rank, worker id)``.
        multiprocessing_context: None is fork on Linux unless CUDA is initialised, then
            spawn (:func:`~gpufeed.loading.plan.default_multiprocessing_context`);
            DataLoader leaves it to Python.
        generator: DataLoader's source of the random order; given instead of ``seed``, it
            draws the seed once.
        prefetch_factor: batches in flight per worker; None gives torch's 2.
        persistent_workers: True starts workers once, not every epoch (seconds each under
            spawn); only meaningful with workers.
        pin_memory_device: passed on (deprecated by torch).
        in_order: False hands out batches as workers finish them; resumption is then not
            exact.
        seed: the order is a function of the seed (default 0) and the epoch, the same on
            every rank and after a restart (what resumption needs).
        block_size: the block shuffle's block (see :mod:`gpufeed.data.order`); ``"auto"``
            takes the dataset's ``preferred_block_size`` attribute if it has one, else 256.
        buffer_blocks: consecutive blocks the block shuffle shuffles together (see
            :mod:`gpufeed.data.order`).
        sorted_batches: sort indices inside each batch (cheaper HDF5/mmap reads); ``"auto"``
            follows the dataset's ``prefers_sorted_reads`` attribute.
        decoder_threads: threads per loading process for a dataset's batch decoder that runs
            them (``RandomResizedCrop``'s native backend; its own ``threads=`` wins);
            ``"auto"``: the loader's CPUs shared by its processes. The worker plan measures
            in-process loading (all threads in one process) against workers with it.
        distributed: ``"auto"`` shards by rank when the world size is above 1: map-style
            datasets by :class:`~gpufeed.data.distributed.DistributedBlockSampler`, gpufeed's
            tar stream by equal shares of its samples (every rank the same number of
            batches); ``False`` reads everything on every rank; ``True`` shards always.
        rank: this process's rank (None: ``torch.distributed``, else env ``RANK``).
        world_size: the number of ranks (None: ``torch.distributed``, else env
            ``WORLD_SIZE``).
        settings: a dict or a JSON file with any of
            :class:`~gpufeed.loading.settings.LoaderSettings`' fields (what ``gpufeed tune``
            writes); None: the file named by env ``GPUFEED_LOADER_SETTINGS``, if any. A
            setting applies where you left its argument out.
        probe_budget_s: seconds the ``num_workers="auto"`` measurement may take.
        shm_path: the shared-memory folder ``check_shm`` looks at.
        check_shm: warn (:class:`~gpufeed.errors.ShmBudgetWarning`) when ``shm_path``
            cannot hold workers x prefetch_factor batches.

    Returns:
        A :class:`GpufeedLoader`: iterate it as a DataLoader; ``set_epoch``,
        ``state_dict``/``load_state_dict`` (mid-epoch resumption) and ``plan`` (the settings
        it runs with, and why).
    """
    _check_dataset(dataset)
    _check_dataloader_args(batch_size, shuffle, sampler, batch_sampler, drop_last)
    seed = _seed_from(seed, generator)
    arguments = {  # the tunable ones, by LoaderSettings' field names (SETTINGS_KEYS)
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "persistent_workers": persistent_workers,
        "prefetch_factor": prefetch_factor,
        "multiprocessing_context": multiprocessing_context,
        "block_size": block_size,
        "buffer_blocks": buffer_blocks,
        "sorted_batches": sorted_batches,
        "decoder_threads": decoder_threads,
    }
    tuned, from_settings = resolve_settings(arguments, given, settings, batch_size)
    tuned = _decide_auto(tuned, dataset)
    _set_decoder_threads(dataset, tuned.decoder_threads)
    batched = fast_path(dataset, collate_fn)
    dataloader_options = _dataloader_options(in_order, pin_memory_device)
    rank_, world = rank_and_world(rank, world_size)
    use_dist = distributed is True or (distributed == "auto" and world > 1)
    yours = sampler if sampler is not None else batch_sampler  # an order of your own
    dataset, batch_sampler = _order(
        dataset,
        batch_size,
        shuffle,
        sampler,
        batch_sampler,
        drop_last,
        seed,
        tuned,
        (rank_, world) if use_dist else None,
    )
    if yours is not None and world > 1 and distributed is not False:
        _warn_unsharded(yours, world)
    cpus, cpu_source = loader_cpus()
    if tuned.num_workers == "auto":
        nw, reason, measured, batch_bytes = _planned_workers(
            dataset, batch_size, batch_sampler, collate_fn, cpus, tuned, probe_budget_s, batched
        )
    else:
        nw, measured, batch_bytes = tuned.num_workers, {}, None
        reason = "from settings" if "num_workers" in from_settings else "as requested"
    prefetch = (2 if tuned.prefetch_factor is None else tuned.prefetch_factor) if nw > 0 else None
    shm_free = None
    if check_shm and nw > 0:
        if batch_bytes is None:
            batch_bytes = _sample_bytes(dataset, batch_size, collate_fn or collate, batched)
        if batch_bytes:
            shm_free = _check_shm(nw, prefetch, batch_bytes, shm_path)
    plan = LoaderPlan(
        num_workers=nw,
        pin_memory=bool(tuned.pin_memory),
        persistent_workers=bool(tuned.persistent_workers) and nw > 0,
        prefetch_factor=prefetch,
        multiprocessing_context=tuned.multiprocessing_context if nw > 0 else None,
        block_size=tuned.block_size,
        buffer_blocks=tuned.buffer_blocks,
        sorted_batches=tuned.sorted_batches,
        cpus=cpus,
        cpu_source=cpu_source,
        reason=reason,
        measured=measured,
        batch_bytes=batch_bytes,
        shm_free_bytes=shm_free,
        from_settings=from_settings,
        lookahead=_give_read_ahead(dataset, batch_sampler, nw),
        decoder_threads=tuned.decoder_threads,
    )
    return GpufeedLoader(
        dataset,
        batch_size=batch_size,
        plan=plan,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn or collate,
        drop_last=drop_last,
        seed=seed,
        rank=rank_,
        world_size=world,
        worker_init_fn=worker_init_fn,
        timeout=timeout,
        batched=batched,
        dataloader_options=dataloader_options,
    )


def _decide_auto(tuned: LoaderSettings, dataset) -> LoaderSettings:
    """The "auto" (and None) settings decided for this dataset and machine, but the worker
    count (measured later, over the order the loader will read)."""
    return tuned.replace(
        multiprocessing_context=(
            tuned.multiprocessing_context or default_multiprocessing_context()
        ),
        block_size=(
            int(getattr(dataset, "preferred_block_size", DEFAULT_BLOCK_SIZE))
            if tuned.block_size == "auto"
            else tuned.block_size
        ),
        sorted_batches=(
            bool(getattr(dataset, "prefers_sorted_reads", False))
            if tuned.sorted_batches == "auto"
            else tuned.sorted_batches
        ),
        pin_memory=torch.cuda.is_available() if tuned.pin_memory == "auto" else tuned.pin_memory,
    )


def _order(dataset, batch_size, shuffle, sampler, batch_sampler, drop_last, seed, tuned, place):
    """(the dataset as the loader reads it, the batch sampler or None): an iterable dataset
    set to ``shuffle`` and this ``place`` (rank, world; None: not distributed); a map-style
    one in gpufeed's order unless you gave a batch sampler."""
    if isinstance(dataset, IterableDataset):
        if batch_sampler is not None or sampler is not None:
            raise ValueError("DataLoader with IterableDataset: expected unspecified sampler option")
        return _iterable_for_rank(dataset, shuffle, *(place or (0, 1))), None
    if batch_sampler is None:
        batch_sampler = _batches(
            dataset, batch_size, bool(shuffle), sampler, drop_last, seed, tuned, place
        )
    return dataset, batch_sampler


def _planned_workers(
    dataset, batch_size, batch_sampler, collate_fn, cpus, tuned, budget_s, batched
):
    """plan_workers over the first batches of the order the loader will read."""
    probe_indices = None
    if isinstance(batch_sampler, SortedBatchSampler):
        batch_sampler.set_epoch(0)
    if batch_sampler is not None:
        probe_indices = iter(batch_sampler)
    return plan_workers(
        dataset,
        batch_size,
        batch_indices=probe_indices,
        collate_fn=collate_fn,
        cpus=cpus,
        multiprocessing_context=tuned.multiprocessing_context,
        budget_s=budget_s,
        batched=batched,
    )


def _set_decoder_threads(dataset, threads: int | str) -> None:
    """Tell the dataset's batch decoder the loader's ``decoder_threads`` (each make_loader
    call anew, so a loader never inherits an earlier one's)."""
    decode = getattr(dataset, "decode", None)
    if hasattr(decode, "loader_threads"):
        decode.loader_threads = None if threads == "auto" else int(threads)


def _give_read_ahead(dataset, batch_sampler, workers: int) -> int:
    """The read-ahead plan made once (_read_ahead_plan) and given to the batch sampler when
    it reads ahead; its lookahead (0: none)."""
    plan = _read_ahead_plan(dataset, batch_sampler, workers)
    if plan.lookahead >= 1:
        batch_sampler.set_read_ahead(plan)
    return plan.lookahead


def _read_ahead_plan(dataset, batch_sampler, workers: int) -> ReadAheadPlan:
    """The epoch's read-ahead (made once, given to the batch sampler): large samples, each
    reader asks the kernel for its next batch while copying this one; small ones, the
    blocks of the order a window of the block shuffle ahead, one request a block, where the
    reader reads_ranges_ahead (mmap, mapped HDF5, LMDB; READ_AHEAD_RANGES switches it off)
    in shuffled epochs, and in storage order where it reads_ranges_ahead_in_order (LMDB), so
    cold reads keep many large requests in flight; an epoch whose data looks cached as it
    starts (reader.looks_warm) announces none. NO_READ_AHEAD: off."""
    reader = getattr(dataset, "reader", None)
    if reader is None or not isinstance(batch_sampler, SortedBatchSampler):
        return NO_READ_AHEAD
    remote = getattr(reader, "source", None) is not None  # fetch the shards to come
    sized = hasattr(reader, "mean_sample_bytes")
    if remote or (sized and reader.mean_sample_bytes() >= READ_AHEAD_MIN_BYTES):
        return ReadAheadPlan(lookahead=max(1, workers))
    # shuffled epochs, and storage order only where the reader says so: there the kernel's
    # own readahead streams most files, and blocks announced on top measured slower
    # (docs/performance/page-cache-read-ahead.md), but not LMDB's
    order = batch_sampler.sampler
    in_order = getattr(reader, "reads_ranges_ahead_in_order", False)
    block = getattr(order, "block_size", 0) if getattr(order, "shuffle", False) or in_order else 0
    if READ_AHEAD_RANGES and block >= 1 and getattr(reader, "reads_ranges_ahead", False):
        window = block * getattr(order, "buffer_blocks", 1)
        return ReadAheadPlan(
            lookahead=max(1, workers, -(-window // batch_sampler.batch_size)),
            range_block=block,
            looks_warm=reader.looks_warm,
        )
    return NO_READ_AHEAD


def _check_shm(workers: int, prefetch: int, batch_bytes: int, shm_path: str) -> int | None:
    """Warn (ShmBudgetWarning) when the workers' batches will not fit in ``shm_path``, or it
    is below the thresholds' floor; its free bytes (None when it does not exist)."""
    try:
        floor = thresholds.min_shm_bytes()
    except (OSError, KeyError, ValueError):
        floor = 0
    budget = shm_budget(workers, prefetch, batch_bytes, floor, shm_path)
    if budget is None or workers == 0:
        return None if budget is None else budget.free_bytes
    need, free, gib = budget.need_bytes, budget.free_bytes, budget.suggested_gib()
    if not budget.fits:
        warnings.warn(
            f"{shm_path} has {free / 2**20:.0f} MiB free but {workers} workers x "
            f"prefetch_factor {prefetch} x {batch_bytes / 2**20:.1f} MiB batches need "
            f"~{need / 2**20:.0f} MiB: workers will fail with 'Bus error'. Give the container "
            f"more shared memory (docker run --shm-size={gib}g, compose `shm_size: "
            f"{gib}gb`), or use fewer workers (num_workers={budget.workers_that_fit()}), a "
            f"smaller batch or prefetch_factor",
            ShmBudgetWarning,
            stacklevel=4,
        )
    elif budget.below_floor:
        warnings.warn(
            f"{shm_path} is {budget.total_bytes / 2**20:.0f} MiB, below GPUFEED_MIN_SHM_MB="
            f"{floor >> 20}; enough for this loader now, but larger batches or more workers "
            f"will fail with 'Bus error'. Use docker run --shm-size or compose `shm_size`",
            ShmBudgetWarning,
            stacklevel=4,
        )
    return free


def _sample_bytes(dataset, batch_size, collate, batched: bool) -> int | None:
    try:
        if isinstance(dataset, IterableDataset):
            batch = next(iter_batches(dataset, batch_size, collate, batched), None)
            return None if batch is None else batch_nbytes(batch)
        if len(dataset) == 0:
            return None
        return batch_nbytes(dataset[0]) * batch_size
    except Exception as exc:  # sizing is advisory; the real error surfaces when iterating
        warnings.warn(f"could not size a batch for the /dev/shm check: {exc!r}", stacklevel=4)
        return None


def _check_dataset(dataset) -> None:
    """A path is not a dataset: a str would be read as a sequence of its characters."""
    if isinstance(dataset, (str, bytes, bytearray, os.PathLike)):
        shown = repr(os.fsdecode(dataset) if isinstance(dataset, os.PathLike) else dataset)
        raise UsageError(
            f"make_loader got the path {shown[:200]}, not a dataset; open it first: "
            f"make_loader(gpufeed.open_dataset({shown[:200]}), batch_size=...)"
        )


def _check_dataloader_args(batch_size, shuffle, sampler, batch_sampler, drop_last):
    """DataLoader's own rules for its arguments, with its wording, raised before anything
    is measured (the tunable settings are checked by LoaderSettings)."""
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


def _batches(dataset, batch_size, shuffle, sampler, drop_last, seed, tuned, place):
    """gpufeed's batch sampler for a map-style dataset: block-shuffled (or in order), split
    by ``place`` (rank, world) when distributed (not None), over ``sampler`` when you gave
    one; indices sorted inside each batch when ``sorted_batches``."""
    if sampler is None:
        common = dict(block_size=tuned.block_size, buffer_blocks=tuned.buffer_blocks)
        if place is not None:
            rank, world = place
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
    return SortedBatchSampler(sampler, batch_size, drop_last=drop_last, sort=tuned.sorted_batches)


def _warn_unsharded(sampler, world: int) -> None:
    inner = getattr(sampler, "sampler", sampler)
    if not hasattr(sampler, "num_replicas") and not hasattr(inner, "num_replicas"):
        warnings.warn(
            f"world size {world} but the sampler {type(sampler).__name__} is not "
            f"distributed: every rank reads the same samples. Leave sampler=None (gpufeed "
            f"shards by rank) or pass a DistributedSampler / DistributedBlockSampler",
            stacklevel=4,
        )
