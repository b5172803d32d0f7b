"""What this process may really use: CPUs (affinity and cgroup quota), memory (cgroup limit),
``/dev/shm`` and free disk space.

``os.cpu_count()`` reports the host's CPUs. In a container limited with ``--cpus 4`` on a 64-core
host it says 64, and a loader that starts 64 workers thrashes. The kernel's answer is the
smaller of the affinity mask (``--cpuset-cpus``, ``taskset``) and the CFS quota (``--cpus``),
which is what :func:`usable_cpus` returns.

Every function takes its filesystem roots as arguments so tests (and ``gpufeed doctor`` on a
captured tree) can point them at fixture files.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from pathlib import Path
from typing import NamedTuple

from gpufeed.errors import SysinfoWarning
from gpufeed.system.disk import free_bytes

__all__ = [
    "CpuBudget",
    "ShmInfo",
    "cgroup_cpu_quota",
    "cgroup_memory_limit",
    "cgroup_version",
    "cpu_affinity",
    "describe",
    "free_bytes",
    "loader_cpus",
    "process_loader_cpus",
    "shm_info",
    "shm_size_bytes",
    "usable_cpus",
]

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
# cgroup v1 reports "no memory limit" as the largest page-aligned signed 64-bit value.
_V1_UNLIMITED = 1 << 62


class CpuBudget(NamedTuple):
    count: int  # whole CPUs worth planning processes for (>= 1)
    quota: float | None  # CFS quota in CPUs (e.g. 2.5), None when unlimited
    affinity: int  # CPUs in the affinity mask
    source: str  # which limit decided ``count``: "affinity" or "cgroup v1/v2 quota"


class ShmInfo(NamedTuple):
    path: str
    total_bytes: int
    free_bytes: int


def cpu_affinity(pid: int = 0) -> int:
    """CPUs this process may run on (``sched_getaffinity``).

    Platforms without affinity (macOS) fall back to ``os.cpu_count()``: there is nothing
    narrower to ask there.
    """
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return max(1, len(getaffinity(pid)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - non-Linux


def cgroup_version(root: str | os.PathLike = CGROUP_ROOT) -> int | None:
    """2 for the unified hierarchy, 1 for v1 (or hybrid), None when no cgroup fs is mounted."""
    root = Path(root)
    if (root / "cgroup.controllers").is_file():
        return 2
    if any((root / name).is_dir() for name in ("cpu", "cpu,cpuacct", "memory")):
        return 1
    return None


def _self_paths(self_cgroup: str | os.PathLike) -> dict[str, str]:
    """controller -> cgroup path from /proc/self/cgroup ("" key for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    try:
        text = Path(self_cgroup).read_text()
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _candidate_dirs(mount: Path, rel: str | None) -> list[Path]:
    """The process's cgroup dir and its ancestors up to the mount, deepest first.

    Inside a container with a private cgroup namespace ``rel`` is "/" and only the mount
    itself exists; on a host or in an old v1 container ``rel`` names a deeper directory whose
    limits and its parents' all apply. Directories that do not exist under this mount are
    skipped (v1 containers see the host's path but mount only their own subtree).
    """
    dirs = []
    if rel:
        parts = [p for p in rel.strip("/").split("/") if p]
        for depth in range(len(parts), 0, -1):
            d = mount.joinpath(*parts[:depth])
            if d.is_dir():
                dirs.append(d)
    dirs.append(mount)
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"cannot read {path}: {exc}; ignoring that limit", SysinfoWarning, 3)
        return None


def _malformed(path: Path, text: str, expected: str) -> None:
    warnings.warn(
        f"{path} contains {text!r}, expected {expected}; ignoring that limit "
        f"(planning as if there were none)",
        SysinfoWarning,
        stacklevel=4,
    )


def _v2_cpu_max(path: Path) -> float | None:
    text = _read(path)
    if text is None:
        return None
    fields = text.split()
    try:
        if len(fields) not in (1, 2):
            raise ValueError
        if fields[0] == "max":
            return None
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) == 2 else 100_000
        if quota <= 0 or period <= 0:
            raise ValueError
    except ValueError:
        _malformed(path, text, '"max [period]" or "<quota_us> <period_us>"')
        return None
    return quota / period


def _v1_cfs(directory: Path) -> float | None:
    quota_file = directory / "cpu.cfs_quota_us"
    period_file = directory / "cpu.cfs_period_us"
    quota_text, period_text = _read(quota_file), _read(period_file)
    if quota_text is None:
        return None
    try:
        quota = int(quota_text)
    except ValueError:
        _malformed(quota_file, quota_text, "an integer (-1 for no limit)")
        return None
    if quota < 0:
        return None
    try:
        period = int(period_text) if period_text is not None else 100_000
        if period <= 0 or quota == 0:
            raise ValueError
    except ValueError:
        _malformed(period_file, str(period_text), "a positive integer")
        return None
    return quota / period


def cgroup_cpu_quota(
    root: str | os.PathLike = CGROUP_ROOT, self_cgroup: str | os.PathLike = SELF_CGROUP
) -> float | None:
    """The CFS CPU quota in CPUs (``docker --cpus 2.5`` gives 2.5), None when unlimited.

    The tightest limit along the process's cgroup and its ancestors wins. Malformed files give
    a :class:`SysinfoWarning` and are ignored.
    """
    root = Path(root)
    version = cgroup_version(root)
    paths = _self_paths(self_cgroup)
    quotas: list[float] = []
    if version == 2:
        for d in _candidate_dirs(root, paths.get("")):
            q = _v2_cpu_max(d / "cpu.max")
            if q is not None:
                quotas.append(q)
    elif version == 1:
        for mount_name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            mount = root / mount_name
            if mount.is_dir():
                for d in _candidate_dirs(mount, paths.get("cpu")):
                    q = _v1_cfs(d)
                    if q is not None:
                        quotas.append(q)
                break
    return min(quotas) if quotas else None


def usable_cpus(
    root: str | os.PathLike = CGROUP_ROOT,
    self_cgroup: str | os.PathLike = SELF_CGROUP,
    affinity: int | None = None,
) -> CpuBudget:
    """CPUs this process can really use: the smaller of affinity and the cgroup quota.

    ``count`` rounds a fractional quota down (2.5 CPUs -> 2 processes that can run flat out)
    and is never below 1. ``affinity`` is injectable for tests.
    """
    aff = cpu_affinity() if affinity is None else int(affinity)
    quota = cgroup_cpu_quota(root, self_cgroup)
    if quota is not None and quota < aff:
        version = cgroup_version(root)
        return CpuBudget(max(1, math.floor(quota + 1e-9)), quota, aff, f"cgroup v{version} quota")
    return CpuBudget(aff, quota, aff, "affinity")


def _local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def loader_cpus(budget: CpuBudget | None = None) -> tuple[int, str]:
    """The CPUs one loader may use, and how that was decided: the usable CPUs (affinity and
    cgroup quota, :func:`usable_cpus`, or ``budget`` when given) shared by the
    ``LOCAL_WORLD_SIZE`` ranks of this node. make_loader's worker plan and the native JPEG
    decoder's threads both start from it."""
    budget = budget or usable_cpus()
    local = _local_world_size()
    source = budget.source + (f", / LOCAL_WORLD_SIZE={local}" if local > 1 else "")
    return max(1, budget.count // local), source


def process_loader_cpus() -> int:
    """``loader_cpus()[0]`` read once per process: what a batch sizes its threads by (the
    native JPEG decoder's, the row copy's), without reading the cgroup files again for every
    batch (docs/performance/jpeg-decode.md). Keyed by the process id, so a forked DataLoader
    worker reads its own."""
    return _process_loader_cpus(os.getpid())


@functools.lru_cache(maxsize=4)
def _process_loader_cpus(pid: int) -> int:
    return loader_cpus()[0]


def _parse_bytes(path: Path, text: str, *, unlimited: set[str]) -> int | None:
    if text in unlimited:
        return None
    try:
        value = int(text)
        if value < 0:
            raise ValueError
    except ValueError:
        _malformed(path, text, "a byte count or 'max'")
        return None
    return None if value >= _V1_UNLIMITED else value


def cgroup_memory_limit(
    root: str | os.PathLike = CGROUP_ROOT, self_cgroup: str | os.PathLike = SELF_CGROUP
) -> int | None:
    """The cgroup memory limit in bytes (the tightest along the hierarchy), None when none."""
    root = Path(root)
    version = cgroup_version(root)
    paths = _self_paths(self_cgroup)
    limits: list[int] = []
    if version == 2:
        limits = _byte_limits(_candidate_dirs(root, paths.get("")), "memory.max", {"max"})
    elif version == 1 and (root / "memory").is_dir():
        dirs = _candidate_dirs(root / "memory", paths.get("memory"))
        limits = _byte_limits(dirs, "memory.limit_in_bytes", {"-1"})
    return min(limits) if limits else None


def _byte_limits(dirs, name: str, unlimited: set[str]) -> list[int]:
    """The byte limits set in file `name` of each cgroup folder (unreadable or unlimited: none)."""
    limits = []
    for d in dirs:
        text = _read(d / name)
        v = None if text is None else _parse_bytes(d / name, text, unlimited=unlimited)
        if v is not None:
            limits.append(v)
    return limits


def shm_info(path: str | os.PathLike = "/dev/shm") -> ShmInfo | None:
    """Size and free space of the shared-memory filesystem, None when it does not exist.

    DataLoader workers hand every batch to the main process through it; Docker's default is
    64 MiB, which a few workers with image batches exhaust ("Bus error" in a worker).
    """
    try:
        st = os.statvfs(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return ShmInfo(str(path), st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def shm_size_bytes(path: str | os.PathLike = "/dev/shm") -> int | None:
    """Total size of ``/dev/shm`` in bytes, None when it does not exist."""
    info = shm_info(path)
    return None if info is None else info.total_bytes


def describe(
    root: str | os.PathLike = CGROUP_ROOT,
    self_cgroup: str | os.PathLike = SELF_CGROUP,
    shm_path: str | os.PathLike = "/dev/shm",
) -> dict:
    """Everything above as plain data (for ``gpufeed doctor`` and benchmark reports)."""
    cpus = usable_cpus(root, self_cgroup)
    shm = shm_info(shm_path)
    return {
        "cgroup_version": cgroup_version(root),
        "cpu_affinity": cpus.affinity,
        "cpu_quota": cpus.quota,
        "usable_cpus": cpus.count,
        "usable_cpus_source": cpus.source,
        "memory_limit_bytes": cgroup_memory_limit(root, self_cgroup),
        "shm_total_bytes": None if shm is None else shm.total_bytes,
        "shm_free_bytes": None if shm is None else shm.free_bytes,
    }


def read_ahead_kb(path: str | os.PathLike, sys_root: str | os.PathLike = "/sys") -> int | None:
    """The read-ahead window (KiB) of the block device holding `path`, or None where there is
    none to read (overlay, tmpfs, network filesystems). Through a memory map with the default
    advice a page fault reads this much around the page, so a few hundred random faults can
    read a whole file (128 KiB is the kernel's default; larger on many machines:
    docs/performance/lmdb-reads.md)."""
    dev = os.stat(path).st_dev
    device = Path(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    # a partition's queue/ is its disk's, one level up
    for queue in (device / "queue", device / ".." / "queue"):
        text = _read(queue / "read_ahead_kb")
        if text is not None and text.isdigit():
            return int(text)
    return None
