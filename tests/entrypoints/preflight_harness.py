"""Runs entrypoints/preflight.sh in a sandbox: a fake nvidia-smi, a PATH that holds only the
tools the scripts use, and tmp files for /proc/driver/nvidia/version, /dev/shm and /data.

The scenarios in SCENARIOS are data, so the image tests can replay them against the
preflight installed in a built image:

    from preflight_harness import SCENARIOS, Sandbox, run_preflight
    sandbox = Sandbox.create(root, shm_path=...)        # root: a folder on the host
    def in_container(argv, env):
        # Bind-mount sandbox.root at the same path (-v {root}:{root}) so every path in
        # argv/env means the same inside, and pass env with -e K=V (docker run --rm or exec).
        ...
        return Result(returncode, stdout, stderr)
    for sc in SCENARIOS:
        result = run_preflight(sc.env(sandbox), runner=in_container,
                               script="/usr/local/bin/preflight.sh")
        sc.check(result)

A runner takes (argv, env) and returns a Result; host_runner is the subprocess one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PREFLIGHT = REPO / "entrypoints" / "preflight.sh"
PREFLIGHT_D = REPO / "entrypoints" / "preflight.d"
THRESHOLDS_DIR = REPO / "app" / "src" / "gpufeed" / "system"
THRESHOLDS = THRESHOLDS_DIR / "thresholds-cuda12.env"  # the default image's
THRESHOLDS_CUDA13 = THRESHOLDS_DIR / "thresholds-cuda13.env"
FAKE_NVIDIA_SMI = HERE / "fake-nvidia-smi"

# Everything the scripts and the fake call besides shell builtins. The sandbox PATH holds
# only these, so a tool the scripts start to rely on shows up here first, and a real
# nvidia-smi on a GPU host cannot leak into a "missing" scenario.
TOOLS = (
    "awk",
    "sed",
    "tr",
    "df",
    "timeout",
    "readlink",
    "dirname",
    "id",
    "sleep",
    "pwd",
)

PROC_VERSION = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Thu Oct 19 18:56:32 UTC 2023\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float = 0.0


Runner = Callable[[Sequence[str], Mapping[str, str]], Result]


def host_runner(argv: Sequence[str], env: Mapping[str, str], timeout: float = 60) -> Result:
    start = time.monotonic()
    proc = subprocess.run(
        list(argv),
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def shell_argv(shell: str) -> list[str]:
    """The command that runs a script as POSIX sh: 'dash', 'bash' (--posix) or a path."""
    path = shutil.which(shell) or shell
    return [path, "--posix"] if Path(path).name == "bash" else [path]


def run_preflight(
    env: Mapping[str, str],
    *,
    runner: Runner = host_runner,
    shell: str | None = "dash",
    script: str | os.PathLike[str] = PREFLIGHT,
    args: Sequence[str] = (),
) -> Result:
    """Runs the preflight with exactly env (nothing inherited). shell=None execs the script
    through its shebang."""
    argv = [*(shell_argv(shell) if shell else []), str(script), *args]
    return runner(argv, env)


@dataclasses.dataclass
class Sandbox:
    """The host-side files a scenario points the preflight at; all live under root."""

    root: Path
    shm_path: Path
    small_shm_path: Path | None = None

    @classmethod
    def create(cls, root: Path, shm_path: Path, small_shm_path: Path | None = None) -> Sandbox:
        for name in ("bin", "bin-no-smi", "bin-no-timeout"):
            (root / name).mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            found = shutil.which(tool)
            if found is None:
                raise RuntimeError(f"{tool} is not installed; the preflight needs it")
            for name in ("bin", "bin-no-smi", "bin-no-timeout"):
                if name == "bin-no-timeout" and tool == "timeout":
                    continue
                _link(found, root / name / tool)
        for name in ("bin", "bin-no-timeout"):
            _link(str(FAKE_NVIDIA_SMI), root / name / "nvidia-smi")
        data = root / "data"
        data.mkdir(exist_ok=True)
        (data / "shard-000000.tar").write_bytes(b"")
        (root / "data-empty").mkdir(exist_ok=True)
        (root / "data-file").write_text("not a directory\n")
        for v in ("470.82.01", "535.129.03"):
            (root / f"proc-{v}").write_text(PROC_VERSION.format(v=v))
        (root / "proc-garbage").write_text("NVRM version: unknown\n")
        root.chmod(0o755)
        return cls(root=root, shm_path=shm_path, small_shm_path=small_shm_path)

    def base_env(self) -> dict[str, str]:
        """A passing host: fake nvidia-smi (one H100, 580.65.06), big shm, dataset present,
        no /proc file, the repo's thresholds file. CUDA_VERSION as nvidia/cuda 12.8 sets it."""
        return {
            "PATH": str(self.root / "bin"),
            "LC_ALL": "C",
            "CUDA_VERSION": "12.8.1",
            "GPUFEED_THRESHOLDS": str(THRESHOLDS),
            "GPUFEED_PROC_DRIVER_VERSION": str(self.root / "proc-absent"),
            "GPUFEED_SHM_PATH": str(self.shm_path),
            "GPUFEED_DATA_DIR": str(self.root / "data"),
            "FAKE_NVIDIA_DRIVER": "580.65.06",
            "FAKE_NVIDIA_GPUS": "NVIDIA H100 80GB HBM3",
        }


def _link(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


# Placeholders in Scenario.env values, filled from the sandbox.
def _fill(value: str, sandbox: Sandbox) -> str:
    return value.format(
        root=sandbox.root,
        small_shm=sandbox.small_shm_path or "",
        cuda13=THRESHOLDS_CUDA13,
    )


@dataclasses.dataclass
class Scenario:
    id: str
    env_overrides: dict[str, str | None]  # None removes the key from the base env
    returncode: int
    contains: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    needs_small_shm: bool = False

    def env(self, sandbox: Sandbox) -> dict[str, str]:
        env = sandbox.base_env()
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = _fill(value, sandbox)
        return env

    def check(self, result: Result) -> None:
        shown = f"\n--- stderr ---\n{result.stderr}--- stdout ---\n{result.stdout}"
        assert result.returncode == self.returncode, (
            f"{self.id}: exit {result.returncode}, expected {self.returncode}{shown}"
        )
        for text in self.contains:
            assert text in result.stderr, f"{self.id}: {text!r} not in stderr{shown}"
        for text in self.absent:
            assert text not in result.stderr, f"{self.id}: {text!r} in stderr{shown}"
        assert result.stdout == "", f"{self.id}: preflight wrote to stdout{shown}"


NO_SMI = {"PATH": "{root}/bin-no-smi"}
EXPOSE_GPU = (
    "docker run --gpus all",
    "deploy.resources.reservations.devices",
    "NVIDIA Container Toolkit",
    "GPUFEED_ALLOW_CPU=1",
)
COMPAT = "minor-version compatibility"
OK = "gpufeed preflight: OK: "


def _drv(v: str, **extra: str | None) -> dict[str, str | None]:
    return {"FAKE_NVIDIA_DRIVER": v, **extra}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "driver-470-too-old",
        _drv("470.82.01"),
        3,
        (
            "gpufeed preflight: error: NVIDIA driver 470.82.01 is older than 525, the minimum for "
            "this CUDA 12.8 image; update the host driver or use an image built for an older CUDA",
        ),
        (OK,),
    ),
    Scenario(
        "driver-470-no-cuda-version",
        _drv("470.82.01", CUDA_VERSION=None),
        3,
        ("470.82.01 is older than 525, the minimum for this image;",),
    ),
    Scenario(
        "driver-524.85-too-old",
        _drv("524.85"),
        3,
        ("NVIDIA driver 524.85 is older than 525",),
    ),
    Scenario(
        "driver-525.60.13-compat",
        _drv("525.60.13"),
        0,
        (
            OK + "NVIDIA driver 525.60.13 (minimum 525), 1 GPU: NVIDIA H100 80GB HBM3",
            COMPAT,
            "older than 570.26, which CUDA 12.8 needs",
            "PTX",
            "1 warning(s)",
        ),
        ("error",),
    ),
    Scenario(
        "driver-535-compat-warning",
        _drv("535.129.03"),
        0,
        (
            OK + "NVIDIA driver 535.129.03",
            "warning: NVIDIA driver 535.129.03 is older than 570.26",
            COMPAT,
            "Update the host driver to 570.26 or newer",
        ),
    ),
    Scenario(
        "driver-575-full",
        _drv("575.51.03"),
        0,
        (OK + "NVIDIA driver 575.51.03",),
        (COMPAT, "warning"),
    ),
    Scenario(
        "driver-580-full",
        _drv("580.65.06"),
        0,
        (OK + "NVIDIA driver 580.65.06 (minimum 525), 1 GPU: NVIDIA H100 80GB HBM3",),
        (COMPAT, "warning", "error"),
    ),
    Scenario(
        "gpus-four-same",
        {"FAKE_NVIDIA_GPUS": ";".join(["NVIDIA H100 80GB HBM3"] * 4)},
        0,
        (OK + "NVIDIA driver 580.65.06 (minimum 525), 4 GPUs: 4x NVIDIA H100 80GB HBM3",),
        ("warning",),
    ),
    Scenario(
        "gpus-mixed-names",
        {"FAKE_NVIDIA_GPUS": "NVIDIA A100-SXM4-40GB;NVIDIA H100 PCIe"},
        0,
        ("2 GPUs: NVIDIA A100-SXM4-40GB, NVIDIA H100 PCIe",),
    ),
    Scenario(
        "gpus-different-drivers-lowest-passes",
        {
            "FAKE_NVIDIA_GPUS": "NVIDIA H100 80GB HBM3;NVIDIA H100 80GB HBM3",
            "FAKE_NVIDIA_DRIVERS": "580.65.06;535.129.03",
        },
        0,
        (
            "different drivers (580.65.06, 535.129.03); checked the lowest, 535.129.03",
            OK + "NVIDIA driver 535.129.03",
            COMPAT,
        ),
    ),
    Scenario(
        "gpus-different-drivers-lowest-too-old",
        {
            "FAKE_NVIDIA_GPUS": "GPU A;GPU B",
            "FAKE_NVIDIA_DRIVERS": "575.51.03;470.82.01",
        },
        3,
        ("NVIDIA driver 470.82.01 is older than 525",),
        (OK,),
    ),
    Scenario(
        "smi-missing-no-proc",
        dict(NO_SMI),
        4,
        (
            "error: no NVIDIA driver answered",
            "nvidia-smi is not on PATH",
            "proc-absent does not exist",
            *EXPOSE_GPU,
        ),
        (OK,),
    ),
    Scenario(
        "smi-missing-proc-535",
        {**NO_SMI, "GPUFEED_PROC_DRIVER_VERSION": "{root}/proc-535.129.03"},
        0,
        (
            "nvidia-smi is not on PATH; read the driver version from",
            "--gpus all",
            OK + "NVIDIA driver 535.129.03 (minimum 525, from",
            COMPAT,
        ),
    ),
    Scenario(
        "smi-missing-proc-470",
        {**NO_SMI, "GPUFEED_PROC_DRIVER_VERSION": "{root}/proc-470.82.01"},
        3,
        ("NVIDIA driver 470.82.01 is older than 525",),
    ),
    Scenario(
        "smi-missing-proc-garbage",
        {**NO_SMI, "GPUFEED_PROC_DRIVER_VERSION": "{root}/proc-garbage"},
        4,
        ("has no NVRM version line", *EXPOSE_GPU),
    ),
    Scenario(
        "smi-missing-allow-cpu",
        {**NO_SMI, "GPUFEED_ALLOW_CPU": "1"},
        0,
        (
            "warning: no NVIDIA driver answered; "
            "continuing without a GPU because GPUFEED_ALLOW_CPU=1",
            OK + "no GPU (GPUFEED_ALLOW_CPU=1)",
        ),
        ("error",),
    ),
    Scenario(
        "smi-fail-communication",
        {"FAKE_NVIDIA_MODE": "fail-communication"},
        4,
        (
            "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't "
            "communicate with the NVIDIA driver",
            *EXPOSE_GPU,
        ),
        (OK,),
    ),
    Scenario(
        "smi-fail-communication-allow-cpu",
        {"FAKE_NVIDIA_MODE": "fail-communication", "GPUFEED_ALLOW_CPU": "1"},
        0,
        ("continuing without a GPU", "exit 9", OK + "no GPU"),
    ),
    Scenario(
        "smi-fail-communication-proc-535",
        {
            "FAKE_NVIDIA_MODE": "fail-communication",
            "GPUFEED_PROC_DRIVER_VERSION": "{root}/proc-535.129.03",
        },
        0,
        ("exit 9", "read the driver version from", OK + "NVIDIA driver 535.129.03"),
    ),
    Scenario(
        "smi-no-devices",
        {"FAKE_NVIDIA_MODE": "no-devices"},
        4,
        ("nvidia-smi failed (exit 6): No devices were found", "--gpus all"),
    ),
    Scenario(
        "smi-hang-times-out",
        {"FAKE_NVIDIA_MODE": "hang", "GPUFEED_NVIDIA_SMI_TIMEOUT": "1"},
        4,
        ("nvidia-smi did not answer within 1s",),
    ),
    Scenario(
        "allow-cpu-does-not-excuse-470",
        _drv("470.82.01", GPUFEED_ALLOW_CPU="1"),
        3,
        ("NVIDIA driver 470.82.01 is older than 525",),
        (OK, "continuing without a GPU"),
    ),
    Scenario(
        "cuda13-floor-575-fails",
        _drv(
            "575.51.03",
            GPUFEED_MIN_DRIVER="580",
            GPUFEED_CUDA_FULL_DRIVER="580.65.06",
            CUDA_VERSION="13.0.1",
        ),
        3,
        ("NVIDIA driver 575.51.03 is older than 580, the minimum for this CUDA 13.0 image",),
    ),
    Scenario(
        "cuda13-floor-580.65.06-passes",
        _drv(
            "580.65.06",
            GPUFEED_MIN_DRIVER="580",
            GPUFEED_CUDA_FULL_DRIVER="580.65.06",
            CUDA_VERSION="13.0.1",
        ),
        0,
        (OK + "NVIDIA driver 580.65.06 (minimum 580)",),
        (COMPAT, "warning"),
    ),
    Scenario(
        "cuda13-floor-580.0-compat",
        _drv(
            "580.0",
            GPUFEED_MIN_DRIVER="580",
            GPUFEED_CUDA_FULL_DRIVER="580.65.06",
            CUDA_VERSION="13.0.1",
        ),
        0,
        ("older than 580.65.06, which CUDA 13.0 needs", COMPAT),
    ),
    # the CUDA 13 image's own file (what `make build CUDA=13` installs), not the environment
    Scenario(
        "cuda13-file-575-fails",
        _drv("575.51.03", GPUFEED_THRESHOLDS="{cuda13}", CUDA_VERSION="13.0.1"),
        3,
        ("NVIDIA driver 575.51.03 is older than 580, the minimum for this CUDA 13.0 image",),
    ),
    Scenario(
        "cuda13-file-580.65.06-passes",
        _drv("580.65.06", GPUFEED_THRESHOLDS="{cuda13}", CUDA_VERSION="13.0.1"),
        0,
        (OK + "NVIDIA driver 580.65.06 (minimum 580)",),
        (COMPAT, "warning"),
    ),
    Scenario(
        "cuda13-file-580.0-compat",
        _drv("580.0", GPUFEED_THRESHOLDS="{cuda13}", CUDA_VERSION="13.0.1"),
        0,
        ("older than 580.65.06, which CUDA 13.0 needs", COMPAT),
    ),
    Scenario(
        "quiet-ok-silent",
        {"GPUFEED_PREFLIGHT_QUIET": "1"},
        0,
        (),
        ("gpufeed preflight",),
    ),
    Scenario(
        "quiet-keeps-warnings",
        _drv("535.129.03", GPUFEED_PREFLIGHT_QUIET="1"),
        0,
        (COMPAT,),
        (OK,),
    ),
    Scenario(
        "quiet-keeps-errors",
        _drv("470.82.01", GPUFEED_PREFLIGHT_QUIET="1"),
        3,
        ("error: NVIDIA driver 470.82.01",),
    ),
    Scenario(
        "skip",
        {
            **NO_SMI,
            "GPUFEED_SKIP_PREFLIGHT": "1",
            "GPUFEED_THRESHOLDS": "{root}/nothing",
        },
        0,
        ("warning: skipped (GPUFEED_SKIP_PREFLIGHT=1)",),
        (OK, "error"),
    ),
    Scenario(
        "shm-small-warns",
        {"GPUFEED_SHM_PATH": "{small_shm}"},
        0,
        (
            "is 64 MiB, less than 1024 MiB",
            "shm_size: 8gb",
            "ipc: host",
            "--shm-size=8g",
            OK + "NVIDIA driver 580.65.06",
        ),
        needs_small_shm=True,
    ),
    Scenario(
        "shm-small-does-not-change-error",
        _drv("470.82.01", GPUFEED_SHM_PATH="{small_shm}"),
        3,
        ("is 64 MiB, less than 1024 MiB", "470.82.01 is older than 525"),
        needs_small_shm=True,
    ),
    Scenario(
        "shm-small-env-threshold",
        {"GPUFEED_SHM_PATH": "{small_shm}", "GPUFEED_MIN_SHM_MB": "32"},
        0,
        (OK,),
        ("warning",),
        needs_small_shm=True,
    ),
    Scenario(
        "shm-missing",
        {"GPUFEED_SHM_PATH": "{root}/no-shm"},
        0,
        ("no-shm does not exist", "--shm-size=8g", OK),
    ),
    Scenario(
        "data-missing",
        {"GPUFEED_DATA_DIR": "{root}/no-data"},
        0,
        (
            "warning: dataset directory",
            "no-data does not exist",
            "DATASET_DIR=/path/to/dataset docker compose up",
            "-v /path/to/dataset:",
            OK,
        ),
    ),
    Scenario(
        "data-not-a-directory",
        {"GPUFEED_DATA_DIR": "{root}/data-file"},
        0,
        ("data-file is not a directory", "DATASET_DIR=", OK),
    ),
    Scenario(
        "data-empty",
        {"GPUFEED_DATA_DIR": "{root}/data-empty"},
        0,
        ("data-empty is empty", OK),
    ),
    Scenario(
        "thresholds-file-missing",
        {"GPUFEED_THRESHOLDS": "{root}/nothing"},
        2,
        ("GPUFEED_THRESHOLDS=", "is not a readable file"),
    ),
    Scenario(
        "thresholds-env-not-a-version",
        {"GPUFEED_MIN_DRIVER": "latest"},
        2,
        ("GPUFEED_MIN_DRIVER=latest is not a number or dotted version",),
    ),
    Scenario(
        "thresholds-none-at-all",
        {"GPUFEED_THRESHOLDS": "/dev/null"},
        2,
        ("GPUFEED_MIN_DRIVER is not set",),
    ),
    Scenario(
        "thresholds-all-from-env",
        {
            "GPUFEED_THRESHOLDS": "/dev/null",
            "GPUFEED_MIN_DRIVER": "550",
            "GPUFEED_CUDA_FULL_DRIVER": "560",
            "GPUFEED_MIN_SHM_MB": "1",
        },
        0,
        (OK + "NVIDIA driver 580.65.06 (minimum 550)",),
    ),
    Scenario(
        "no-timeout-binary",
        _drv("535.129.03", PATH="{root}/bin-no-timeout"),
        0,
        (OK + "NVIDIA driver 535.129.03",),
    ),
)


def scenario(scenario_id: str) -> Scenario:
    return next(sc for sc in SCENARIOS if sc.id == scenario_id)
