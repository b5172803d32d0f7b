"""The parts of ``gpufeed tune`` that measure: one trial of a setting
(:func:`measure_settings`), what trials cost beyond their reading (:class:`TrialCosts`), and
the side-by-side check of the search's winner against make_loader's defaults and the
1x/2x-cores rule (:func:`compare_side_by_side`)."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Mapping
from typing import Any

from gpufeed.tools.tune_result import Trial, TuneResult

__all__ = ["TrialCosts", "compare_side_by_side", "default_workers", "measure_settings"]


def measure_settings(
    dataset,
    batch_size: int,
    settings: Mapping[str, Any],
    seconds: float,
    to_device: str | None = None,
) -> tuple[float, float]:
    """Steady samples/s of one loader with these settings (workers started fresh and stopped
    after), and the seconds to its first batch."""
    import torch

    from gpufeed.loading.make import make_loader
    from gpufeed.tools.timing import epoch_after_epoch, stop_workers, time_batches

    with warnings.catch_warnings():
        # more workers than CPUs is a deliberate trial here, not a mistake to warn about
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        loader = make_loader(dataset, batch_size, True, check_shm=False, **settings)
    step = None
    if to_device:

        def step(batch):
            batch[0].to(to_device, non_blocking=True)
            torch.cuda.synchronize()

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
            r = time_batches(epoch_after_epoch(loader), max_seconds=seconds, step=step)
        return r.samples_per_s, r.first_batch_s
    finally:
        stop_workers(loader)


class TrialCosts:
    """What a trial costs beyond its steady reading (loader set-up, worker start-up, first
    batch, shutdown), measured per worker count, so the budget holds the whole trial."""

    def __init__(self):
        self.seen: dict[int, float] = {}
        # the most a trial's overhead exceeded its estimate: what the budget could not foresee
        self.worst_miss = 0.0

    def overhead(self, settings: Mapping[str, Any]) -> float:
        nw = int(settings.get("num_workers", 0) or 0)
        if nw in self.seen:
            return self.seen[nw]
        if not self.seen:
            return 0.5
        # start-up grows with the worker count: scale the dearest one seen
        k, v = max(self.seen.items(), key=lambda kv: kv[1])
        return v * max(1.0, nw / max(k, 1))

    def measure(self, dataset, bs, settings, seconds, to_device=None) -> tuple[float, float]:
        estimate = self.overhead(settings)
        t = time.perf_counter()
        rate, first = measure_settings(dataset, bs, settings, seconds, to_device)
        extra = max(0.0, time.perf_counter() - t - seconds)
        self.worst_miss = max(self.worst_miss, extra - estimate)
        nw = int(settings.get("num_workers", 0) or 0)
        self.seen[nw] = max(extra, self.seen.get(nw, 0.0))
        return rate, first


def default_workers(dataset, batch_size: int, costs: TrialCosts) -> int:
    """The worker count make_loader's defaults pick (measured once per process and batch
    size, then cached)."""
    from gpufeed.loading.make import make_loader
    from gpufeed.tools.timing import stop_workers

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        loader = make_loader(dataset, batch_size, True, check_shm=False)
    stop_workers(loader)
    return loader.plan.num_workers


def compare_side_by_side(
    dataset,
    result: TuneResult,
    deadline: float,
    to_device,
    log,
    costs=None,
    min_gain=1.05,
    batch_size: int | None = None,
) -> float:
    """Measure the winner (at its batch size), and make_loader's defaults and the 1x/2x-cores
    rule at the requested ``batch_size`` (what runs without tune) side by side: interleaved
    rounds, the median per contender, all ending by ``deadline`` if one round of 0.05 s per
    contender fits; returns how long it ran past what fitted (0.0 when it fitted)."""
    started = time.perf_counter()
    costs = costs or TrialCosts()
    tuned_bs = result.best.batch_size
    bs = batch_size or tuned_bs
    defaults_nw = default_workers(dataset, bs, costs)
    contenders: dict[str, dict[str, Any]] = {
        "tuned": dict(result.best.settings),
        "defaults": {},
        "1x_cores": {"num_workers": result.cpus},
        "2x_cores": {"num_workers": 2 * result.cpus},
    }
    result.comparison_settings = {
        "tuned": result.best.describe(),
        "defaults": f"batch_size={bs}, make_loader defaults (num_workers='auto')",
        "1x_cores": f"batch_size={bs}, num_workers={result.cpus}",
        "2x_cores": f"batch_size={bs}, num_workers={2 * result.cpus}",
    }
    result.comparison_settings["defaults"] += f" (it picks num_workers={defaults_nw})"
    workers = {
        "tuned": result.best.settings.get("num_workers", 0),
        "defaults": defaults_nw,
        "1x_cores": result.cpus,
        "2x_cores": 2 * result.cpus,
    }
    overhead = sum(costs.overhead({"num_workers": w}) for w in workers.values())
    left = deadline - time.perf_counter()
    rounds = 3
    seconds = (left - rounds * overhead) / (rounds * len(contenders))
    if seconds < 0.1:
        rounds = 1
        seconds = (left - overhead) / len(contenders)
    squeezed = seconds < 0.05
    seconds = max(0.05, seconds)
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(rounds):
        # a later round starts only if it still fits, with the start-ups measured so far
        round_s = seconds * len(contenders)
        round_s += sum(costs.overhead({"num_workers": w}) for w in workers.values())
        if r and time.perf_counter() + round_s > deadline:
            break
        for name, settings in contenders.items():
            size = tuned_bs if name == "tuned" else bs
            rates[name].append(costs.measure(dataset, size, settings, seconds, to_device)[0])
    result.comparison = c = {k: statistics.median(v) for k, v in rates.items()}
    log(f"side by side (median of {len(rates['tuned'])} interleaved rounds):")
    for k, v in c.items():
        log(f"  {k:<9} {v:>10,.0f} samples/s  {result.comparison_settings[k]}")
    # The recommendation is what measured fastest here, and a change from make_loader's
    # defaults only when it is worth min_gain: a search trial is one short reading on a
    # possibly shared machine, and its winner can be a lucky one.
    fastest = max(c, key=c.get)
    chosen = fastest if c[fastest] > c["defaults"] * min_gain else "defaults"
    if chosen != "tuned":
        # exactly what was measured: the contender's own settings (the defaults: the worker
        # count make_loader picked, prefetch at torch's 2), none of the search's block size
        nw = workers[chosen]
        settings = {**contenders[chosen], "num_workers": nw}
        if nw:
            settings["prefetch_factor"] = 2
        result.searched, result.chosen = result.best, chosen
        result.best = Trial(settings, bs, c[chosen], result.best.first_batch_s, chosen)
        log(
            f"recommending {chosen}: the search's choice measured {c['tuned'] / c[chosen]:.2f}x "
            f"it side by side"
        )
    return time.perf_counter() - started if squeezed else 0.0
