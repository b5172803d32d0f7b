"""``gpufeed doctor``: is this machine (or container) and its data set up to keep a GPU fed?

Every check gives a status (``ok``, ``warn``, ``fail``, ``info``) and, when not ok, the fix.
Only a failed hard requirement makes :attr:`DoctorReport.exit_code` non-zero, and those are
the preflight's (``entrypoints/preflight.sh``) with its exit codes: 3 driver older than
``GPUFEED_MIN_DRIVER``, 4 no driver answered (unless ``GPUFEED_ALLOW_CPU=1``), 2 thresholds
unusable; doctor adds 3 for a driver too old for the installed torch's CUDA major version.
The numbers come from the same place as the preflight's: ``thresholds.env`` (the file named
by ``GPUFEED_THRESHOLDS`` when set), each overridden by an environment variable of its name.

Nothing here needs a GPU, and every probe that could block (``nvidia-smi``, NVML, CUDA
initialisation, walking or reading a network mount) runs with a deadline.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpufeed import sysinfo, thresholds

__all__ = [
    "CUDA_DRIVER_FLOOR",
    "CUDA_FULL_DRIVER",
    "Check",
    "DoctorReport",
    "diagnose",
    "version_cmp",
]

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
EXIT_OK, EXIT_CONFIG, EXIT_DRIVER_OLD, EXIT_NO_DRIVER = 0, 2, 3, 4

# Linux driver each CUDA toolkit release needs for full support (CUDA release notes, table 3).
CUDA_FULL_DRIVER = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}
# Oldest driver of each CUDA major version (minor-version compatibility below full support).
CUDA_DRIVER_FLOOR = {"11": "450.80.02", "12": "525.60.13", "13": "580"}

_DEFAULT_SAMPLE_BYTES = 3 * 224 * 224  # one uint8 ImageNet-sized image
_TORCH_PREFETCH = 2  # DataLoader's default prefetch_factor


@dataclass
class Check:
    section: str
    name: str
    status: str
    message: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0  # for a "fail": the exit status it stands for


@dataclass
class DoctorReport:
    checks: list[Check]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        """The first failure's code (as the preflight does), 0 when nothing failed."""
        return next((c.exit_code or 1 for c in self.checks if c.status == FAIL), EXIT_OK)

    def by_name(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {', '.join(c.name for c in self.checks)}")

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARN, FAIL, INFO)}

    def to_json(self) -> dict[str, Any]:
        from gpufeed import __version__

        return {
            "gpufeed": __version__,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "checks": [asdict(c) for c in self.checks],
        }

    def format(self, only_problems: bool = False, data: bool = False) -> str:
        """The report as text: every check (``only_problems``: the warnings and failures and
        the verdict line), with each check's numbers when ``data``."""
        from gpufeed import __version__

        tags = {OK: " OK ", WARN: "WARN", FAIL: "FAIL", INFO: "INFO"}
        lines, section = [] if only_problems else [f"gpufeed doctor ({__version__})"], None
        for c in self.checks:
            if only_problems and c.status not in (WARN, FAIL):
                continue
            if c.section != section:
                section = c.section
                lines.append(f"{section}")
            lines.append(f"  [{tags[c.status]}] {c.message}")
            if c.fix and c.status in (WARN, FAIL):
                lines.append(f"         fix: {c.fix}")
            if data and c.data:
                lines.append(f"         data: {json.dumps(c.data, default=str)}")
        n = self.counts()
        verdict = "hard requirement failed" if not self.ok else "ready"
        lines.append(
            f"{verdict}: {n[OK]} ok, {n[WARN]} warning(s), {n[FAIL]} failed "
            f"(exit {self.exit_code}, {self.seconds:.1f} s)"
        )
        return "\n".join(lines)

    __str__ = format


# ---------------------------------------------------------------- helpers


def _version_fields(v: str) -> list[int] | None:
    parts = v.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def version_cmp(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, equal to or newer than ``b``; the same rule as the
    preflight's ``pf_version_cmp``: each dot field compares as a number, missing fields are 0."""
    x, y = _version_fields(a), _version_fields(b)
    if x is None or y is None:
        raise ValueError(f"not a dotted version: {a!r} / {b!r}")
    n = max(len(x), len(y))
    x, y = x + [0] * (n - len(x)), y + [0] * (n - len(y))
    return (x > y) - (x < y)


def _bounded(fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (True, result) or (False, exception / "timeout")."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported, never raised: doctor must finish
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="gpufeed-doctor-probe")
    t.start()
    t.join(seconds)
    if t.is_alive():
        return False, "timeout"
    if "error" in box:
        return False, box["error"]
    return True, box.get("value")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------- thresholds


def _thresholds(env: Mapping[str, str]) -> tuple[dict[str, str] | None, Check | None]:
    # As the preflight: GPUFEED_THRESHOLDS names the file; unset, the installed default.
    path = env.get("GPUFEED_THRESHOLDS") or None
    if path is not None and not os.access(path, os.R_OK):
        return None, Check(
            "thresholds",
            "thresholds",
            FAIL,
            f"GPUFEED_THRESHOLDS={path} is not a readable file",
            "point it at a KEY=VALUE file or unset it",
            exit_code=EXIT_CONFIG,
        )
    try:
        values = thresholds.read(path, env)
        for key in ("GPUFEED_MIN_DRIVER", "GPUFEED_CUDA_FULL_DRIVER", "GPUFEED_MIN_SHM_MB"):
            if (env.get(key) or "").strip():  # the environment wins, even over an empty file
                values[key] = env[key].strip()
            if key not in values or _version_fields(values[key]) is None:
                raise ValueError(f"{key}={values.get(key)!r} is not a number or dotted version")
        int(values["GPUFEED_MIN_SHM_MB"])
    except (OSError, ValueError) as exc:
        return None, Check(
            "thresholds",
            "thresholds",
            FAIL,
            f"thresholds unusable: {exc}",
            "fix the environment variable or the thresholds file",
            exit_code=EXIT_CONFIG,
        )
    return values, None


# ---------------------------------------------------------------- driver and GPUs


@dataclass
class _DriverInfo:
    version: str | None = None
    versions: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    memory_bytes: list[int | None] = field(default_factory=list)
    source: str | None = None
    problems: list[str] = field(default_factory=list)


def _nvidia_smi(args: list[str], wait: float, env: Mapping[str, str]) -> tuple[int, str]:
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


def _driver_info(env: Mapping[str, str], smi_wait: float) -> _DriverInfo:
    """The preflight's sources in its order: nvidia-smi, then the kernel module's file."""
    info = _DriverInfo()
    rc, out = _nvidia_smi(
        ["--query-gpu=driver_version,name", "--format=csv,noheader"], smi_wait, env
    )
    if rc == 0:
        for line in out.splitlines():
            version, _, name = line.partition(",")
            version = version.strip()
            if _version_fields(version) is None:
                continue
            info.versions.append(version)
            info.names.append(name.strip())
        if info.versions:
            info.version = min(info.versions, key=lambda v: _version_fields(v))
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
                    found = [w for w in line.split() if _version_fields(w) and "." in w]
                    if found:
                        info.version, info.source = found[0], proc
                        break
            else:
                info.problems.append(f"{proc} has no NVRM version line")
        except OSError:
            info.problems.append(f"{proc} does not exist")
    if info.names:
        info.memory_bytes = [None] * len(info.names)
        rc, out = _nvidia_smi(
            ["--query-gpu=memory.total", "--format=csv,noheader,nounits"], smi_wait, env
        )
        if rc == 0:
            mib = [line.strip() for line in out.splitlines() if line.strip().isdigit()]
            if len(mib) == len(info.names):
                info.memory_bytes = [int(m) << 20 for m in mib]
    return info


def _nvml_gpus() -> list[dict[str, Any]]:
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


def _driver_checks(
    env: Mapping[str, str], limits: Mapping[str, str], torch_cuda: str | None, smi_wait: float
) -> tuple[list[Check], _DriverInfo]:
    checks: list[Check] = []
    info = _driver_info(env, smi_wait)
    min_drv, full_drv = limits["GPUFEED_MIN_DRIVER"], limits["GPUFEED_CUDA_FULL_DRIVER"]
    image_cuda = ".".join((env.get("CUDA_VERSION") or "").split(".")[:2])
    image = f"this CUDA {image_cuda} image" if image_cuda else "this image"
    if info.version is None:
        why = "; ".join(info.problems)
        fix = (
            "expose the GPU: docker run --gpus all ... (compose: deploy.resources.reservations"
            ".devices); the host needs a working driver and the NVIDIA Container Toolkit "
            "(nvidia-ctk runtime configure --runtime=docker, restart dockerd)"
        )
        if _truthy(env.get("GPUFEED_ALLOW_CPU")):
            checks.append(
                Check(
                    "driver",
                    "driver",
                    WARN,
                    f"no NVIDIA driver answered ({why}); running on the CPU as "
                    "GPUFEED_ALLOW_CPU=1 allows",
                    fix,
                    {"problems": info.problems},
                )
            )
        else:
            checks.append(
                Check(
                    "driver",
                    "driver",
                    FAIL,
                    f"no NVIDIA driver answered ({why})",
                    fix + "; to run on the CPU on purpose set GPUFEED_ALLOW_CPU=1",
                    {"problems": info.problems},
                    EXIT_NO_DRIVER,
                )
            )
        return checks, info
    data = {"version": info.version, "source": info.source, "minimum": min_drv}
    if version_cmp(info.version, min_drv) < 0:
        checks.append(
            Check(
                "driver",
                "driver",
                FAIL,
                f"NVIDIA driver {info.version} is older than {min_drv}, the minimum for {image}",
                "update the host driver or use an image built for an older CUDA",
                data,
                EXIT_DRIVER_OLD,
            )
        )
        return checks, info
    checks.append(
        Check(
            "driver",
            "driver",
            OK,
            f"NVIDIA driver {info.version} (minimum {min_drv}, from {info.source})",
            None,
            data,
        )
    )
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
    compat = (
        "compiled GPU code runs, but PTX newer than the driver cannot be JIT-compiled "
        "(cudaErrorUnsupportedPtxVersion) and some newer APIs fail"
    )
    if version_cmp(info.version, full_drv) < 0:
        checks.append(
            Check(
                "driver",
                "driver_image_cuda",
                WARN,
                f"driver {info.version} is older than {full_drv}, which "
                f"{'CUDA ' + image_cuda if image_cuda else 'this image'} needs for full "
                f"support: CUDA minor-version compatibility mode applies ({compat})",
                f"update the host driver to {full_drv} or newer",
                {"full": full_drv},
            )
        )
    if torch_cuda:
        major = torch_cuda.split(".")[0]
        floor, need = CUDA_DRIVER_FLOOR.get(major), CUDA_FULL_DRIVER.get(torch_cuda)
        tdata = {"torch_cuda": torch_cuda, "floor": floor, "full": need}
        if floor and version_cmp(info.version, floor) < 0:
            checks.append(
                Check(
                    "driver",
                    "driver_torch_cuda",
                    FAIL,
                    f"driver {info.version} is older than {floor}, the oldest that runs "
                    f"torch's CUDA {torch_cuda} build: torch cannot use the GPU",
                    f"update the host driver to {need or floor} or newer, or install a torch "
                    f"built for an older CUDA",
                    tdata,
                    EXIT_DRIVER_OLD,
                )
            )
        elif need and version_cmp(info.version, need) < 0:
            checks.append(
                Check(
                    "driver",
                    "driver_torch_cuda",
                    WARN,
                    f"torch is built for CUDA {torch_cuda}, which needs driver {need} for full"
                    f" support; with {info.version} minor-version compatibility mode applies",
                    f"update the host driver to {need} or newer",
                    tdata,
                )
            )
        else:
            checks.append(
                Check(
                    "driver",
                    "driver_torch_cuda",
                    OK,
                    f"torch's CUDA {torch_cuda} build fully supported by driver "
                    f"{info.version}" + (f" (needs {need})" if need else ""),
                    None,
                    tdata,
                )
            )
    return checks, info


def _visible_devices(env: Mapping[str, str]) -> tuple[str, str | None]:
    nvd = env.get("NVIDIA_VISIBLE_DEVICES")
    nodes = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    parts = []
    fix = None
    if nvd is None:
        parts.append("NVIDIA_VISIBLE_DEVICES unset (not an NVIDIA container image)")
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


def _gpu_checks(
    env: Mapping[str, str], driver: _DriverInfo, torch_gpus: list[dict] | None, timeout: float
) -> list[Check]:
    checks = []
    ok, nvml = _bounded(_nvml_gpus, timeout)
    names = [g["name"] for g in nvml] if ok and nvml else driver.names
    memory = [g["memory_bytes"] for g in nvml] if ok and nvml else driver.memory_bytes
    seen_by = "NVML" if ok and nvml else ("nvidia-smi" if driver.names else None)
    visible, vis_fix = _visible_devices(env)
    gpus = [
        {"name": n, "memory_bytes": m}
        for n, m in zip(names, memory or [None] * len(names), strict=False)
    ]
    if names:
        listing = ", ".join(
            f"{g['name']} ({_human(g['memory_bytes'])})" if g["memory_bytes"] else g["name"]
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
                or "start the container with --gpus all (compose: deploy.resources.reservations"
                ".devices)",
                {"gpus": []},
            )
        )
    status = WARN if vis_fix else INFO
    checks.append(Check("gpu", "visibility", status, f"in this container: {visible}", vis_fix))
    if torch_gpus is None:
        checks.append(Check("gpu", "gpus_torch", INFO, "torch did not report (see torch below)"))
    elif torch_gpus:
        listing = ", ".join(f"{g['name']} ({_human(g['memory_bytes'])})" for g in torch_gpus)
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


# ---------------------------------------------------------------- torch


def _torch_probe() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("torchvision", "torchaudio"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
    except Exception:  # a broken cuDNN load is reported as missing
        out["cudnn"] = None
    try:
        import torch.distributed as dist

        out["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        out["nccl"] = False
    out["nccl_version"] = None
    if out["nccl"]:
        try:
            v = torch.cuda.nccl.version()
            out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": p.name,
                    "memory_bytes": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
    out["gpus"] = gpus
    return out


def _torch_checks(probe_ok: bool, probe: Any) -> list[Check]:
    if not probe_ok:
        why = "did not finish in time" if probe == "timeout" else f"{type(probe).__name__}: {probe}"
        return [
            Check(
                "torch",
                "torch",
                WARN,
                f"could not ask torch ({why})",
                "run python -c 'import torch; print(torch.cuda.is_available())' to see why",
            )
        ]
    p = probe
    versions = ", ".join(
        f"{k} {p[k]}" for k in ("torch", "torchvision", "torchaudio") if p.get(k) is not None
    )
    missing = [k for k in ("torchvision", "torchaudio") if p.get(k) is None]
    checks = [
        Check(
            "torch",
            "torch",
            OK if not missing else INFO,
            versions + (f" (not installed: {', '.join(missing)})" if missing else ""),
            None,
            {k: p.get(k) for k in ("torch", "torchvision", "torchaudio")},
        )
    ]
    if p["cuda"] is None:
        checks.append(
            Check(
                "torch",
                "cuda_build",
                WARN,
                "torch is a CPU-only build: no GPU use",
                "install a CUDA build of torch (the images carry one)",
                {},
            )
        )
    else:
        cudnn = p.get("cudnn")
        cudnn_text = (
            f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}"
            if isinstance(cudnn, int) and cudnn >= 10000
            else str(cudnn)
        )
        checks.append(
            Check(
                "torch",
                "cuda_build",
                OK,
                f"CUDA {p['cuda']}, cuDNN {cudnn_text if cudnn else 'not available'}",
                None,
                {"cuda": p["cuda"], "cudnn": cudnn},
            )
        )
    nccl = p.get("nccl")
    checks.append(
        Check(
            "torch",
            "nccl",
            OK if nccl else (INFO if p["cuda"] is None else WARN),
            f"NCCL available{' (' + p['nccl_version'] + ')' if p.get('nccl_version') else ''}"
            if nccl
            else "NCCL not available (multi-GPU DDP needs it; gloo works on the CPU)",
            None if nccl else "use a CUDA build of torch on Linux",
            {"nccl": nccl},
        )
    )
    return checks


# ---------------------------------------------------------------- CPU, memory, shm, limits


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
    from gpufeed.settings import SETTINGS_ENV, worker_outlook

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


def _host_checks(
    limits: Mapping[str, str],
    workers: int | None,
    batch_bytes: int,
    has_gpu: bool,
    cgroup_root: str,
    self_cgroup: str,
    shm_path: str,
) -> tuple[list[Check], int]:
    import warnings

    checks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sysinfo.SysinfoWarning)
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
        fix = (
            "few CPUs to decode and augment on; give the container more (docker run --cpus, "
            "--cpuset-cpus) or pack the data with encode='raw' so loading needs no decode"
        )
    checks.append(
        Check(
            "cpu",
            "cpus",
            status,
            cpu_msg,
            fix,
            {
                **budget._asdict(),
                "host": host_cpus,
                "workers": chosen,
                "worker_plan": asdict(outlook),
            },
        )
    )
    if settings_problem is not None:
        checks.append(settings_problem)
    for w in caught:
        checks.append(Check("cpu", "cgroup_files", WARN, str(w.message), None))

    total = _meminfo_total()
    if mem_limit is not None:
        mem_msg = f"memory limit {_human(mem_limit)} (cgroup) of {_human(total or 0)} on the host"
        mem_status, mem_fix = OK, None
        per = mem_limit / max(1, chosen + 1)
        if per < 2 << 30:
            mem_status = WARN
            mem_fix = (
                f"{_human(per)} per process for {chosen} workers + the trainer; raise the "
                "limit (docker run --memory) or use fewer workers"
            )
    else:
        mem_msg = f"no cgroup memory limit; {_human(total or 0)} on the host"
        mem_status, mem_fix = OK, None
    checks.append(
        Check(
            "memory",
            "memory",
            mem_status,
            mem_msg,
            mem_fix,
            {"limit_bytes": mem_limit, "host_bytes": total},
        )
    )

    shm = sysinfo.shm_info(shm_path)
    floor_mb = int(limits["GPUFEED_MIN_SHM_MB"])
    need = chosen * _TORCH_PREFETCH * batch_bytes
    shm_fix = (
        'give the container more: compose "shm_size: 8gb" (or "ipc: host"), '
        "docker run --shm-size=8g"
    )
    if shm is None:
        checks.append(
            Check(
                "memory",
                "shm",
                WARN,
                f"{shm_path} does not exist, so DataLoader workers cannot share batches",
                shm_fix,
                {"path": shm_path},
            )
        )
    else:
        total_mb = shm.total_bytes >> 20
        data = {
            "path": shm_path,
            "total_bytes": shm.total_bytes,
            "free_bytes": shm.free_bytes,
            "min_mb": floor_mb,
            "need_bytes": need,
            "workers": chosen,
        }
        text = (
            f"{shm_path} {total_mb} MiB ({_human(shm.free_bytes)} free); {chosen} workers x "
            f"prefetch {_TORCH_PREFETCH} x {_human(batch_bytes)} batches need ~{_human(need)}"
        )
        if total_mb < floor_mb:
            checks.append(
                Check(
                    "memory",
                    "shm",
                    WARN,
                    f"{text}; less than {floor_mb} MiB "
                    '(GPUFEED_MIN_SHM_MB): workers fail with "bus error" when it '
                    "fills",
                    shm_fix,
                    data,
                )
            )
        elif need > shm.free_bytes:
            checks.append(Check("memory", "shm", WARN, f"{text}: more than is free", shm_fix, data))
        else:
            checks.append(Check("memory", "shm", OK, text, None, data))

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    fmt = lambda v: "unlimited" if v == inf else str(v)  # noqa: E731
    if soft != inf and soft < 4096:
        fix = "docker run --ulimit nofile=65536:65536 (compose ulimits.nofile)" + (
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
                "docker run --ulimit memlock=-1 (compose ulimits.memlock: -1)",
                {"soft": soft, "hard": hard},
            )
        )
    return checks, chosen


# ---------------------------------------------------------------- dataset


def _walk(root: Path, deadline: float, max_files: int) -> dict[str, Any]:
    files = 0
    size = 0
    sample: list[tuple[str, int]] = []  # reservoir of (path, size) for the read probes
    rng = random.Random(0)
    complete = True
    stack = [str(root)]
    while stack:
        if time.monotonic() > deadline or files >= max_files:
            complete = False
            break
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file():
                            st = e.stat()
                            files += 1
                            size += st.st_size
                            if len(sample) < 256:
                                sample.append((e.path, st.st_size))
                            elif rng.random() < 256 / files:
                                sample[rng.randrange(256)] = (e.path, st.st_size)
                    except OSError:
                        continue
        except OSError:
            continue
    return {"files": files, "bytes": size, "complete": complete, "sample": sample}


def _evict(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _read_probe(sample: list[tuple[str, int]], seconds: float) -> dict[str, Any]:
    """Two short probes, each file's page cache dropped first where the kernel allows:
    sequential 1 MiB reads through the largest sampled files, then one 64 KiB read at a
    random offset of randomly chosen files (for small files: how a per-file loader reads)."""
    chunk, block, cap = 1 << 20, 64 << 10, 256 << 20
    read = 0
    start = time.perf_counter()
    stop = start + seconds / 2
    for path, _ in sorted(sample, key=lambda s: -s[1]):
        if time.perf_counter() > stop or read >= cap:
            break
        try:
            with open(path, "rb", buffering=0) as f:
                _evict(f.fileno())
                while read < cap and time.perf_counter() < stop:
                    b = f.read(chunk)
                    if not b:
                        break
                    read += len(b)
        except OSError:
            continue
    seq_s = time.perf_counter() - start
    rng = random.Random(1)
    reads = rbytes = 0
    start = time.perf_counter()
    stop = start + seconds / 2
    while sample and time.perf_counter() < stop and reads < 20000:
        path, size = sample[rng.randrange(len(sample))]
        try:
            with open(path, "rb", buffering=0) as f:
                _evict(f.fileno())
                if size > block:
                    f.seek(rng.randrange(0, size - block))
                rbytes += len(f.read(block))
                reads += 1
        except OSError:
            continue
    rnd_s = time.perf_counter() - start
    return {
        "seq_bytes": read,
        "seq_mib_s": read / seq_s / 2**20 if seq_s > 0 and read else None,
        "random_reads": reads,
        "random_bytes": rbytes,
        "random_reads_s": reads / rnd_s if rnd_s > 0 and reads else None,
        "random_mib_s": rbytes / rnd_s / 2**20 if rnd_s > 0 and reads else None,
    }


def _dataset_checks(data_dir: str, walk_seconds: float, probe_seconds: float) -> list[Check]:
    checks = []
    root = Path(data_dir)
    mount_fix = (
        f"mount it: DATASET_DIR=/path/to/dataset docker compose up, or docker run -v "
        f"/path/to/dataset:{data_dir}:ro"
    )
    if not root.exists():
        return [
            Check(
                "dataset",
                "dataset",
                WARN,
                f"dataset directory {data_dir} does not exist",
                mount_fix,
                {"path": data_dir},
            )
        ]
    if not root.is_dir():
        return [
            Check(
                "dataset",
                "dataset",
                WARN,
                f"dataset path {data_dir} is not a directory",
                mount_fix,
                {"path": data_dir},
            )
        ]
    if not os.access(root, os.R_OK | os.X_OK):
        return [
            Check(
                "dataset",
                "dataset",
                WARN,
                f"dataset directory {data_dir} is not readable by uid {os.getuid()}",
                "make it readable on the host (chmod -R a+rX) or run as its owner "
                "(docker run --user)",
                {"path": data_dir},
            )
        ]
    try:
        empty = not any(root.iterdir())
    except OSError as exc:
        return [Check("dataset", "dataset", WARN, f"cannot list {data_dir}: {exc}", mount_fix)]
    if empty:
        return [
            Check(
                "dataset",
                "dataset",
                WARN,
                f"dataset directory {data_dir} is empty",
                f"check the host path, then {mount_fix}; or make a demo set: "
                "gpufeed synth ~/demo-data",
                {"path": data_dir},
            )
        ]
    try:
        readonly = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = None
    ro_text = {True: "read-only", False: "writable", None: "mount mode unknown"}[readonly]
    checks.append(
        Check(
            "dataset",
            "dataset",
            OK if readonly in (True, None) else INFO,
            f"dataset {data_dir} readable, {ro_text}",
            None,
            {"path": data_dir, "readonly": readonly},
        )
    )
    ok, walked = _bounded(
        lambda: _walk(root, time.monotonic() + walk_seconds, 2_000_000), walk_seconds + 5
    )
    if not ok:
        checks.append(
            Check(
                "dataset",
                "files",
                WARN,
                f"listing {data_dir} did not finish "
                f"within {walk_seconds + 5:g} s (slow or hung storage)",
                "check the mount (network filesystem?) from the host",
            )
        )
        return checks
    at_least = "" if walked["complete"] else "at least "
    files_text = f"{at_least}{walked['files']} files, {at_least}{_human(walked['bytes'])}" + (
        "" if walked["complete"] else f" (stopped after {walk_seconds:g} s)"
    )
    manifest = root / "manifest.json"
    fdata = {k: walked[k] for k in ("files", "bytes", "complete")}
    status, fix = OK, None
    if manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
            files_text += f"; a gpufeed {m.get('format')} pack of {m.get('count')} samples"
            fdata["pack"] = {"format": m.get("format"), "count": m.get("count")}
        except (OSError, ValueError):
            pass
    elif walked["files"] >= 10000 and walked["bytes"] / max(1, walked["files"]) < 1 << 20:
        status = WARN
        fix = (
            "many small files: pack them once (gpufeed pack DATA /workspace/packed --format "
            "hdf5) and read the pack; per-file open and decode often starves the GPU"
        )
        files_text += f", {_human(walked['bytes'] / walked['files'])} per file on average"
    checks.append(Check("dataset", "files", status, files_text, fix, fdata))
    if not walked["sample"]:
        return checks
    ok, probe = _bounded(lambda: _read_probe(walked["sample"], probe_seconds), probe_seconds + 10)
    if not ok:
        checks.append(
            Check(
                "dataset",
                "read_speed",
                WARN,
                f"read probe did not finish within {probe_seconds + 10:g} s (slow or hung storage)",
                "check the mount from the host",
            )
        )
        return checks
    parts = []
    if probe["seq_mib_s"]:
        parts.append(f"sequential {probe['seq_mib_s']:.0f} MiB/s over {_human(probe['seq_bytes'])}")
    if probe["random_reads_s"]:
        avg = probe["random_bytes"] / probe["random_reads"]
        parts.append(
            f"random reads {probe['random_reads_s']:.0f}/s of {_human(avg)} each "
            f"({probe['random_mib_s']:.1f} MiB/s)"
        )
    checks.append(
        Check(
            "dataset",
            "read_speed",
            INFO,
            "read speed: " + ", ".join(parts) + " (page cache dropped per file where allowed)",
            None,
            probe,
        )
    )
    return checks


# ---------------------------------------------------------------- entry points


def diagnose(
    data_dir: str | os.PathLike | None = None,
    *,
    workers: int | None = None,
    batch_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
    probe_seconds: float = 2.0,
    walk_seconds: float = 3.0,
    timeout: float = 20.0,
    check_dataset: bool = True,
    cgroup_root: str = sysinfo.CGROUP_ROOT,
    self_cgroup: str = sysinfo.SELF_CGROUP,
    shm_path: str | None = None,
) -> DoctorReport:
    """Check driver, GPUs, torch, CPUs, memory, ``/dev/shm``, limits and the dataset.

    ``data_dir`` defaults to ``GPUFEED_DATA_DIR`` (else ``/data``); ``workers`` to what
    :func:`gpufeed.make_loader` would plan on this machine; ``batch_bytes`` (one batch in
    shared memory) to 256 uint8 224x224 RGB images. ``timeout`` bounds each GPU/torch probe.
    """
    start = time.perf_counter()
    env = os.environ if environ is None else environ
    limits, problem = _thresholds(env)
    if problem is not None:
        return DoctorReport([problem], time.perf_counter() - start)
    smi_wait = float(env.get("GPUFEED_NVIDIA_SMI_TIMEOUT") or 10)
    probe_ok, probe = _bounded(_torch_probe, timeout)
    torch_cuda = probe.get("cuda") if probe_ok else None
    checks, driver = _driver_checks(env, limits, torch_cuda, smi_wait)
    checks += _gpu_checks(env, driver, probe.get("gpus") if probe_ok else None, timeout)
    checks += _torch_checks(probe_ok, probe)
    has_gpu = bool(driver.names) or bool(probe_ok and probe.get("gpus"))
    host, _ = _host_checks(
        limits,
        workers,
        batch_bytes or 256 * _DEFAULT_SAMPLE_BYTES,
        has_gpu,
        cgroup_root,
        self_cgroup,
        shm_path or env.get("GPUFEED_SHM_PATH") or "/dev/shm",
    )
    checks += host
    if check_dataset:
        data = os.path.abspath(data_dir or env.get("GPUFEED_DATA_DIR") or "/data")
        checks += _dataset_checks(data, walk_seconds, probe_seconds)
    return DoctorReport(checks, time.perf_counter() - start)


def add_arguments(parser) -> None:
    parser.add_argument(
        "data_dir",
        nargs="?",
        metavar="DATA_DIR",
        help="dataset folder to check (default $GPUFEED_DATA_DIR, else /data)",
    )
    from gpufeed import cliargs

    parser.add_argument(
        "--workers",
        type=cliargs.workers,
        default=None,
        help="DataLoader workers to size /dev/shm for (default: as make_loader plans here)",
    )
    parser.add_argument(
        "--batch-mb",
        type=cliargs.mebibytes,
        default=None,
        help="MiB of one batch in shared memory (default 36.8: 256 uint8 224x224 RGB images)",
    )
    parser.add_argument("--no-dataset", action="store_true", help="skip the dataset checks")
    parser.add_argument(
        "--probe-seconds",
        type=cliargs.seconds(0, 600, above=True),
        default=2.0,
        help="time for the read-speed probe (default 2)",
    )
    parser.add_argument(
        "--allow-cpu", action="store_true", help="no driver is a warning, as GPUFEED_ALLOW_CPU=1"
    )


def main(args) -> int:
    env = dict(os.environ)
    if args.allow_cpu:
        env["GPUFEED_ALLOW_CPU"] = "1"
    report = diagnose(
        args.data_dir,
        workers=args.workers,
        batch_bytes=int(args.batch_mb * 2**20) if args.batch_mb else None,
        environ=env,
        probe_seconds=args.probe_seconds,
        check_dataset=not args.no_dataset,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.format(only_problems=args.quiet, data=args.verbose))
    return report.exit_code
