"""Timing a stream of batches: samples/s in steady state, the wait for the first batch, and
the share of a (simulated) model step spent waiting for data. The one clock ``gpufeed
bench``, ``gpufeed tune`` and the comparison suite (``bench/suite.py``) all read: whoever built
the batches."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["BenchResult", "epoch_after_epoch", "sleep_step", "stop_workers", "time_batches"]


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
    count: Callable[[Any], int] | None = None,
    timeline_every_s: float = 0.25,
) -> BenchResult:
    """Iterate ``batches`` and time it. Stops at the end, after ``max_samples`` or after
    ``max_seconds`` (counted from the first batch). ``step(batch)`` runs after each batch
    (a simulated or real model step); the time spent waiting in ``next()`` is the data wait.
    ``progress`` is anything with ``update(n)`` (a tqdm bar). ``count(batch)``: its samples
    (default :func:`gpufeed.batch.batch_len`, 1 where the batch does not say)."""
    from gpufeed.batch import batch_len, batch_nbytes  # torch only once a bench runs

    count = count or (lambda b: batch_len(b) or 1)
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


def stop_workers(loader) -> None:
    """Stop a loader's persistent workers now rather than at garbage collection (a
    GpufeedLoader or a torch DataLoader)."""
    dl = getattr(loader, "_dl", loader)
    it = getattr(dl, "_iterator", None) if dl is not None else None
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()
    if dl is not None:
        dl._iterator = None
