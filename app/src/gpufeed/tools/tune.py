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
again side by side in repeated interleaved rounds, each in a rotated order (A B C, B C A, ...),
so the reported ratios come from the same minutes of this (possibly shared) machine, and the
spread across rounds says how noisy those minutes were. The recommendation differs from the
defaults only when it beats them by more than that noise and by ``min_gain`` (else: "within
noise", the defaults): a search trial is one short reading, and its winner can be a lucky one.
A contender that runs with the defaults' own settings is measured once, as the defaults, and
reported at 1.00x. The result can be written as the settings file ``make_loader`` reads
(``settings=`` or env ``GPUFEED_LOADER_SETTINGS``); it records the batch size it was tuned at,
and make_loader warns when it is applied at another.

The measuring is a parameter of :func:`tune` (``measure``, ``plan``; see
:class:`~gpufeed.tools.tune_compare.TrialCosts`), so the decisions can be tested with fixed
readings.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufeed import cliargs
from gpufeed.tools.tune_compare import (
    MIN_ROUNDS,
    Measure,
    PlanOf,
    TrialCosts,
    compare_side_by_side,
    default_workers,
)
from gpufeed.tools.tune_result import Trial, TuneResult, snippet, write_settings

__all__ = ["add_arguments", "main", "tune"]


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
    measure: Measure | None = None,
    plan: PlanOf | None = None,
) -> TuneResult:
    """Search loader settings for ``dataset`` within ``budget_s`` seconds (the module
    docstring says how): every trial's start-up and shutdown count against the budget, and
    a trial that would end past it is not started (the first two, in-process and one
    worker, always run).

    Args:
        dataset: the dataset to tune for (as make_loader takes it).
        batch_size: the batch size to start from (half and double are tried).
        budget_s: seconds to spend, in all.
        batch_sizes: the batch sizes to try instead of half and double (the start alone
            keeps it fixed).
        cpus: the CPUs to plan with (None: those make_loader plans with, per local rank).
        device: a CUDA device to include the copy to the GPU and tune pin_memory (None or
            "cpu": no copy).
        min_gain: the factor samples/s must grow by for a step of the search to be kept,
            and the recommendation to beat the defaults by.
        compare: measure the winner, the defaults and the "1-2x cores" rule side by side
            at the end.
        log: called with each progress line.
        measure: ``measure(dataset, batch_size, settings, seconds, to_device) ->
            (samples/s, first batch s)`` reads one setting (default: a real loader, timed).
        plan: ``plan(dataset, batch_size, settings)`` gives the settings make_loader runs
            with (default: make_loader's plan).

    Returns:
        A :class:`~gpufeed.tools.tune_result.TuneResult`: the best trial, every trial, and
        the side-by-side comparison with its noise and verdict.
    """
    import torch
    from torch.utils.data import IterableDataset

    from gpufeed.data.order import DEFAULT_BLOCK_SIZE
    from gpufeed.loading.cpu_budget import loader_cpus

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
        costs=TrialCosts(measure, plan),
    )
    base: dict[str, Any] = {"pin_memory": cuda, "persistent_workers": True}
    if not iterable:
        base["block_size"] = int(getattr(dataset, "preferred_block_size", DEFAULT_BLOCK_SIZE))
    # warm up (open files, fill caches) before anything is compared
    search.costs.measure(dataset, batch_size, _with(base, num_workers=0), min(1.0, search.trial_s))
    # make_loader's own worker plan (its probe, once per process) is paid now, not in the
    # side-by-side check, whose time is then all reading
    if compare:
        search.default_workers = default_workers(dataset, batch_size, search.costs)
    fixed_s = time.perf_counter() - t_start
    best = search.workers(base)
    best = search.threads(best)
    best = search.prefetch(best)
    best = search.batch(best, batch_sizes or [max(1, batch_size // 2), batch_size * 2])
    if cuda:
        best = search.pin(best)
    if not iterable:
        best = search.block(best)
    result = TuneResult(best=best, trials=search.trials, cpus=cpus, seconds=0.0)
    squeezed_s = 0.0
    if compare:
        squeezed_s = compare_side_by_side(
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
    result.overhead_miss_s = search.costs.worst_miss
    # what ran whatever the budget: warm-up, make_loader's probe, the first two trials, and a
    # side-by-side check that had to run at its shortest
    result.minimum_s = fixed_s + sum(search.trial_walls[:2]) + squeezed_s
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
    costs: TrialCosts = field(default_factory=lambda: TrialCosts())
    trials: list[Trial] = field(default_factory=list)
    trial_walls: list[float] = field(default_factory=list)
    default_workers: int = 0

    def compare_reserve(self) -> float:
        """The least the side-by-side check needs: its first rounds (two, for a noise
        estimate), 0.1 s each, plus start-ups."""
        if not self.compare:
            return 0.0
        ws = (0, self.cpus, 2 * self.cpus, self.default_workers)
        return MIN_ROUNDS * sum(0.1 + self.costs.overhead({"num_workers": w}) for w in ws)

    def fits(self, settings: Mapping[str, Any]) -> bool:
        """A trial starts only if its reading and its overhead end before the search does
        and leave the side-by-side check its time."""
        end = time.perf_counter() + self.trial_s + self.costs.overhead(settings)
        return end <= self.search_end and end + self.compare_reserve() <= self.deadline

    def run(self, stage: str, bs: int, settings: dict[str, Any]) -> Trial:
        started = time.perf_counter()
        rate, first = self.costs.measure(self.dataset, bs, settings, self.trial_s, self.to_device)
        self.trial_walls.append(time.perf_counter() - started)
        t = Trial(dict(settings), bs, rate, first, stage)
        self.trials.append(t)
        self.log(f"  {stage:<10} {t.describe():<70} {rate:>10,.0f} samples/s")
        return t

    def gains(self, t: Trial, best: Trial) -> bool:
        return t.samples_per_s > best.samples_per_s * self.min_gain

    def workers(self, base: dict[str, Any]) -> Trial:
        """1-2: in-process and one worker (both always run: a result needs a best trial),
        then from the CPU quota upwards while samples/s grow."""
        from gpufeed.loading.cpu_budget import worker_count_for

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

    def threads(self, best: Trial) -> Trial:
        """2b: the batch decoder's threads per loading process (RandomResizedCrop's native
        backend, unless its own ``threads=`` is set): one, half and all of the CPUs each
        process has with the best worker count."""
        decode = getattr(self.dataset, "decode", None)
        if getattr(decode, "backend", None) != "native" or decode.threads is not None:
            return best
        nw = int(best.settings.get("num_workers", 0) or 0)
        each = max(1, self.cpus // max(1, nw))
        auto = decode.threads_for(nw)  # what the trials so far ran with
        for t in sorted({1, max(1, each // 2), each} - {auto}):
            settings = {**best.settings, "decoder_threads": t}
            if not self.fits(settings):
                break
            trial = self.run("threads", best.batch_size, settings)
            if self.gains(trial, best):
                best = trial
        return best

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


def add_arguments(p) -> None:
    """Add the ``gpufeed tune`` options (cli.py registers the subcommand; -q/-v/--json are
    common to every subcommand).

    Args:
        p: the subcommand's argparse parser.
    """
    p.add_argument(
        "path", metavar="PATH", type=cliargs.pack_path, help="a packed dataset: a folder or a URL"
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
    from gpufeed.tools.decode_options import add_crop_argument

    add_crop_argument(p)


def main(args) -> int:
    """Run ``gpufeed tune`` and print (or ``--write``) the settings it found.

    Args:
        args: the parsed command line (see add_arguments).

    Returns:
        The exit status.
    """
    from gpufeed.data.open import open_dataset
    from gpufeed.tools.decode_options import crop_options

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
    if result.seconds > args.budget:
        log(result.overrun_note(args.budget))
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
    if result.verdict:
        print(f"  {result.verdict}")
    for k, r in result.ratios().items():
        print(f"  {r:.2f}x {k.replace('_', ' ')} ({result.comparison_settings[k]})")
    print()
    print(snippet(result, args.path, args.write, args.crop))
    return 0
