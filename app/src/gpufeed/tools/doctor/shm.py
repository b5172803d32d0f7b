"""Doctor's /dev/shm check, the twin of ``entrypoints/preflight.d/20-shm.sh``: its size against
``GPUFEED_MIN_SHM_MB`` (the thresholds file) and, beyond the preflight, what the planned
workers' batches need (gpufeed.system.shm, the rule make_loader warns by)."""

from __future__ import annotations

from collections.abc import Mapping

from gpufeed.system.shm import shm_budget
from gpufeed.system.sizes import format_size
from gpufeed.tools.doctor.place import Place
from gpufeed.tools.doctor.report import OK, WARN, Check

__all__ = ["TORCH_PREFETCH", "shm_check"]

TORCH_PREFETCH = 2  # DataLoader's default prefetch_factor
_HOST_SHM_FIX = (
    "/dev/shm is a tmpfs: sudo mount -o remount,size=8G /dev/shm (and in /etc/fstab to keep it)"
)


def shm_check(
    limits: Mapping[str, str],
    workers: int,
    batch_bytes: int,
    shm_path: str,
    place: Place | None = None,
) -> Check:
    floor_mb = int(limits["GPUFEED_MIN_SHM_MB"])
    # the thresholds' fix is the container's (compose shm_size, docker run --shm-size)
    in_container = place is None or place.container
    fix = (limits.get("GPUFEED_SHM_FIX") or None) if in_container else _HOST_SHM_FIX
    budget = shm_budget(workers, TORCH_PREFETCH, batch_bytes, floor_mb << 20, shm_path)
    if budget is None:
        return Check(
            "memory",
            "shm",
            WARN,
            f"{shm_path} does not exist, so DataLoader workers cannot share batches",
            fix,
            {"path": shm_path},
        )
    need = budget.need_bytes
    data = {
        "path": shm_path,
        "total_bytes": budget.total_bytes,
        "free_bytes": budget.free_bytes,
        "min_mb": floor_mb,
        "need_bytes": need,
        "workers": workers,
    }
    text = (
        f"{shm_path} {budget.total_bytes >> 20} MiB ({format_size(budget.free_bytes)} free); "
        f"{workers} workers x prefetch {TORCH_PREFETCH} x {format_size(batch_bytes)} batches "
        f"need ~{format_size(need)}"
    )
    if budget.below_floor:
        return Check(
            "memory",
            "shm",
            WARN,
            f"{text}; less than {floor_mb} MiB (GPUFEED_MIN_SHM_MB): workers fail with "
            '"bus error" when it fills',
            fix,
            data,
        )
    if not budget.fits:
        return Check("memory", "shm", WARN, f"{text}: more than is free", fix, data)
    return Check("memory", "shm", OK, text, None, data)
