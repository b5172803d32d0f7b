"""Doctor's GPU checks: the GPUs the driver lists (NVML, else nvidia-smi), what this container
is given (NVIDIA_VISIBLE_DEVICES, device nodes), and the GPUs torch can use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpufeed.system.sizes import format_size
from gpufeed.tools.doctor.driver import DriverInfo
from gpufeed.tools.doctor.place import Place
from gpufeed.tools.doctor.probe import bounded
from gpufeed.tools.doctor.report import INFO, OK, WARN, Check

__all__ = ["gpu_checks", "nvml_gpus"]


def nvml_gpus() -> list[dict[str, Any]]:
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_bytes": int(mem.total),
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _visible_devices(env: Mapping[str, str], place: Place) -> tuple[str, str | None]:
    """What GPUs this process is given; NVIDIA_VISIBLE_DEVICES is the container runtime's."""
    nvd = env.get("NVIDIA_VISIBLE_DEVICES")
    nodes = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    parts = []
    fix = None
    if nvd is None:
        if place.container:
            parts.append("NVIDIA_VISIBLE_DEVICES unset (not an NVIDIA container image)")
    elif not place.container:
        parts.append(f"NVIDIA_VISIBLE_DEVICES={nvd} (read by container runtimes only)")
    elif nvd.strip() in ("void", "none", ""):
        parts.append(f"NVIDIA_VISIBLE_DEVICES={nvd!r}: no GPU is given to this container")
        fix = "set NVIDIA_VISIBLE_DEVICES=all (or GPU indices) and start with --gpus all"
    else:
        parts.append(f"NVIDIA_VISIBLE_DEVICES={nvd}")
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        parts.append(f"CUDA_VISIBLE_DEVICES={cvd}")
    parts.append(f"device nodes: {', '.join('/dev/' + n for n in nodes) if nodes else 'none'}")
    return "; ".join(parts), fix


def gpu_checks(
    env: Mapping[str, str],
    driver: DriverInfo,
    torch_gpus: list[dict] | None,
    timeout: float,
    place: Place | None = None,
) -> list[Check]:
    place = place or Place(True, "the preflight's rules (a container)")
    checks = []
    ok, nvml = bounded(nvml_gpus, timeout)
    names = [g["name"] for g in nvml] if ok and nvml else driver.names
    memory = [g["memory_bytes"] for g in nvml] if ok and nvml else driver.memory_bytes
    seen_by = "NVML" if ok and nvml else ("nvidia-smi" if driver.names else None)
    visible, vis_fix = _visible_devices(env, place)
    gpus = [
        {"name": n, "memory_bytes": m}
        for n, m in zip(names, memory or [None] * len(names), strict=False)
    ]
    if names:
        listing = ", ".join(
            f"{g['name']} ({format_size(g['memory_bytes'])})" if g["memory_bytes"] else g["name"]
            for g in gpus
        )
        checks.append(
            Check(
                "gpu",
                "gpus_driver",
                OK,
                f"{len(names)} GPU(s) seen by the driver ({seen_by}): {listing}",
                None,
                {"gpus": gpus},
            )
        )
    else:
        checks.append(
            Check(
                "gpu",
                "gpus_driver",
                INFO if driver.version is None else WARN,
                "no GPU listed by the driver",
                vis_fix
                or place.fix(
                    "start the container with --gpus all (compose: deploy.resources"
                    ".reservations.devices)",
                    "a GPU needs the NVIDIA driver installed on this host (nvidia-smi lists it)",
                ),
                {"gpus": []},
            )
        )
    status = WARN if vis_fix else INFO
    checks.append(Check("gpu", "visibility", status, f"{place.where}: {visible}", vis_fix))
    if torch_gpus is None:
        checks.append(Check("gpu", "gpus_torch", INFO, "torch did not report (see torch below)"))
    elif torch_gpus:
        listing = ", ".join(f"{g['name']} ({format_size(g['memory_bytes'])})" for g in torch_gpus)
        checks.append(
            Check(
                "gpu",
                "gpus_torch",
                OK,
                f"{len(torch_gpus)} GPU(s) usable by torch: {listing}",
                None,
                {"gpus": torch_gpus},
            )
        )
    elif names:
        checks.append(
            Check(
                "gpu",
                "gpus_torch",
                WARN,
                f"the driver lists {len(names)} GPU(s) but torch sees none",
                "check CUDA_VISIBLE_DEVICES, and that torch is a CUDA build "
                "(torch.version.cuda is not None)",
                {"gpus": []},
            )
        )
    else:
        checks.append(Check("gpu", "gpus_torch", INFO, "torch sees no GPU", None, {"gpus": []}))
    return checks
