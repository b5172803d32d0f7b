"""``gpufeed tune``: find the fastest loader settings for this machine and dataset.

    gpufeed tune PATH [--batch-size 256] [--budget 60] [--write loader.json]

Not an exhaustive grid: each setting is climbed from a measured start while throughput grows.

1. in-process (0 workers) and 1 worker: the cost of one batch, with and without IPC;
2. workers: from the CPU quota (affinity and cgroup, see :mod:`gpufeed.system.sysinfo`) upwards
   while samples/s grow by more than ``min_gain`` (I/O-bound reads gain from more workers
   than cores; CPU-bound ones stop at the quota), downwards when the quota was already worse;
3. prefetch factor 2 -> 4 -> 8 while it helps, with the best worker count;
4. batch size: half and double the requested one (samples/s, not batches/s);
5. pin_memory on/off with a copy to the GPU in the loop (only with CUDA);
6. block size of the block-shuffle sampler (map-style datasets): a quarter and 4x.

Then the winner, ``make_loader``'s defaults and the "1-2x cores" rule of thumb are measured
again side by side, interleaved, so the reported ratios come from the same minutes of this
(possibly shared) machine. The recommendation is the fastest there, and differs from the
defaults only when it beats them by ``min_gain``: a search trial is one short reading, and
its winner can be a lucky one. The result can be written as the settings file
``make_loader`` reads (``settings=`` or env ``GPUFEED_LOADER_SETTINGS``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufeed import cliargs
from gpufeed.tools.tune_result import Trial, TuneResult, snippet, write_settings

__all__ = ["add_arguments", "main", "tune"]


def _measure(
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


def tune(
    dataset,
    *,
    batch_size: int = 256,
    budget_s: float = 60.0,
    batch_sizes: list[int] | None = None,
    cpus: int | None = None,
    device: str | None = None,
    min_gain: float = 1.05,
    compare: bool = True,
    log: Callable[[str], None] = lambda s: None,
) -> TuneResult:
    """Search loader settings for ``dataset`` within ``budget_s`` seconds: every trial's
    start-up and shutdown count against the budget, and a trial that would end past it is
    not started (the first two, in-process and one worker, always run)."""
    import torch
    from torch.utils.data import IterableDataset

    from gpufeed.data.order import DEFAULT_BLOCK_SIZE
    from gpufeed.loading.outlook import loader_cpus

    t_start = time.perf_counter()
    cpus = cpus or loader_cpus()[0]  # the CPUs make_loader plans with (per local rank)
    iterable = isinstance(dataset, IterableDataset)
    cuda = bool(device) and str(device).startswith("cuda") and torch.cuda.is_available()
    search_share = 0.7 if compare else 1.0
    search = _Search(
        dataset,
        batch_size,
        cpus,
        device if cuda else None,
        compare,
        min_gain,
        log,
        # 3% kept back: shutdowns vary more than start-ups, and the budget is a promise
        deadline=t_start + budget_s * 0.97,
        search_end=t_start + budget_s * search_share,
        # about 16 trials fit a search; each at least 0.25 s of steady reading
        trial_s=max(0.25, budget_s * search_share / 16),
    )
    base: dict[str, Any] = {"pin_memory": cuda, "persistent_workers": True}
    if not iterable:
        base["block_size"] = int(getattr(dataset, "preferred_block_size", DEFAULT_BLOCK_SIZE))
    # warm up (open files, fill caches) before anything is compared
    search.costs.measure(dataset, batch_size, _with(base, num_workers=0), min(1.0, search.trial_s))
    # make_loader's own worker plan (its probe, once per process) is paid now, not in the
    # side-by-side check, whose time is then all reading
    if compare:
        search.default_workers = _default_workers(dataset, batch_size, search.costs)
    best = search.workers(base)
    best = search.prefetch(best)
    best = search.batch(best, batch_sizes or [max(1, batch_size // 2), batch_size * 2])
    if cuda:
        best = search.pin(best)
    if not iterable:
        best = search.block(best)
    result = TuneResult(best=best, trials=search.trials, cpus=cpus, seconds=0.0)
    if compare:
        _compare(
            dataset,
            result,
            search.deadline,
            search.to_device,
            log,
            search.costs,
            min_gain,
            batch_size,
        )
    result.seconds = time.perf_counter() - t_start
    return result


def _with(settings: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """Settings with some changed; no prefetch_factor without workers (torch refuses it)."""
    d = {**settings, **changes}
    if d.get("num_workers", 0) == 0:
        d.pop("prefetch_factor", None)
    return d


@dataclass
class _Search:
    """The search's state: its clock, its trials, and one method per stage, each climbing
    one setting from the best trial so far while it gains ``min_gain``."""

    dataset: Any
    batch_size: int
    cpus: int
    to_device: str | None
    compare: bool
    min_gain: float
    log: Callable[[str], None]
    deadline: float
    search_end: float
    trial_s: float
    costs: _TrialCosts = field(default_factory=lambda: _TrialCosts())
    trials: list[Trial] = field(default_factory=list)
    default_workers: int = 0

    def compare_reserve(self) -> float:
        """The least the side-by-side check needs: one round, 0.1 s each, plus start-ups."""
        if not self.compare:
            return 0.0
        ws = (0, self.cpus, 2 * self.cpus, self.default_workers)
        return sum(0.1 + self.costs.overhead({"num_workers": w}) for w in ws)

    def fits(self, settings: Mapping[str, Any]) -> bool:
        """A trial starts only if its reading and its overhead end before the search does
        and leave the side-by-side check its time."""
        end = time.perf_counter() + self.trial_s + self.costs.overhead(settings)
        return end <= self.search_end and end + self.compare_reserve() <= self.deadline

    def run(self, stage: str, bs: int, settings: dict[str, Any]) -> Trial:
        rate, first = self.costs.measure(self.dataset, bs, settings, self.trial_s, self.to_device)
        t = Trial(dict(settings), bs, rate, first, stage)
        self.trials.append(t)
        self.log(f"  {stage:<10} {t.describe():<70} {rate:>10,.0f} samples/s")
        return t

    def gains(self, t: Trial, best: Trial) -> bool:
        return t.samples_per_s > best.samples_per_s * self.min_gain

    def workers(self, base: dict[str, Any]) -> Trial:
        """1-2: in-process and one worker (both always run: a result needs a best trial),
        then from the CPU quota upwards while samples/s grow."""
        from gpufeed.loading.outlook import worker_count_for

        bs = self.batch_size
        best = self.run("in-process", bs, _with(base, num_workers=0))
        one = self.run("workers", bs, _with(base, num_workers=1, prefetch_factor=2))
        if one.samples_per_s > best.samples_per_s:
            best = one
        w = worker_count_for(self.cpus)
        tried = {0, 1}
        first_w = _with(base, num_workers=w, prefetch_factor=2)
        if w in tried or not self.fits(first_w):
            return best
        t = self.run("workers", bs, first_w)
        tried.add(w)
        if t.samples_per_s > best.samples_per_s:
            best = t
        while True:  # climb while throughput grows
            nxt = w + max(1, w // 2)
            if nxt > max(4 * self.cpus, 4) or nxt in tried:
                return best
            settings = _with(base, num_workers=nxt, prefetch_factor=2)
            if not self.fits(settings):
                return best
            t = self.run("workers", bs, settings)
            tried.add(nxt)
            if not self.gains(t, best):
                return best
            best, w = t, nxt

    def prefetch(self, best: Trial) -> Trial:
        """3: prefetch factor 2 -> 4 -> 8 with the best worker count."""
        if best.settings.get("num_workers", 0) <= 0:
            return best
        pf = 2
        while pf < 8:
            pf *= 2
            settings = _with(best.settings, prefetch_factor=pf)
            if not self.fits(settings):
                break
            t = self.run("prefetch", self.batch_size, settings)
            if not self.gains(t, best):
                break
            best = t
        return best

    def batch(self, best: Trial, candidates: list[int]) -> Trial:
        """4: other batch sizes (samples/s, not batches/s)."""
        for bs in candidates:
            if bs == best.batch_size or not self.fits(best.settings):
                continue
            t = self.run("batch", bs, dict(best.settings))
            if self.gains(t, best):
                best = t
        return best

    def pin(self, best: Trial) -> Trial:
        """5: pin_memory flipped (only meaningful with a GPU to copy to)."""
        flipped = _with(best.settings, pin_memory=not best.settings["pin_memory"])
        if self.fits(flipped):
            t = self.run("pin", best.batch_size, flipped)
            if self.gains(t, best):
                return t
        return best

    def block(self, best: Trial) -> Trial:
        """6: the block shuffle's block size, a quarter and 4x."""
        b0 = best.settings["block_size"]
        for bsz in (b0 * 4, max(16, b0 // 4)):
            settings = _with(best.settings, block_size=bsz)
            if not self.fits(settings):
                break
            t = self.run("block", best.batch_size, settings)
            if self.gains(t, best):
                return t
        return best


class _TrialCosts:
    """What a trial costs beyond its steady reading (loader set-up, worker start-up, first
    batch, shutdown), measured per worker count, so the budget holds the whole trial."""

    def __init__(self):
        self.seen: dict[int, float] = {}

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
        t = time.perf_counter()
        rate, first = _measure(dataset, bs, settings, seconds, to_device)
        extra = max(0.0, time.perf_counter() - t - seconds)
        nw = int(settings.get("num_workers", 0) or 0)
        self.seen[nw] = max(extra, self.seen.get(nw, 0.0))
        return rate, first


def _default_workers(dataset, batch_size: int, costs: _TrialCosts) -> int:
    """The worker count make_loader's defaults pick (measured once per process and batch
    size, then cached)."""
    from gpufeed.loading.make import make_loader
    from gpufeed.tools.timing import stop_workers

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DataLoader will create.*")
        loader = make_loader(dataset, batch_size, True, check_shm=False)
    stop_workers(loader)
    return loader.plan.num_workers


def _compare(
    dataset,
    result: TuneResult,
    deadline: float,
    to_device,
    log,
    costs=None,
    min_gain=1.05,
    batch_size: int | None = None,
) -> None:
    """Measure the winner (at its batch size), and make_loader's defaults and the 1x/2x-cores
    rule at the requested ``batch_size`` (what runs without tune) side by side: interleaved
    rounds, the median per contender, all ending by ``deadline``."""
    costs = costs or _TrialCosts()
    tuned_bs = result.best.batch_size
    bs = batch_size or tuned_bs
    default_workers = _default_workers(dataset, bs, costs)
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
    result.comparison_settings["defaults"] += f" (it picks num_workers={default_workers})"
    workers = {
        "tuned": result.best.settings.get("num_workers", 0),
        "defaults": default_workers,
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
    seconds = max(0.05, seconds)
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, settings in contenders.items():
            size = tuned_bs if name == "tuned" else bs
            rates[name].append(costs.measure(dataset, size, settings, seconds, to_device)[0])
    result.comparison = c = {k: statistics.median(v) for k, v in rates.items()}
    log(f"side by side (median of {rounds} interleaved rounds):")
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


def add_arguments(p) -> None:
    """The ``gpufeed tune`` options (cli.py registers the subcommand; -q/-v/--json are common
    to every subcommand)."""
    from gpufeed.cli import pack_path

    p.add_argument(
        "path", metavar="PATH", type=pack_path, help="a packed dataset: a folder or a URL"
    )
    cliargs.add_cache_options(p)
    p.add_argument(
        "--batch-size",
        "-b",
        type=cliargs.batch_size,
        default=256,
        help="the batch size to start from (half and double are tried)",
    )
    p.add_argument(
        "--batch-sizes",
        metavar="LIST",
        type=cliargs.batch_sizes,
        help="comma-separated batch sizes to try instead of half/double; give the "
        "start alone to keep it fixed",
    )
    p.add_argument(
        "--budget",
        type=cliargs.seconds(1, 86400),
        default=60.0,
        help="seconds to spend (default 60)",
    )
    p.add_argument(
        "--device",
        type=cliargs.device,
        default=None,
        help="cuda[:N]: include the copy to the GPU and tune pin_memory",
    )
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="skip the side-by-side check against the defaults and 1-2x cores",
    )
    p.add_argument("--write", metavar="FILE", help="write the settings file make_loader reads")
    from gpufeed.tools.bench import add_crop_argument

    add_crop_argument(p)


def main(args) -> int:
    from gpufeed.data.open import open_dataset
    from gpufeed.tools.bench import crop_options

    quiet = args.json or args.quiet
    log = (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr))
    sizes = args.batch_sizes
    if args.device and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # said, never silently left out
            print(
                "gpufeed tune: no CUDA device: the copy to the GPU is not measured", file=sys.stderr
            )
    dataset = open_dataset(args.path, **crop_options(args.crop), **cliargs.cache_options(args))
    log(f"tuning {dataset!r} for about {args.budget:.0f} s")
    result = tune(
        dataset,
        batch_size=args.batch_size,
        budget_s=args.budget,
        batch_sizes=sizes,
        device=args.device,
        compare=not args.no_compare,
        log=log,
    )
    if args.write:
        write_settings(result, args.write)
        log(f"wrote {args.write}")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(
        f"best: {result.best.describe()}: {result.best.samples_per_s:,.0f} samples/s "
        f"({len(result.trials)} trials, {result.seconds:.0f} s, {result.cpus} usable CPUs)"
    )
    for k, r in result.ratios().items():
        print(f"  {r:.2f}x {k.replace('_', ' ')} ({result.comparison_settings[k]})")
    if result.searched is not None:
        print(
            f"  (the search's best, {result.searched.describe()}, measured "
            f"{result.comparison['tuned']:,.0f} samples/s side by side: not worth a change)"
        )
    print()
    print(snippet(result, args.path, args.write, args.crop))
    return 0
