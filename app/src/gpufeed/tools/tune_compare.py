"""The parts of ``gpufeed tune`` that measure: one trial of a setting
(:func:`measure_settings`), what trials cost beyond their reading (:class:`TrialCosts`), and
the side-by-side check of the search's winner against make_loader's defaults and the
1x/2x-cores rule (:func:`compare_side_by_side`), decided by :func:`decide`.

The clock is a parameter: :class:`TrialCosts` takes the function that measures a setting
(``measure``) and the one that says what settings a loader really runs with (``plan``), so a
test can give fixed readings, noise included."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from gpufeed.tools.tune_result import Trial, TuneResult

__all__ = [
    "MIN_ROUNDS",
    "Measure",
    "PlanOf",
    "TrialCosts",
    "compare_side_by_side",
    "decide",
    "default_workers",
    "loader_settings",
    "measure_settings",
    "spread",
]

# (dataset, batch size, settings, seconds, device to copy to) -> (samples/s, first batch s)
Measure = Callable[[Any, int, Mapping[str, Any], float, "str | None"], tuple[float, float]]
# (dataset, batch size, settings) -> the settings make_loader runs with (LoaderPlan.settings)
PlanOf = Callable[[Any, int, Mapping[str, Any]], Mapping[str, Any]]
# the side-by-side check's rounds: two at least, for a noise estimate (their spread)
MIN_ROUNDS = 2
MAX_ROUNDS = 7


def _loader(dataset, batch_size: int, settings: Mapping[str, Any]):
    """make_loader with ``settings`` and nothing else: ``settings={}`` keeps a settings file
    (env GPUFEED_LOADER_SETTINGS) out of what is measured; more workers than CPUs is a
    deliberate trial here, not a mistake to warn about."""
    from gpufeed.loading.make import make_loader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        return make_loader(dataset, batch_size, True, check_shm=False, settings={}, **settings)


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

    from gpufeed.tools.timing import epoch_after_epoch, stop_workers, time_batches

    loader = _loader(dataset, batch_size, settings)
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


def loader_settings(dataset, batch_size: int, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings make_loader runs with for ``settings`` ("auto" resolved; ``{}``: its
    defaults, whose worker count is measured once per process and batch size)."""
    from gpufeed.tools.timing import stop_workers

    loader = _loader(dataset, batch_size, settings)
    stop_workers(loader)
    return loader.plan.settings()


class TrialCosts:
    """What a trial costs beyond its steady reading (loader set-up, worker start-up, first
    batch, shutdown), measured per worker count, so the budget holds the whole trial.
    ``measure`` reads a setting (default :func:`measure_settings`), ``plan`` resolves one
    (default :func:`loader_settings`)."""

    def __init__(self, measure: Measure | None = None, plan: PlanOf | None = None):
        self.seen: dict[int, float] = {}
        # the most a trial's overhead exceeded its estimate: what the budget could not foresee
        self.worst_miss = 0.0
        self._measure = measure or measure_settings
        self._plan = plan or loader_settings
        self._plans: dict[tuple, dict[str, Any]] = {}

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
        rate, first = self._measure(dataset, bs, settings, seconds, to_device)
        extra = max(0.0, time.perf_counter() - t - seconds)
        self.worst_miss = max(self.worst_miss, extra - estimate)
        nw = int(settings.get("num_workers", 0) or 0)
        self.seen[nw] = max(extra, self.seen.get(nw, 0.0))
        return rate, first

    def plan(self, dataset, bs: int, settings: Mapping[str, Any]) -> dict[str, Any]:
        """What a loader with ``settings`` at batch size ``bs`` runs with (resolved once)."""
        key = (bs, tuple(sorted((k, repr(v)) for k, v in settings.items())))
        if key not in self._plans:
            self._plans[key] = dict(self._plan(dataset, bs, settings))
        return self._plans[key]


def default_workers(dataset, batch_size: int, costs: TrialCosts) -> int:
    """The worker count make_loader's defaults pick (measured once per process and batch
    size, then cached)."""
    return int(costs.plan(dataset, batch_size, {})["num_workers"])


def spread(values: list[float]) -> float:
    """The relative spread of one contender's readings across rounds, (max - min) / median:
    the noise a difference between contenders must exceed (infinite from one reading)."""
    mid = statistics.median(values) if values else 0.0
    if len(values) < 2 or mid <= 0:
        return float("inf")
    return (max(values) - min(values)) / mid


def decide(rates: Mapping[str, list[float]], same: Mapping[str, str], min_gain: float):
    """(chosen, noise, verdict) from each contender's readings per round. ``same`` maps a
    contender to the one whose effective settings it shares (measured once, as that one).

    The fastest contender other than the defaults (and not identical to them) wins only if
    its median beats the defaults' by more than the noise (the larger spread of the two) and
    by ``min_gain``; else the defaults stay, "within noise" where it was faster."""
    med = {k: statistics.median(v) for k, v in rates.items()}
    others = [k for k in rates if k != "defaults" and same.get(k, k) != "defaults"]
    note = "the search's best is make_loader's defaults" if same.get("tuned") == "defaults" else ""
    if not others:
        return "defaults", 0.0, note
    best = max(others, key=med.__getitem__)
    gain = med[best] / med["defaults"] if med["defaults"] > 0 else float("inf")
    noise = max(spread(rates[best]), spread(rates["defaults"]))
    need = max(min_gain, 1.0 + noise)
    if gain > need:
        chosen, verdict = best, f"{best} {gain:.2f}x the defaults, beyond the noise (±{noise:.0%})"
    elif gain > 1.0:
        chosen, verdict = (
            "defaults",
            (
                f"within noise: {best} measured {gain:.2f}x the defaults, noise ±{noise:.0%} "
                f"(a change needs more than {need:.2f}x); keeping the defaults"
            ),
        )
    else:
        chosen, verdict = "defaults", f"the defaults measured fastest (noise ±{noise:.0%})"
    return chosen, noise, f"{note}; {verdict}" if note else verdict


def compare_side_by_side(
    dataset,
    result: TuneResult,
    deadline: float,
    to_device,
    log,
    costs: TrialCosts | None = None,
    min_gain: float = 1.05,
    batch_size: int | None = None,
) -> float:
    """Measure the winner (at its batch size), and make_loader's defaults and the 1x/2x-cores
    rule at the requested ``batch_size`` (what runs without tune) side by side: at least
    :data:`MIN_ROUNDS` interleaved rounds, each in a rotated order (A B C, B C A, ...), all
    ending by ``deadline`` if two rounds of 0.05 s per contender fit. Contenders that run
    with the same settings (the search's best may be the defaults) are measured once and
    share their readings, so no gain is ever reported between them. :func:`decide` picks;
    returns how long the check ran past what fitted (0.0 when it fitted)."""
    started = time.perf_counter()
    costs = costs or TrialCosts()
    bs = batch_size or result.best.batch_size
    contenders: dict[str, tuple[int, dict[str, Any]]] = {
        "defaults": (bs, {}),
        "tuned": (result.best.batch_size, dict(result.best.settings)),
        "1x_cores": (bs, {"num_workers": result.cpus}),
        "2x_cores": (bs, {"num_workers": 2 * result.cpus}),
    }
    same = _identical(dataset, contenders, costs)
    defaults_nw = default_workers(dataset, bs, costs)
    result.comparison_settings = _described(result, bs, defaults_nw, same)
    rates, squeezed = _rounds(dataset, contenders, same, deadline, to_device, costs)
    result.comparison = c = {k: statistics.median(v) for k, v in rates.items()}
    chosen, result.noise, result.verdict = decide(rates, same, min_gain)
    log(f"side by side (median of {len(rates['defaults'])} interleaved rounds):")
    for k, v in c.items():
        log(f"  {k:<9} {v:>10,.0f} samples/s  {result.comparison_settings[k]}")
    log(result.verdict)
    if chosen != "tuned":
        # exactly what was measured: the contender's own settings (the defaults: the worker
        # count make_loader picked, prefetch at torch's 2), none of the search's block size
        nw = defaults_nw if chosen == "defaults" else contenders[chosen][1]["num_workers"]
        settings = {**contenders[chosen][1], "num_workers": nw}
        if nw:
            settings["prefetch_factor"] = 2
        result.searched, result.chosen = result.best, chosen
        result.best = Trial(settings, bs, c[chosen], result.best.first_batch_s, chosen)
    return time.perf_counter() - started if squeezed else 0.0


def _identical(dataset, contenders, costs: TrialCosts) -> dict[str, str]:
    """Each contender's first one (in order, the defaults first) with the same batch size and
    the same effective settings (``"auto"`` resolved as make_loader resolves it)."""
    first: dict[tuple, str] = {}
    same: dict[str, str] = {}
    for name, (size, settings) in contenders.items():
        key = (size, tuple(sorted(costs.plan(dataset, size, settings).items())))
        same[name] = first.setdefault(key, name)
    return same


def _described(result: TuneResult, bs: int, defaults_nw: int, same) -> dict[str, str]:
    text = {
        "defaults": f"batch_size={bs}, make_loader defaults (num_workers='auto': it picks "
        f"num_workers={defaults_nw})",
        "tuned": result.best.describe(),
        "1x_cores": f"batch_size={bs}, num_workers={result.cpus}",
        "2x_cores": f"batch_size={bs}, num_workers={2 * result.cpus}",
    }
    for name, twin in same.items():
        if twin != name:
            text[name] += f" = {'the defaults' if twin == 'defaults' else twin}, measured once"
    return text


def _rounds(dataset, contenders, same, deadline, to_device, costs: TrialCosts):
    """({contender: its samples/s per round}, whether the readings had to be squeezed below
    0.05 s). Twins share their first one's list."""
    names = [n for n in contenders if same[n] == n]

    def overhead() -> float:  # start-ups as measured so far
        return sum(costs.overhead(contenders[n][1]) for n in names)

    seconds = _reading_seconds(deadline - time.perf_counter(), len(names), overhead())
    squeezed = seconds < 0.05
    seconds = max(0.05, seconds)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(MAX_ROUNDS):
        # past the first two, a round starts only if it still fits: start-ups measured
        # cheaper than estimated leave time for more rounds than planned
        if r >= MIN_ROUNDS and time.perf_counter() + seconds * len(names) + overhead() > deadline:
            break
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotated: no contender always first or last
            size, settings = contenders[name]
            rates[name].append(costs.measure(dataset, size, settings, seconds, to_device)[0])
    return {n: rates[same[n]] for n in contenders}, squeezed


def _reading_seconds(left: float, contenders: int, overhead: float) -> float:
    """Seconds per reading for ``left`` seconds: as many rounds as give each reading 0.25 s
    (up to MAX_ROUNDS), never fewer than MIN_ROUNDS (the seconds may then be below 0.05)."""
    for rounds in range(MAX_ROUNDS, MIN_ROUNDS, -1):
        seconds = (left - rounds * overhead) / (rounds * contenders)
        if seconds >= 0.25:
            return seconds
    return (left - MIN_ROUNDS * overhead) / (MIN_ROUNDS * contenders)
