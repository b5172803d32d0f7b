"""``gpufeed bench``: how fast one dataset delivers batches with the chosen loader settings.

    gpufeed bench PATH [--batch-size 256] [--workers N] [--settings loader.json]
                       [--seconds 10] [--step-ms 20] [--device cuda] [--json]

What it reports: samples/s and MB/s in steady state (from the first batch on; the wait for the
first batch, which pays for worker start-up and opening files, is reported apart), throughput
over time, and, when a model step is simulated (``--step-ms``), the fraction of the time the
step waited for data. ``--device cuda`` adds the GPU measurements of :func:`gpu_report`:
host-to-device bandwidth pinned vs pageable, the overlap DevicePrefetcher achieves, and uint8
transfer + on-device normalisation vs float transfer.

The same functions serve the comparison suite (``bench/suite.py``) and ``gpufeed tune``:
:func:`time_batches` times any iterable of batches, whoever built it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "BenchResult",
    "add_arguments",
    "batch_nbytes",
    "batch_size_of",
    "compare_plain",
    "epoch_after_epoch",
    "format_compare",
    "gpu_report",
    "main",
    "run_bench",
    "sleep_step",
    "time_batches",
]

EXPECT_GPU_ENV = "GPUFEED_EXPECT_GPU"
NO_CUDA = "no CUDA device: GPU measurements skipped"


# --------------------------------------------------------------------------- timing


def _tensors(obj):
    from gpufeed.loader import iter_tensors  # torch stays unimported until a bench runs

    return iter_tensors(obj)


def batch_size_of(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor (gpufeed's Batch, a
    ``(samples, labels)`` tuple, a dict of tensors, a list of per-sample tensors)."""
    import torch

    samples = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(samples, Mapping):
        samples = next(iter(samples.values()))
    if isinstance(samples, torch.Tensor):
        return int(samples.shape[0]) if samples.dim() else 1
    if isinstance(samples, (list, tuple)):
        return len(samples)
    first = next(_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def batch_nbytes(batch) -> int:
    from gpufeed.loader import batch_nbytes as nbytes

    return nbytes(batch)


@dataclass
class BenchResult:
    """One timed pass. Rates are steady-state: samples after the first batch over the time
    after it; ``first_batch_s`` is the wait for the first batch."""

    samples: int
    batches: int
    seconds: float
    first_batch_s: float
    samples_per_s: float
    batch_mb_per_s: float
    wait_fraction: float | None = None
    step_ms: float = 0.0
    stopped_by: str = "end"
    timeline: list[tuple[float, int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sleep_step(step_s: float) -> Callable[[Any], None]:
    """A model step that takes ``step_s`` seconds without using the host CPU, as a GPU step
    does for the process that launched it (the workers keep every core)."""

    def step(_batch) -> None:
        time.sleep(step_s)

    return step


def time_batches(
    batches: Iterable,
    *,
    max_samples: int | None = None,
    max_seconds: float | None = None,
    step: Callable[[Any], None] | None = None,
    step_ms: float = 0.0,
    progress: Any = None,
    count: Callable[[Any], int] = batch_size_of,
    timeline_every_s: float = 0.25,
) -> BenchResult:
    """Iterate ``batches`` and time it. Stops at the end, after ``max_samples`` or after
    ``max_seconds`` (counted from the first batch). ``step(batch)`` runs after each batch
    (a simulated or real model step); the time spent waiting in ``next()`` is the data wait.
    ``progress`` is anything with ``update(n)`` (a tqdm bar)."""
    t0 = time.perf_counter()
    it = iter(batches)
    n = nb = n_first = 0
    nbytes = 0
    wait = busy = 0.0
    t_first = t_end = t0
    timeline: list[tuple[float, int]] = []
    next_mark = 0.0
    stopped = "end"
    try:
        while True:
            tw = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            k = count(batch)
            if nb == 0:
                t_first, n_first = now, k
            else:
                wait += now - tw
                nbytes += batch_nbytes(batch)
            nb += 1
            n += k
            if progress is not None:
                progress.update(k)
            if step is not None:
                ts = time.perf_counter()
                step(batch)
                busy += time.perf_counter() - ts
            t_end = time.perf_counter()
            if t_end - t_first >= next_mark:
                timeline.append((round(t_end - t0, 4), n))
                next_mark += timeline_every_s
            if max_samples is not None and n >= max_samples:
                stopped = "max_samples"
                break
            if max_seconds is not None and t_end - t_first >= max_seconds:
                stopped = "max_seconds"
                break
    finally:
        close = getattr(it, "close", None)  # a generator (GpufeedLoader's): run its finally
        if close is not None:
            close()
        del it
    if nb == 0:
        return BenchResult(0, 0, 0.0, time.perf_counter() - t0, 0.0, 0.0, stopped_by="empty")
    span = t_end - t_first
    steady = n - n_first
    rate = steady / span if span > 0 and steady > 0 else (n / max(1e-9, t_end - t0))
    mbps = nbytes / span / 1e6 if span > 0 else 0.0
    waitf = wait / (wait + busy) if step is not None and wait + busy > 0 else None
    timeline.append((round(t_end - t0, 4), n))
    return BenchResult(
        samples=n,
        batches=nb,
        seconds=span,
        first_batch_s=t_first - t0,
        samples_per_s=rate,
        batch_mb_per_s=mbps,
        wait_fraction=waitf,
        step_ms=step_ms,
        stopped_by=stopped,
        timeline=timeline,
    )


# -------------------------------------------------------------------------- the GPU


def _median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _calibrated_step(device, target_ms: float):
    """A compute-bound model step on ``device`` that takes about ``target_ms``: a chain of
    matmuls on a fixed weight, reading the batch (so it depends on the copy)."""
    import torch

    w = torch.randn(1024, 1024, device=device)
    sync = torch.cuda.synchronize

    def chain(reps: int, x: torch.Tensor) -> torch.Tensor:
        h = x.float().flatten(1)[:, :1024]
        if h.shape[1] < 1024:
            h = torch.nn.functional.pad(h, (0, 1024 - h.shape[1]))
        h = h[:1024] if h.shape[0] >= 1024 else torch.nn.functional.pad(h, (0, 0, 0, 1024 - len(h)))
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h.sum()

    x0 = torch.zeros(8, 1024, device=device)
    chain(4, x0)
    sync()
    reps = 4
    for _ in range(12):
        t = _median_time(lambda r=reps: chain(r, x0), 3, sync) * 1e3
        if t >= target_ms * 0.9:
            break
        reps = max(reps + 1, int(reps * target_ms / max(t, 1e-3)))
    return (lambda x: chain(reps, x)), reps


def gpu_report(
    batches: list | None = None,
    *,
    device: str = "cuda",
    batch_shape: tuple[int, ...] = (256, 3, 224, 224),
    step_ms: float = 20.0,
    n_batches: int = 24,
    copy_mb: int = 256,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The GPU-side measurements, or ``{"skipped": NO_CUDA}`` without CUDA.

    1. host-to-device bandwidth, pinned vs pageable (``copy_mb`` MiB, median of 10);
    2. the data-starvation percentage of a compute-bound step (``step_ms`` per batch): the
       step with batches already on the GPU vs the same step fed through DevicePrefetcher
       from pinned host batches, and fed by plain blocking copies from pageable memory;
    3. uint8 transfer + on-device float/normalise vs converting on the host and moving
       float32 (4x the bytes).

    ``batches``: real host batches (e.g. from a loader with pin_memory=True) of uint8
    samples; default synthetic uint8 batches of ``batch_shape``.
    """
    import torch

    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        return {"skipped": NO_CUDA}
    from gpufeed.prefetch import DevicePrefetcher

    dev = torch.device(device)
    sync = torch.cuda.synchronize
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}

    # 1. bandwidth
    nbytes = copy_mb << 20
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for name, src in (("pageable", pageable), ("pinned", pinned)):
        dst.copy_(src, non_blocking=True)
        t = _median_time(lambda s=src, d=dst: d.copy_(s, non_blocking=True), 10, sync)
        out[f"h2d_{name}_GBps"] = nbytes / t / 1e9
    out["h2d_pinned_vs_pageable"] = out["h2d_pinned_GBps"] / out["h2d_pageable_GBps"]
    log(
        f"host->device: pinned {out['h2d_pinned_GBps']:.1f} GB/s, pageable "
        f"{out['h2d_pageable_GBps']:.1f} GB/s ({out['h2d_pinned_vs_pageable']:.2f}x)"
    )
    del pageable, pinned, dst

    # 2. overlap
    if batches is None:
        g = torch.Generator().manual_seed(0)
        batches = [
            (
                torch.randint(0, 256, batch_shape, dtype=torch.uint8, generator=g).pin_memory(),
                torch.zeros(batch_shape[0], dtype=torch.int64).pin_memory(),
            )
            for _ in range(4)
        ]
        out["batches"] = f"synthetic uint8 {list(batch_shape)}"
    else:
        out["batches"] = f"{len(batches)} real batches"
    host = [batches[i % len(batches)] for i in range(n_batches)]
    step, reps = _calibrated_step(dev, step_ms)
    on_gpu = [(b[0].to(dev).float().div_(255), b[1].to(dev)) for b in host[: len(batches)]]

    def run_resident():
        for i in range(n_batches):
            step(on_gpu[i % len(on_gpu)][0])

    def run_prefetched():
        for x, _y in DevicePrefetcher(host, dev):
            step(x)

    pageable_host = [(b[0].clone(), b[1].clone()) for b in host]

    def run_naive():
        for x, _y in pageable_host:
            step(x.to(dev).float().div_(255))

    run_resident()
    run_prefetched()
    sync()
    t_res = _median_time(run_resident, 3, sync) / n_batches
    t_pre = _median_time(run_prefetched, 3, sync) / n_batches
    t_naive = _median_time(run_naive, 3, sync) / n_batches
    out["step_ms"] = t_res * 1e3
    out["prefetched_step_ms"] = t_pre * 1e3
    out["naive_step_ms"] = t_naive * 1e3
    out["starvation_prefetched_pct"] = max(0.0, (t_pre - t_res) / t_pre * 100)
    out["starvation_naive_pct"] = max(0.0, (t_naive - t_res) / t_naive * 100)
    log(
        f"compute-bound step {t_res * 1e3:.1f} ms: DevicePrefetcher starves "
        f"{out['starvation_prefetched_pct']:.1f}% ({t_pre * 1e3:.1f} ms/batch), plain "
        f".to() from pageable {out['starvation_naive_pct']:.1f}% ({t_naive * 1e3:.1f} ms)"
    )

    # 3. uint8 + on-device normalisation vs float transfer
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    x8 = host[0][0]
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)

    def u8_then_normalise():
        x = x8.to(dev, non_blocking=True).float().div_(255)
        x.sub_(m.to(dev)).div_(s.to(dev))

    def float_transfer():
        x = ((x8.float() / 255) - m) / s
        x.pin_memory().to(dev, non_blocking=True)

    u8_then_normalise()
    float_transfer()
    t_u8 = _median_time(u8_then_normalise, 10, sync)
    t_f32 = _median_time(float_transfer, 10, sync)
    out["uint8_normalise_on_gpu_ms"] = t_u8 * 1e3
    out["float_on_host_ms"] = t_f32 * 1e3
    out["uint8_vs_float_speedup"] = t_f32 / t_u8
    log(
        f"uint8 copy + on-GPU normalise {t_u8 * 1e3:.2f} ms vs host float + copy "
        f"{t_f32 * 1e3:.2f} ms per batch ({out['uint8_vs_float_speedup']:.1f}x)"
    )
    return out


# ------------------------------------------------------------------------ the command


def run_bench(
    path,
    *,
    batch_size: int = 256,
    settings=None,
    loader_kwargs: Mapping[str, Any] | None = None,
    seconds: float | None = 10.0,
    max_samples: int | None = None,
    epochs: int = 1,
    step_ms: float = 0.0,
    device: str = "cpu",
    shuffle: bool = True,
    progress: bool = False,
    log: Callable[[str], None] = lambda s: None,
    dataset_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Bench the dataset at ``path`` through ``make_loader`` (the same call users make):
    ``epochs`` passes (each capped by ``seconds`` and ``max_samples``), the report as a dict."""
    import torch

    from gpufeed.datasets import open_dataset
    from gpufeed.loader import make_loader

    dataset = open_dataset(path, **dict(dataset_options or {}))
    kwargs = dict(loader_kwargs or {})
    t = time.perf_counter()
    loader = make_loader(dataset, batch_size, shuffle=shuffle, settings=settings, **kwargs)
    make_s = time.perf_counter() - t
    plan = loader.plan
    log(f"loader: {str(plan).splitlines()[0]}")
    cuda = str(device).startswith("cuda") and torch.cuda.is_available()
    step = sleep_step(step_ms / 1e3) if step_ms > 0 and not cuda else None
    source: Iterable = loader
    if cuda:
        from gpufeed.prefetch import DevicePrefetcher

        if step_ms > 0:
            gstep, _ = _calibrated_step(torch.device(device), step_ms)

            def step(batch):  # noqa: F811 - the CUDA step replaces the sleeping one
                gstep(batch[0] if isinstance(batch, (tuple, list)) else batch)
                torch.cuda.current_stream().synchronize()

        source = DevicePrefetcher(loader, device)

    try:
        total = len(loader) * batch_size
    except TypeError:
        total = None
    passes = []
    for epoch in range(epochs):
        bar = None
        if progress:
            from tqdm import tqdm

            want = min(x for x in (total, max_samples) if x is not None) if total else max_samples
            bar = tqdm(
                total=want,
                desc=f"epoch {epoch}",
                unit="sample",
                unit_scale=True,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
            )
        try:
            loader.set_epoch(epoch)
            r = time_batches(
                source,
                max_samples=max_samples,
                max_seconds=seconds,
                step=step,
                step_ms=step_ms,
                progress=bar,
            )
        finally:
            if bar is not None:
                bar.close()
        passes.append(r)
        log(
            f"epoch {epoch}: {r.samples} samples, {r.samples_per_s:,.0f} samples/s, "
            f"{r.batch_mb_per_s:,.1f} MB/s, first batch {r.first_batch_s:.2f} s"
            + (f", data wait {r.wait_fraction:.1%}" if r.wait_fraction is not None else "")
        )
    _shutdown(loader)
    best = max(passes, key=lambda r: r.samples_per_s)
    report: dict[str, Any] = {
        "path": str(path),
        "dataset": repr(dataset),
        "batch_size": batch_size,
        "device": device if cuda or not str(device).startswith("cuda") else "cpu",
        "plan": {**plan.settings(), "reason": plan.reason, "cpus": plan.cpus},
        "make_loader_s": make_s,
        "passes": [p.to_json() for p in passes],
        "samples_per_s": best.samples_per_s,
        "median_samples_per_s": statistics.median(p.samples_per_s for p in passes),
        "batch_mb_per_s": best.batch_mb_per_s,
        "first_batch_s": passes[0].first_batch_s,
        "wait_fraction": best.wait_fraction,
    }
    if str(device).startswith("cuda"):
        report["gpu"] = gpu_report(device=device, step_ms=max(step_ms, 20.0), log=log)
    return report


def epoch_after_epoch(loader):
    """The batches of pass after pass over ``loader``, as training reads it (so a timing
    counts the turnover between epochs, and a small dataset's short passes)."""
    while True:
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if n == 0:
            return


def compare_plain(
    path,
    *,
    batch_size: int = 32,
    workers: tuple[int, ...] = (0, 2),
    seconds: float = 3.0,
    rounds: int = 3,
    pin_memory: bool | None = None,
    dataset_options: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """samples/s of the tutorial's plain ``DataLoader(dataset, batch_size, shuffle=True,
    num_workers=N, pin_memory=...)`` (``__getitems__`` then torch's default_collate) and of
    ``make_loader`` with the same arguments (``get_batch``: one stacked read per batch), on
    the same pack, for each worker count: every loader built and warmed first, then
    ``rounds`` interleaved rounds of ``seconds`` each, the median per loader, so the ratios
    come from the same minutes of a shared machine. Workers are persistent in both, so the
    rates are steady state. A tar stream is read unshuffled by the DataLoader (PyTorch
    refuses shuffle=True for an IterableDataset) and by its own shuffle buffer."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from gpufeed.datasets import open_dataset
    from gpufeed.loader import make_loader

    dataset = open_dataset(path, **dict(dataset_options or {}))
    shuffle = None if isinstance(dataset, IterableDataset) else True
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    loaders: dict[tuple[str, int], Iterable] = {}
    for w in workers:
        kw = dict(num_workers=w, pin_memory=pin, persistent_workers=w > 0)
        loaders["plain", w] = DataLoader(dataset, batch_size, shuffle, **kw)
        loaders["make_loader", w] = make_loader(dataset, batch_size, shuffle, **kw)

    rates: dict[tuple[str, int], list[float]] = {k: [] for k in loaders}
    try:
        for loader in loaders.values():  # start workers, open files, warm the page cache
            time_batches(epoch_after_epoch(loader), max_seconds=min(1.0, seconds))
        for r in range(rounds):
            for key, loader in loaders.items():
                rates[key].append(
                    time_batches(epoch_after_epoch(loader), max_seconds=seconds).samples_per_s
                )
            log(
                f"round {r + 1}/{rounds}: "
                + ", ".join(f"{k[0]}/{k[1]} {v[-1]:,.0f}" for k, v in rates.items())
            )
    finally:
        for loader in loaders.values():
            _shutdown(loader)
    out: dict[str, Any] = {
        "path": str(path),
        "dataset": repr(dataset),
        "batch_size": batch_size,
        "pin_memory": pin,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "workers": {},
    }
    for w in workers:
        plain = statistics.median(rates["plain", w])
        fast = statistics.median(rates["make_loader", w])
        out["workers"][w] = {
            "plain_samples_per_s": plain,
            "make_loader_samples_per_s": fast,
            "make_loader_vs_plain": fast / plain if plain > 0 else None,
        }
    return out


def format_compare(result: Mapping[str, Any]) -> str:
    lines = [
        f"{result['dataset']}, batch_size={result['batch_size']}, pin_memory="
        f"{result['pin_memory']}: median of {result['rounds']} interleaved rounds of "
        f"{result['seconds_per_round']:g} s",
        f"{'workers':>7}  {'DataLoader':>12}  {'make_loader':>12}  ratio",
    ]
    for w, row in result["workers"].items():
        ratio = row["make_loader_vs_plain"]
        lines.append(
            f"{w:>7}  {row['plain_samples_per_s']:>12,.0f}  "
            f"{row['make_loader_samples_per_s']:>12,.0f}  "
            + (f"{ratio:.2f}x" if ratio is not None else "-")
        )
    lines.append("(samples/s; ratio: make_loader over the plain DataLoader, same pack, same run)")
    return "\n".join(lines)


def _shutdown(loader) -> None:
    """Stop a loader's persistent workers now rather than at garbage collection (a
    GpufeedLoader or a torch DataLoader)."""
    dl = getattr(loader, "_dl", loader)
    it = getattr(dl, "_iterator", None) if dl is not None else None
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    if dl is not None:
        dl._iterator = None


def add_crop_argument(p) -> None:
    from gpufeed import cliargs

    p.add_argument(
        "--crop",
        type=cliargs.integer(1, 4096, "--crop"),
        metavar="N",
        help="encoded images: decode with gpufeed.RandomResizedCrop(N) (decode, crop, resize, "
        "flip: ImageNet's training augmentation) instead of the plain decode",
    )


def crop_options(crop: int | None) -> dict[str, Any]:
    """open_dataset options for ``--crop``."""
    if not crop:
        return {}
    from gpufeed.decoders import RandomResizedCrop

    return {"decode": RandomResizedCrop(crop)}


def add_arguments(p) -> None:
    """The ``gpufeed bench`` options (cli.py registers the subcommand; -q/-v/--json are
    common to every subcommand)."""
    from gpufeed import cliargs
    from gpufeed.cli import pack_path

    p.add_argument("path", metavar="PATH", type=pack_path, help="a packed dataset")
    p.add_argument("--batch-size", "-b", type=cliargs.batch_size, default=256)
    p.add_argument(
        "--workers",
        "-j",
        type=cliargs.workers_or_auto,
        default="auto",
        help="DataLoader workers (default auto: make_loader measures)",
    )
    p.add_argument("--prefetch-factor", type=cliargs.prefetch_factor, default=None)
    p.add_argument("--pin-memory", choices=("auto", "on", "off"), default="auto")
    p.add_argument(
        "--block-size",
        type=cliargs.integer(1, 1 << 24, "--block-size"),
        default=None,
        help="block-shuffle block size",
    )
    p.add_argument(
        "--settings",
        metavar="FILE",
        type=cliargs.settings_file,
        help="loader settings JSON (what `gpufeed tune --write` makes)",
    )
    p.add_argument(
        "--seconds",
        type=cliargs.seconds(0, 86400),
        default=None,
        help="time cap per pass, from the first batch (default 10; 0: no cap); with "
        "--compare-plain, per loader and round (default 3)",
    )
    p.add_argument(
        "--max-samples",
        type=cliargs.integer(1, None, "--max-samples"),
        default=None,
        help="sample cap per pass",
    )
    p.add_argument(
        "--epochs", type=cliargs.integer(1, 10000, "--epochs"), default=1, help="passes (default 1)"
    )
    p.add_argument(
        "--step-ms",
        type=cliargs.seconds(0, 60000),
        default=0.0,
        help="simulate a model step of this many ms per batch and report the "
        "fraction of time it waited for data",
    )
    p.add_argument(
        "--device",
        type=cliargs.device,
        default="cpu",
        help="cpu, or cuda[:N]: batches go through DevicePrefetcher and the GPU "
        "measurements run (bandwidth, overlap, uint8 vs float)",
    )
    p.add_argument("--sequential", action="store_true", help="storage order, no shuffle")
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="instead: read the pack through a plain torch DataLoader (the tutorial line: "
        "__getitems__ and default_collate) and through make_loader with the same arguments, "
        "0 and 2 workers, interleaved rounds of --seconds (default here 3), and print the "
        "ratios",
    )
    add_crop_argument(p)


def _loader_kwargs(args) -> dict[str, Any]:
    kw: dict[str, Any] = {"num_workers": args.workers}
    if args.prefetch_factor is not None:
        kw["prefetch_factor"] = args.prefetch_factor
    if args.pin_memory != "auto":
        kw["pin_memory"] = args.pin_memory == "on"
    if args.block_size is not None:
        kw["block_size"] = args.block_size
    return kw


def format_table(report: Mapping[str, Any]) -> str:
    rows = [
        ("dataset", report["dataset"]),
        ("settings", ", ".join(f"{k}={v}" for k, v in report["plan"].items() if k != "reason")),
        ("why", report["plan"]["reason"]),
        ("batch size", report["batch_size"]),
        (
            "samples/s",
            f"{report['samples_per_s']:,.0f} (median of passes "
            f"{report['median_samples_per_s']:,.0f})",
        ),
        ("MB/s", f"{report['batch_mb_per_s']:,.1f} (batches as delivered)"),
        (
            "first batch",
            f"{report['first_batch_s']:.2f} s (+ make_loader {report['make_loader_s']:.2f} s)",
        ),
    ]
    if report.get("wait_fraction") is not None:
        rows.append(("data wait", f"{report['wait_fraction']:.1%} of the simulated step time"))
    tl = report["passes"][-1]["timeline"]
    if len(tl) > 2:
        pts, prev = [], (0.0, 0)
        for t, n in tl[1:]:
            if t - prev[0] > 0:
                pts.append((n - prev[1]) / (t - prev[0]))
            prev = (t, n)
        rows.append(("over time", _sparkline(pts) + f"  ({min(pts):,.0f}..{max(pts):,.0f}/s)"))
    gpu = report.get("gpu")
    if gpu:
        if "skipped" in gpu:
            rows.append(("GPU", gpu["skipped"]))
        else:
            rows += [
                (
                    "H2D pinned",
                    f"{gpu['h2d_pinned_GBps']:.1f} GB/s "
                    f"({gpu['h2d_pinned_vs_pageable']:.2f}x pageable)",
                ),
                (
                    "starvation",
                    f"DevicePrefetcher {gpu['starvation_prefetched_pct']:.1f}%, "
                    f"plain .to() {gpu['starvation_naive_pct']:.1f}%",
                ),
                (
                    "uint8 vs f32",
                    f"{gpu['uint8_vs_float_speedup']:.1f}x faster to move uint8 "
                    f"and normalise on the GPU",
                ),
            ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return bars[-1] * min(len(values), 40)
    step = max(1, math.ceil(len(values) / 40))
    vals = [statistics.mean(values[i : i + step]) for i in range(0, len(values), step)]
    return "".join(bars[min(7, int((v - lo) / (hi - lo) * 7.999))] for v in vals)


def main(args) -> int:
    """Run ``gpufeed bench`` from parsed arguments; returns the exit code."""
    import torch

    want_cuda = str(args.device).startswith("cuda")
    expect = os.environ.get(EXPECT_GPU_ENV, "") not in ("", "0")
    if (want_cuda or expect) and not torch.cuda.is_available():
        print(f"gpufeed bench: {NO_CUDA}", file=sys.stderr)
        if expect:
            print(
                f"gpufeed bench: error: {EXPECT_GPU_ENV}=1 but torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda})",
                file=sys.stderr,
            )
            return 1
    quiet = args.json or args.quiet
    log = (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr))
    if args.compare_plain:
        result = compare_plain(
            args.path,
            batch_size=args.batch_size,
            seconds=args.seconds or 3.0,  # 0 or unset
            pin_memory=None if args.pin_memory == "auto" else args.pin_memory == "on",
            dataset_options=crop_options(args.crop),
            log=log,
        )
        print(json.dumps(result, indent=2) if args.json else format_compare(result))
        return 0
    report = run_bench(
        args.path,
        batch_size=args.batch_size,
        settings=args.settings,
        loader_kwargs=_loader_kwargs(args),
        seconds=10.0 if args.seconds is None else (args.seconds or None),
        max_samples=args.max_samples,
        epochs=args.epochs,
        step_ms=args.step_ms,
        device=args.device,
        shuffle=not args.sequential,
        progress=not quiet and sys.stderr.isatty(),
        log=log,
        dataset_options=crop_options(args.crop),
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_table(report))
    return 0
