"""``gpufeed bench``: how fast one dataset delivers batches with the chosen loader settings.

    gpufeed bench PATH [--batch-size 256] [--workers N] [--settings loader.json]
                       [--seconds 10] [--step-ms 20] [--device cuda] [--json]

What it reports: samples/s and MB/s in steady state (from the first batch on; the wait for the
first batch, which pays for worker start-up and opening files, is reported apart), throughput
over time, and, when a model step is simulated (``--step-ms``), the fraction of the time the
step waited for data. ``--device cuda`` adds the GPU measurements
(gpufeed.tools.gpu_report): host-to-device bandwidth pinned vs pageable, the overlap
DevicePrefetcher achieves, and uint8 transfer + on-device normalisation vs float transfer.

The clock is gpufeed.tools.timing (the comparison suite and ``gpufeed tune`` read it too),
the GPU measurements gpufeed.tools.gpu_report.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpufeed import cliargs
from gpufeed.tools.compare_plain import compare_plain, format_compare
from gpufeed.tools.decode_options import (
    add_crop_argument,
    add_decode_on_argument,
    crop_options,
    split_decode,
)
from gpufeed.tools.gpu_report import NO_CUDA, calibrated_step, gpu_report
from gpufeed.tools.timing import sleep_step, stop_workers, time_batches

__all__ = [
    "add_arguments",
    "compare_plain",
    "format_compare",
    "main",
    "run_bench",
]

EXPECT_GPU_ENV = "GPUFEED_EXPECT_GPU"


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
    decode_on: str = "auto",
) -> dict[str, Any]:
    """Bench the dataset at ``path`` through ``make_loader`` (the same call users make).

    Args:
        path: a pack's folder or URL (anything ``open_dataset`` opens).
        batch_size: samples per batch.
        settings: make_loader's ``settings`` (a dict, a JSON file, None: env
            ``GPUFEED_LOADER_SETTINGS``).
        loader_kwargs: other make_loader arguments.
        seconds: each pass's time cap (None: no cap).
        max_samples: each pass's sample cap (None: no cap).
        epochs: passes over the dataset.
        step_ms: a simulated model step per batch, in milliseconds (a sleep on the CPU, a
            calibrated GPU step on CUDA); 0: none.
        device: "cpu", or a CUDA device the batches are copied to (DevicePrefetcher).
        shuffle: make_loader's ``shuffle``.
        progress: show a progress bar per pass.
        log: called with each progress line.
        dataset_options: open_dataset's keyword arguments; a RandomResizedCrop in
            ``decode`` runs where ``decode_on`` says (see :func:`split_decode`).
        decode_on: "auto", "cuda" or "cpu".

    Returns:
        The report: the loader's plan, each pass's timings, the best pass's
        ``samples_per_s``, ``batch_mb_per_s`` and ``wait_fraction``, the first batch's time
        and, on CUDA, a GPU report.
    """

    from gpufeed.data.open import open_dataset
    from gpufeed.loading.make import make_loader

    options, device_crop, decoded_on = split_decode(dataset_options, device, decode_on)
    dataset = open_dataset(path, **options)
    kwargs = dict(loader_kwargs or {})
    t = time.perf_counter()
    loader = make_loader(dataset, batch_size, shuffle=shuffle, settings=settings, **kwargs)
    make_s = time.perf_counter() - t
    plan = loader.plan
    log(f"loader: {str(plan).splitlines()[0]}")
    source, step, cuda = _feed(loader, device, step_ms, device_crop)
    try:
        total = len(loader) * batch_size
    except TypeError:
        total = None
    passes = []
    for epoch in range(epochs):
        bar = _epoch_bar(epoch, total, max_samples) if progress else None
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
    stop_workers(loader)
    best = max(passes, key=lambda r: r.samples_per_s)
    report: dict[str, Any] = {
        "path": str(path),
        "dataset": repr(dataset),
        "batch_size": batch_size,
        "device": device if cuda or not str(device).startswith("cuda") else "cpu",
        "decode_on": decoded_on,
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


def _feed(loader, device: str, step_ms: float, crop=None):
    """(what the timing reads: the loader, or a DevicePrefetcher over it on CUDA (decoding
    with ``crop`` there when given); the model step: a sleep, a calibrated GPU step, or None;
    whether CUDA is used)."""
    import torch

    cuda = str(device).startswith("cuda") and torch.cuda.is_available()
    step = sleep_step(step_ms / 1e3) if step_ms > 0 and not cuda else None
    if not cuda:
        return loader, step, cuda
    from gpufeed.loading.prefetch import DevicePrefetcher

    if step_ms > 0:
        gstep, _ = calibrated_step(torch.device(device), step_ms)

        def step(batch):
            gstep(batch[0] if isinstance(batch, (tuple, list)) else batch)
            torch.cuda.current_stream().synchronize()

    prefetcher = DevicePrefetcher(loader, device, decode=crop, decode_on="cuda" if crop else "auto")
    return prefetcher, step, cuda


def _epoch_bar(epoch: int, total: int | None, max_samples: int | None):
    from tqdm import tqdm

    want = min(x for x in (total, max_samples) if x is not None) if total else max_samples
    return tqdm(
        total=want,
        desc=f"epoch {epoch}",
        unit="sample",
        unit_scale=True,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    )


def add_arguments(p) -> None:
    """Add the ``gpufeed bench`` options (cli.py registers the subcommand; -q/-v/--json are
    common to every subcommand).

    Args:
        p: the subcommand's argparse parser.
    """
    p.add_argument(
        "path", metavar="PATH", type=cliargs.pack_path, help="a packed dataset: a folder or a URL"
    )
    cliargs.add_cache_options(p)
    p.add_argument("--batch-size", "-b", type=cliargs.batch_size, default=256)
    p.add_argument(
        "--workers",
        "-j",
        type=cliargs.workers_or_auto,
        default=None,
        help="DataLoader workers, or auto (default: the settings file's, else auto: "
        "make_loader measures)",
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
        "ratios; the same DataLoader over the pack's first samples held in memory gives its "
        "own ceiling",
    )
    add_crop_argument(p)
    add_decode_on_argument(p)


def _loader_kwargs(args) -> dict[str, Any]:
    """make_loader's arguments for the options given: one left out leaves the settings file
    (--settings) or make_loader's default to decide."""
    kw: dict[str, Any] = {}
    if args.workers is not None:
        kw["num_workers"] = args.workers
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
        *([("decode", report["decode_on"])] if report.get("decode_on") else []),
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
    """Run ``gpufeed bench`` and print its report.

    Args:
        args: the parsed command line (see add_arguments).

    Returns:
        The exit status.
    """
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
            dataset_options=crop_options(args.crop) | cliargs.cache_options(args),
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
        dataset_options=crop_options(args.crop) | cliargs.cache_options(args),
        decode_on=args.decode_on,
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_table(report))
    return 0
