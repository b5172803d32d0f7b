"""The GPU side of ``gpufeed bench --device cuda``: host-to-device bandwidth (pinned vs
pageable), how much of a compute-bound step DevicePrefetcher hides, and uint8 transfer with
on-device normalisation against moving float32."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["NO_CUDA", "calibrated_step", "gpu_report"]

NO_CUDA = "no CUDA device: GPU measurements skipped"


def _median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def calibrated_step(device, target_ms: float):
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

    Args:
        batches: real host batches (e.g. from a loader with pin_memory=True) of uint8
            samples; None: synthetic uint8 batches of ``batch_shape``.
        device: the CUDA device to measure.
        batch_shape: the synthetic batches' shape.
        step_ms: the compute-bound step's time per batch, in milliseconds.
        n_batches: batches fed per measurement.
        copy_mb: MiB copied for the bandwidth measurement.
        log: called with each progress line.

    Returns:
        The measurements by name (with the device's name and torch's version), or
        ``{"skipped": NO_CUDA}`` without CUDA.
    """
    import torch

    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        return {"skipped": NO_CUDA}
    dev = torch.device(device)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    _bandwidth(dev, copy_mb, out, log)
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
    _overlap(dev, host, len(batches), step_ms, out, log)
    _uint8_vs_float(dev, host[0][0], out, log)
    return out


def _bandwidth(dev, copy_mb: int, out: dict[str, Any], log) -> None:
    """1. host-to-device bandwidth, pinned vs pageable."""
    import torch

    sync = torch.cuda.synchronize
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


def _overlap(dev, host: list, distinct: int, step_ms: float, out: dict[str, Any], log) -> None:
    """2. a compute-bound step fed from the GPU, through DevicePrefetcher, and by blocking
    copies from pageable memory: the share of its time each starves."""
    import torch

    from gpufeed.loading.prefetch import DevicePrefetcher

    sync = torch.cuda.synchronize
    n_batches = len(host)
    step, reps = calibrated_step(dev, step_ms)
    on_gpu = [(b[0].to(dev).float().div_(255), b[1].to(dev)) for b in host[:distinct]]

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


def _uint8_vs_float(dev, x8, out: dict[str, Any], log) -> None:
    """3. uint8 transfer + on-device normalisation vs float32 made on the host and moved."""
    import torch

    sync = torch.cuda.synchronize
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
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
