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
from gpufeed.system.sysinfo import loader_cpus  # re-exported: its home is system/

__all__ = ["WorkerOutlook", "loader_cpus", "worker_count_for", "worker_outlook"]


def worker_count_for(cpus: int) -> int:
    """Workers to try on ``cpus`` usable CPUs: all of them on small machines, one left for the
    main (training) process from 4 CPUs up."""
    return max(1, cpus - 1) if cpus >= 4 else max(1, cpus)


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
