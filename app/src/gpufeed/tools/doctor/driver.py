"""Doctor's driver check, the twin of ``entrypoints/preflight.d/10-driver.sh``: the lowest
driver of all GPUs (nvidia-smi, then the kernel module's version file) against the image's
floor and full-support driver (the thresholds file), and against what the installed torch's
CUDA build needs (the thresholds' CUDA-to-driver table). The same verdicts and exit codes as
the preflight; the tests replay the preflight's scenarios against both."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.system.thresholds import cuda_requirements, is_version, version_cmp
from gpufeed.tools.doctor.place import Place
from gpufeed.tools.doctor.report import (
    EXIT_DRIVER_OLD,
    EXIT_NO_DRIVER,
    FAIL,
    INFO,
    OK,
    WARN,
    Check,
)

__all__ = ["DriverInfo", "driver_checks", "driver_info", "nvidia_smi"]

_COMPAT = (
    "compiled GPU code runs, but PTX newer than the driver cannot be JIT-compiled "
    "(cudaErrorUnsupportedPtxVersion) and some newer APIs fail"
)
_EXPOSE_GPU = (
    "expose the GPU: docker run --gpus all ... (compose: deploy.resources.reservations"
    ".devices); the host needs a working driver and the NVIDIA Container Toolkit "
    "(nvidia-ctk runtime configure --runtime=docker, restart dockerd)"
)
_INSTALL_DRIVER = (
    "install the NVIDIA driver for the GPU (your distribution's nvidia-driver package, or "
    "https://www.nvidia.com/drivers); nvidia-smi then lists it"
)
_BROKEN_DRIVER = (
    "run nvidia-smi to see why; after a driver update, reboot (the kernel module and the "
    "user-space library must be the same version)"
)


@dataclass
class DriverInfo:
    version: str | None = None
    versions: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    memory_bytes: list[int | None] = field(default_factory=list)
    source: str | None = None
    problems: list[str] = field(default_factory=list)
    smi_rc: int | None = None  # nvidia-smi's exit status (127: not on PATH)


def nvidia_smi(args: list[str], wait: float, env: Mapping[str, str]) -> tuple[int, str]:
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return 127, "nvidia-smi is not on PATH"
    try:
        p = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=wait, check=False, env=dict(env)
        )
    except subprocess.TimeoutExpired:
        return 124, f"nvidia-smi did not answer within {wait:g}s"
    except OSError as exc:
        return 126, f"nvidia-smi could not run: {exc}"
    return p.returncode, (p.stdout + p.stderr)


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def driver_info(env: Mapping[str, str], smi_wait: float) -> DriverInfo:
    """The preflight's sources in its order: nvidia-smi, then the kernel module's file."""
    info = DriverInfo()
    rc, out = nvidia_smi(
        ["--query-gpu=driver_version,name", "--format=csv,noheader"], smi_wait, env
    )
    info.smi_rc = rc
    if rc == 0:
        for line in out.splitlines():
            version, _, name = line.partition(",")
            version = version.strip()
            if not is_version(version):
                continue
            info.versions.append(version)
            info.names.append(name.strip())
        if info.versions:
            info.version = min(info.versions, key=functools.cmp_to_key(version_cmp))
            info.source = "nvidia-smi"
        else:
            info.problems.append(f"nvidia-smi listed no GPU: {_first_line(out)}")
    elif rc in (124, 127, 126):
        info.problems.append(out.strip())
    else:
        info.problems.append(f"nvidia-smi failed (exit {rc}): {_first_line(out)}")
    if info.version is None:
        proc = env.get("GPUFEED_PROC_DRIVER_VERSION") or "/proc/driver/nvidia/version"
        try:
            for line in Path(proc).read_text().splitlines():
                if "NVRM version" in line:
                    found = [w for w in line.split() if is_version(w) and "." in w]
                    if found:
                        info.version, info.source = found[0], proc
                        break
            else:
                info.problems.append(f"{proc} has no NVRM version line")
        except OSError:
            info.problems.append(f"{proc} does not exist")
    if info.names:
        info.memory_bytes = [None] * len(info.names)
        rc, out = nvidia_smi(
            ["--query-gpu=memory.total", "--format=csv,noheader,nounits"], smi_wait, env
        )
        if rc == 0:
            mib = [line.strip() for line in out.splitlines() if line.strip().isdigit()]
            if len(mib) == len(info.names):
                info.memory_bytes = [int(m) << 20 for m in mib]
    return info


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def driver_checks(
    env: Mapping[str, str],
    limits: Mapping[str, str],
    torch_cuda: str | None,
    smi_wait: float,
    place: Place | None = None,
    require_gpu: bool = False,
) -> tuple[list[Check], DriverInfo]:
    """The driver's checks (and what was learnt about the GPUs on the way). ``place``: where
    doctor runs (the preflight's rules are a container's); ``require_gpu``: no driver fails
    wherever it runs."""
    place = place or Place(True, "the preflight's rules (a container)")
    info = driver_info(env, smi_wait)
    if info.version is None:
        return [_no_driver(env, info, place, require_gpu)], info
    image_cuda = ".".join((env.get("CUDA_VERSION") or "").split(".")[:2])
    min_drv, full_drv = limits["GPUFEED_MIN_DRIVER"], limits["GPUFEED_CUDA_FULL_DRIVER"]
    data = {"version": info.version, "source": info.source, "minimum": min_drv}
    if version_cmp(info.version, min_drv) < 0:
        image = f"this CUDA {image_cuda} image" if image_cuda else "this image"
        return [
            Check(
                "driver",
                "driver",
                FAIL,
                f"NVIDIA driver {info.version} is older than {min_drv}, the minimum for {image}",
                "update the host driver or use an image built for an older CUDA",
                data,
                EXIT_DRIVER_OLD,
            )
        ], info
    checks = [
        Check(
            "driver",
            "driver",
            OK,
            f"NVIDIA driver {info.version} (minimum {min_drv}, from {info.source})",
            None,
            data,
        )
    ]
    if len(set(info.versions)) > 1:
        checks.append(
            Check(
                "driver",
                "driver_mixed",
                WARN,
                f"the GPUs report different drivers ({', '.join(sorted(set(info.versions)))});"
                f" checked the lowest, {info.version}",
                "reboot after a driver update",
                {},
            )
        )
    if version_cmp(info.version, full_drv) < 0:
        checks.append(
            Check(
                "driver",
                "driver_image_cuda",
                WARN,
                f"driver {info.version} is older than {full_drv}, which "
                f"{'CUDA ' + image_cuda if image_cuda else 'this image'} needs for full "
                f"support: CUDA minor-version compatibility mode applies ({_COMPAT})",
                f"update the host driver to {full_drv} or newer",
                {"full": full_drv},
            )
        )
    if torch_cuda:
        checks.append(_torch_cuda_check(info.version, torch_cuda, env))
    return checks, info


def _no_driver(env: Mapping[str, str], info: DriverInfo, place: Place, require: bool) -> Check:
    """In a container, the preflight's verdict: no driver fails (exit 4) unless
    GPUFEED_ALLOW_CPU=1. On a host, a machine without a driver is a CPU-only machine unless
    the GPU was asked for (--require-gpu); one whose nvidia-smi is there but fails is broken."""
    why = "; ".join(info.problems)
    data = {"problems": info.problems, "container": place.container, "place": place.evidence}
    expose = place.fix(_EXPOSE_GPU, _INSTALL_DRIVER if info.smi_rc == 127 else _BROKEN_DRIVER)
    if require:
        return Check(
            "driver",
            "driver",
            FAIL,
            f"no NVIDIA driver answered {place.where} ({why}); --require-gpu asks for one",
            expose,
            data,
            EXIT_NO_DRIVER,
        )
    if not place.container:
        installed = info.smi_rc != 127
        return Check(
            "driver",
            "driver",
            WARN if installed else INFO,
            (
                f"nvidia-smi is installed but no NVIDIA driver answered ({why})"
                if installed
                else f"no NVIDIA driver on this host ({why}): a CPU-only machine; "
                "gpufeed loads data and trains on the CPU"
            ),
            expose if installed else f"for a GPU here: {_INSTALL_DRIVER}",
            data,
        )
    if _truthy(env.get("GPUFEED_ALLOW_CPU")):
        return Check(
            "driver",
            "driver",
            WARN,
            f"no NVIDIA driver answered ({why}); running on the CPU as GPUFEED_ALLOW_CPU=1 allows",
            _EXPOSE_GPU,
            data,
        )
    return Check(
        "driver",
        "driver",
        FAIL,
        f"no NVIDIA driver answered in this container ({why})",
        _EXPOSE_GPU + "; to run on the CPU on purpose set GPUFEED_ALLOW_CPU=1",
        data,
        EXIT_NO_DRIVER,
    )


def _torch_cuda_check(version: str, torch_cuda: str, env: Mapping[str, str]) -> Check:
    """The driver against the table row of the installed torch's CUDA build."""
    floor, need = cuda_requirements(torch_cuda, env)
    tdata = {"torch_cuda": torch_cuda, "floor": floor, "full": need}
    if floor and version_cmp(version, floor) < 0:
        return Check(
            "driver",
            "driver_torch_cuda",
            FAIL,
            f"driver {version} is older than {floor}, the oldest that runs "
            f"torch's CUDA {torch_cuda} build: torch cannot use the GPU",
            f"update the host driver to {need or floor} or newer, or install a torch "
            f"built for an older CUDA",
            tdata,
            EXIT_DRIVER_OLD,
        )
    if need and version_cmp(version, need) < 0:
        return Check(
            "driver",
            "driver_torch_cuda",
            WARN,
            f"torch is built for CUDA {torch_cuda}, which needs driver {need} for full"
            f" support; with {version} minor-version compatibility mode applies",
            f"update the host driver to {need} or newer",
            tdata,
        )
    return Check(
        "driver",
        "driver_torch_cuda",
        OK,
        f"torch's CUDA {torch_cuda} build fully supported by driver "
        f"{version}" + (f" (needs {need})" if need else ""),
        None,
        tdata,
    )
