"""Doctor's host checks: the CPUs this process may use and what make_loader will do about
workers here (the same code make_loader runs), the JPEG decoder they run, the memory limit,
/dev/shm (doctor/shm.py) and the open-file and locked-memory limits."""

from __future__ import annotations

import os
import resource
import warnings
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from gpufeed.errors import SysinfoWarning
from gpufeed.loading.cpu_budget import worker_outlook
from gpufeed.loading.settings import SETTINGS_ENV
from gpufeed.system import sysinfo
from gpufeed.system.native import install_hint
from gpufeed.system.sizes import format_size
from gpufeed.tools.doctor.place import Place
from gpufeed.tools.doctor.report import INFO, OK, WARN, Check
from gpufeed.tools.doctor.shm import shm_check

__all__ = ["host_checks"]


def host_checks(
    limits: Mapping[str, str],
    workers: int | None,
    batch_bytes: int,
    has_gpu: bool,
    cgroup_root: str,
    self_cgroup: str,
    shm_path: str,
    place: Place | None = None,
) -> list[Check]:
    """CPUs, the JPEG decoder, memory, /dev/shm (sized for ``workers``, default what
    make_loader plans) and the process limits, in that order; each fix for ``place``."""
    place = place or Place(True, "the preflight's rules (a container)")
    checks, chosen, mem_limit = _cpu_checks(workers, cgroup_root, self_cgroup, place)
    checks.append(_jpeg_check())
    checks.append(_memory_check(mem_limit, chosen, place))
    checks.append(shm_check(limits, chosen, batch_bytes, shm_path, place))
    return checks + _limit_checks(has_gpu, place)


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _worker_plan(budget, workers: int | None):
    """(text, WorkerOutlook, a WARN check when the settings file is unusable): what
    make_loader will do about workers here, from the same code make_loader runs."""
    problem = None
    try:
        outlook = worker_outlook(budget=budget)
    except (OSError, ValueError, TypeError) as e:
        outlook = worker_outlook(settings={}, budget=budget)
        problem = Check(
            "cpu",
            "loader_settings",
            WARN,
            f"make_loader cannot read its settings: {e}",
            f"fix the file or unset {SETTINGS_ENV}; make_loader raises the same error",
        )
    text = outlook.describe()
    if workers is not None:
        text = f"sized for --workers {workers}; {text}"
    return text, outlook, problem


def _cpu_checks(workers: int | None, cgroup_root: str, self_cgroup: str, place: Place):
    """(the CPU checks, the workers the rest is sized for, the cgroup memory limit)."""
    checks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SysinfoWarning)
        budget = sysinfo.usable_cpus(cgroup_root, self_cgroup)
        mem_limit = sysinfo.cgroup_memory_limit(cgroup_root, self_cgroup)
    host_cpus = os.cpu_count() or budget.affinity
    quota = f"{budget.quota:g} CPUs" if budget.quota is not None else "none"
    plan_text, outlook, settings_problem = _worker_plan(budget, workers)
    chosen = workers if workers is not None else outlook.most
    cpu_msg = (
        f"{budget.count} usable CPU(s) (decided by {budget.source}; affinity "
        f"{budget.affinity} of {host_cpus}, cgroup quota {quota}); {plan_text}"
    )
    status, fix = OK, None
    if budget.count < 4:
        status = WARN
        more = place.fix(
            "give the container more (docker run --cpus, --cpuset-cpus)",
            "run on a machine with more, or widen this process's CPU affinity (taskset)",
        )
        fix = (
            f"few CPUs to decode and augment on; {more}, or pack the data with encode='raw' so "
            "loading needs no decode"
        )
    data = {**budget._asdict(), "host": host_cpus, "workers": chosen}
    checks.append(
        Check("cpu", "cpus", status, cpu_msg, fix, {**data, "worker_plan": asdict(outlook)})
    )
    if settings_problem is not None:
        checks.append(settings_problem)
    for w in caught:
        checks.append(Check("cpu", "cgroup_files", WARN, str(w.message), None))
    return checks, chosen, mem_limit


def _jpeg_check() -> Check:
    """The decoder RandomResizedCrop(backend="auto") runs on these CPUs, and why not a
    faster one."""
    from gpufeed.data.decoders import jpeg_backend  # imports torch: not at doctor's import

    name, why = jpeg_backend()
    status, fix = OK, None
    if name != "native":
        status = INFO
        fix = f"{install_hint()}: one GIL-free call per batch"
    return Check(
        "cpu", "jpeg_backend", status, f"JPEG decoder: {name} ({why})", fix, {"backend": name}
    )


def _memory_check(mem_limit: int | None, chosen: int, place: Place) -> Check:
    total = _meminfo_total()
    status, fix = OK, None
    if mem_limit is not None:
        text = (
            f"memory limit {format_size(mem_limit)} (cgroup) of {format_size(total or 0)} on "
            "the host"
        )
        per = mem_limit / max(1, chosen + 1)
        if per < 2 << 30:
            status = WARN
            fix = (
                f"{format_size(per)} per process for {chosen} workers + the trainer; raise the "
                + place.fix("limit (docker run --memory)", "cgroup limit (systemd MemoryMax=)")
                + " or use fewer workers"
            )
    else:
        text = f"no cgroup memory limit; {format_size(total or 0)} on the host"
    return Check(
        "memory", "memory", status, text, fix, {"limit_bytes": mem_limit, "host_bytes": total}
    )


def _limit_text(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def _limit_checks(has_gpu: bool, place: Place) -> list[Check]:
    checks = []
    inf, fmt = resource.RLIM_INFINITY, _limit_text
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != inf and soft < 4096:
        fix = place.fix(
            "docker run --ulimit nofile=65536:65536 (compose ulimits.nofile)",
            "raise it for your user in /etc/security/limits.conf (nofile 65536)",
        ) + (
            f", or raise the soft limit up to the hard {fmt(hard)}: ulimit -n {fmt(hard)}"
            if hard == inf or hard > soft
            else ""
        )
        checks.append(
            Check(
                "limits",
                "nofile",
                WARN,
                f"open files: soft {fmt(soft)}, hard "
                f"{fmt(hard)}; workers sharing tensors and many open shards need "
                'more ("Too many open files")',
                fix,
                {"soft": soft, "hard": hard},
            )
        )
    else:
        checks.append(
            Check(
                "limits",
                "nofile",
                OK,
                f"open files: soft {fmt(soft)}, hard {fmt(hard)}",
                None,
                {"soft": soft, "hard": hard},
            )
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    text = f"locked memory: soft {fmt(soft)}, hard {fmt(hard)}"
    if soft == inf:
        checks.append(Check("limits", "memlock", OK, text, None, {"soft": soft, "hard": hard}))
    else:
        checks.append(
            Check(
                "limits",
                "memlock",
                WARN if has_gpu else INFO,
                text + "; NCCL over InfiniBand/RDMA and GPUDirect need it unlimited",
                place.fix(
                    "docker run --ulimit memlock=-1 (compose ulimits.memlock: -1)",
                    "memlock unlimited for your user in /etc/security/limits.conf",
                ),
                {"soft": soft, "hard": hard},
            )
        )
    return checks
