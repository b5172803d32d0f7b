"""Loader settings with no torch in them: the settings file (what ``gpufeed tune --write``
makes, what ``make_loader`` reads), the CPUs one loader may use, and what make_loader will do
about workers here (:func:`worker_outlook`): the one answer ``make_loader``, ``gpufeed
doctor``, ``gpufeed.watch`` and ``gpufeed tune`` all give. Importing it costs no torch, so
the doctor can say it before (or without) torch loading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufeed import sysinfo

__all__ = [
    "SETTINGS_ENV",
    "SETTINGS_KEYS",
    "WorkerOutlook",
    "load_settings",
    "loader_cpus",
    "worker_count_for",
    "worker_outlook",
]

SETTINGS_ENV = "GPUFEED_LOADER_SETTINGS"
# The keys a settings file (what `gpufeed tune` writes) may set; each is a make_loader argument.
SETTINGS_KEYS = (
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "multiprocessing_context",
    "block_size",
    "buffer_blocks",
    "sorted_batches",
)


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def load_settings(settings) -> tuple[dict[str, Any], str]:
    """(the settings, where they came from) for ``settings``: a dict, a JSON file, or None
    for the file env ``GPUFEED_LOADER_SETTINGS`` names (none: ``({}, "")``). Keys starting
    with ``_`` and ``measured`` are notes; any other unknown key is an error."""
    source = "settings"
    if settings is None:
        path = os.environ.get(SETTINGS_ENV)
        if not path:
            return {}, ""
        settings, source = path, f"{SETTINGS_ENV}={path}"
    if isinstance(settings, (str, os.PathLike)):
        path = Path(settings)
        source = source if source != "settings" else str(path)
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"loader settings file {path} does not exist; run `gpufeed tune` to write it "
                f"or unset {SETTINGS_ENV}"
            ) from None
        except UnicodeDecodeError:
            raise ValueError(
                f"loader settings file {path} is not valid JSON (not UTF-8 text); give the "
                f"file `gpufeed tune --write` made"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"loader settings file {path} is not valid JSON: {exc}") from None
        if not isinstance(settings, Mapping):
            raise ValueError(
                f"loader settings file {path} holds a JSON {type(settings).__name__}, not an "
                f"object of settings"
            )
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a path or a dict, got {type(settings).__name__}")
    values = {k: v for k, v in settings.items() if not k.startswith("_") and k != "measured"}
    unknown = sorted(set(values) - set(SETTINGS_KEYS))
    if unknown:
        raise ValueError(
            f"unknown loader setting(s) {', '.join(unknown)} in {source}; "
            f"known: {', '.join(SETTINGS_KEYS)}"
        )
    return values, source


def worker_count_for(cpus: int) -> int:
    """Workers to try on ``cpus`` usable CPUs: all of them on small machines, one left for the
    main (training) process from 4 CPUs up."""
    return max(1, cpus - 1) if cpus >= 4 else max(1, cpus)


def loader_cpus(budget: sysinfo.CpuBudget | None = None) -> tuple[int, str]:
    """The CPUs one loader may use, and how that was decided: the usable CPUs (affinity and
    cgroup quota, :func:`gpufeed.sysinfo.usable_cpus`, or ``budget`` when given) shared by
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
