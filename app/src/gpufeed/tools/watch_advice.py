"""What ``gpufeed.watch`` advises when a loop waits for data: from the plan make_loader made
(a gpufeed loader) or the rule it would apply here (any other loader), so watch never
advises a worker count make_loader measured and turned down."""

from __future__ import annotations

from typing import Any

__all__ = ["INPUT_BOUND", "PARTLY", "advice", "quantile"]

INPUT_BOUND = 0.20  # data-wait share of the loop's time from which a job counts as input-bound
PARTLY = 0.05  # below this share loading is not the problem


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _unwrap(loader: Any) -> tuple[Any, bool]:
    """(the loader under any DevicePrefetcher, whether a DevicePrefetcher wraps it)."""
    prefetched = False
    for _ in range(4):
        if type(loader).__name__ == "DevicePrefetcher":
            prefetched = True
            loader = loader.loader
        else:
            break
    return loader, prefetched


_CHEAPER = (
    "make each sample cheaper (gpufeed pack --encode raw --resize HxW decodes once, at pack "
    "time; move augmentation to the GPU) or give the container more CPUs"
)


def _worker_tip(inner: Any, workers: int | None) -> str:
    """What to do about workers, from the same plan make_loader made (a gpufeed loader's
    ``plan``) or, for any other loader, the rule make_loader would apply here
    (:func:`gpufeed.loading.cpu_budget.worker_outlook`): watch never advises a count make_loader
    measured and turned down."""
    from gpufeed.loading.cpu_budget import worker_count_for, worker_outlook

    plan = getattr(inner, "plan", None)
    if plan is not None and hasattr(plan, "reason"):
        candidate = worker_count_for(plan.cpus)
        if workers == 0 and "num_workers" in plan.from_settings:
            return (
                f"num_workers=0 comes from the loader settings (gpufeed tune measured it): "
                f"run gpufeed tune again if the data or the machine changed, or {_CHEAPER}"
            )
        if workers == 0 and plan.measured:
            return (
                f"make_loader measured loading here and kept it in-process ({plan.reason}): "
                f"more workers would not help; {_CHEAPER}"
            )
        if workers is not None and workers < candidate and plan.reason == "as requested":
            return (
                f"num_workers={workers} as requested: try num_workers='auto' (make_loader "
                f"measures {candidate} workers against in-process loading on {plan.cpus} "
                f"usable CPUs)"
            )
        return f"{workers} worker(s) on {plan.cpus} usable CPUs ({plan.reason}): {_CHEAPER}"
    outlook = worker_outlook(settings={})
    target, cpus = outlook.candidate, outlook.cpus
    if workers == 0:
        return (
            f"num_workers=0 loads in the training process: try num_workers={target} "
            f"({cpus} usable CPUs; make_loader(num_workers='auto') measures it)"
        )
    if workers is not None and workers < target:
        return f"raise num_workers from {workers} to {target} ({cpus} usable CPUs)"
    if workers is None:
        return (
            f"load with worker processes: gpufeed.make_loader(dataset, batch_size) measures "
            f"how many of the {cpus} usable CPUs help"
        )
    return f"{workers} workers already use the {cpus} usable CPUs: {_CHEAPER}"


def advice(loader: Any, fraction: float, waits: list[float], uses_cuda: bool) -> list[str]:
    if fraction < PARTLY:
        return [
            "the step is the bottleneck, so faster loading will not help: look at the model "
            "(mixed precision, torch.compile, a larger batch)"
        ]
    inner, prefetched = _unwrap(loader)
    workers = getattr(inner, "num_workers", None)
    tips = [_worker_tip(inner, workers)]
    median, p90 = quantile(waits, 0.5), quantile(waits, 0.9)
    if workers and p90 > 5 * max(median, 1e-4):
        factor = getattr(inner, "prefetch_factor", None) or 2
        tips.append(
            f"waits come in bursts (p90 {p90 * 1e3:.1f} ms vs median {median * 1e3:.2f} ms): "
            f"raise prefetch_factor (now {factor}) so workers keep more batches ready"
        )
    if uses_cuda and not prefetched:
        tips.append("wrap the loader in gpufeed.DevicePrefetcher to overlap copies with compute")
    if uses_cuda and getattr(inner, "pin_memory", True) is False:
        tips.append("pin_memory=True makes host-to-GPU copies asynchronous")
    tips.append("gpufeed tune measures the best loader settings for this dataset")
    return tips
