"""What make_loader will do about workers on this machine, before it sees a dataset: the CPUs
one loader may use and the worker count it measures (:func:`worker_outlook`). The one answer
``make_loader``, ``gpufeed doctor``, ``gpufeed.watch`` and ``gpufeed tune`` all give; no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpufeed.loading.settings import load_settings
from gpufeed.system import sysinfo

__all__ = ["WorkerOutlook", "loader_cpus", "worker_count_for", "worker_outlook"]


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def worker_count_for(cpus: int) -> int:
    """Workers to try on ``cpus`` usable CPUs: all of them on small machines, one left for the
    main (training) process from 4 CPUs up."""
    return max(1, cpus - 1) if cpus >= 4 else max(1, cpus)


def loader_cpus(budget: sysinfo.CpuBudget | None = None) -> tuple[int, str]:
    """The CPUs one loader may use, and how that was decided: the usable CPUs (affinity and
    cgroup quota, :func:`gpufeed.system.sysinfo.usable_cpus`, or ``budget`` when given) shared by
    the ``LOCAL_WORLD_SIZE`` ranks of this node."""
    budget = budget or sysinfo.usable_cpus()
    local = _local_world_size()
    source = budget.source + (f", / LOCAL_WORLD_SIZE={local}" if local > 1 else "")
    return max(1, budget.count // local), source


@dataclass(frozen=True)
class WorkerOutlook:
    """What ``make_loader`` will do about workers on this machine before it sees a dataset:
    the one answer that ``gpufeed doctor``, ``gpufeed.watch`` and ``gpufeed tune`` give.

    ``fixed``: the ``num_workers`` a settings file sets (``GPUFEED_LOADER_SETTINGS``, what
    ``gpufeed tune --write`` makes), used as is. Else ``num_workers="auto"`` measures
    in-process loading against ``candidate`` workers for each dataset and takes the faster,
    so the count is 0 or ``candidate``."""

    cpus: int
    cpu_source: str
    candidate: int
    fixed: int | None = None
    settings_source: str = ""

    @property
    def most(self) -> int:
        """The most workers make_loader starts here (what /dev/shm must hold)."""
        return self.fixed if self.fixed is not None else self.candidate

    def describe(self) -> str:
        if self.fixed is not None:
            return f"make_loader uses num_workers={self.fixed} (from {self.settings_source})"
        return (
            f"make_loader measures in-process loading against {self.candidate} worker(s) per "
            f"dataset (num_workers='auto') and takes the faster"
        )


def worker_outlook(
    settings: str | os.PathLike | Mapping | None = None,
    budget: sysinfo.CpuBudget | None = None,
) -> WorkerOutlook:
    """:class:`WorkerOutlook` for ``settings`` (default: the file env
    ``GPUFEED_LOADER_SETTINGS`` names, as make_loader reads it) on ``budget`` (default: this
    process's usable CPUs)."""
    cpus, source = loader_cpus(budget)
    tuned, where = load_settings(settings)
    fixed = tuned.get("num_workers")
    fixed = fixed if isinstance(fixed, int) and not isinstance(fixed, bool) else None
    return WorkerOutlook(
        cpus, source, worker_count_for(cpus), fixed, where if fixed is not None else ""
    )
