"""``gpufeed doctor``: is this machine (or container) and its data set up to keep a GPU fed?

Every check gives a status (``ok``, ``warn``, ``fail``, ``info``) and, when not ok, the fix.
Only a failed hard requirement makes :attr:`DoctorReport.exit_code` non-zero, and those are
the preflight's (``entrypoints/preflight.sh``) with its exit codes: 3 driver older than
``GPUFEED_MIN_DRIVER``, 4 no driver answered (unless ``GPUFEED_ALLOW_CPU=1``), 2 thresholds
unusable; doctor adds 3 for a driver too old for the installed torch's CUDA major version.
The numbers come from the same place as the preflight's: the thresholds file of the image's
CUDA major (gpufeed.system.thresholds; ``GPUFEED_THRESHOLDS`` names it), each overridden by an
environment variable of its name.

One module per concern, as the preflight has one file per check: driver (preflight.d/
10-driver), shm (20-shm), dataset (30-dataset), then what only doctor checks: gpu, torchinfo,
host (CPUs, memory, limits); report holds the Check and DoctorReport they make.

Nothing here needs a GPU, and every probe that could block (``nvidia-smi``, NVML, CUDA
initialisation, walking or reading a network mount) runs with a deadline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

from gpufeed import cliargs
from gpufeed.system import sysinfo, thresholds
from gpufeed.tools.doctor.dataset import dataset_checks
from gpufeed.tools.doctor.driver import driver_checks
from gpufeed.tools.doctor.gpu import gpu_checks
from gpufeed.tools.doctor.host import host_checks
from gpufeed.tools.doctor.place import Place, detect_place
from gpufeed.tools.doctor.probe import bounded
from gpufeed.tools.doctor.report import EXIT_CONFIG, FAIL, INFO, Check, DoctorReport
from gpufeed.tools.doctor.torchinfo import torch_checks, torch_probe

__all__ = [
    "Check",
    "DoctorReport",
    "Place",
    "add_arguments",
    "detect_place",
    "diagnose",
    "main",
    "thresholds_check",
]

_DEFAULT_SAMPLE_BYTES = 3 * 224 * 224  # one uint8 ImageNet-sized image


def thresholds_check(env: Mapping[str, str]) -> tuple[dict[str, str] | None, Check | None]:
    """(the thresholds, None) as the preflight reads them, or (None, the failed check)."""
    try:
        return thresholds.load(env), None
    except thresholds.ThresholdsError as exc:
        return None, Check(
            "thresholds", "thresholds", FAIL, str(exc), exc.fix, exit_code=EXIT_CONFIG
        )


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
    require_gpu: bool = False,
    root: str | os.PathLike = "/",
) -> DoctorReport:
    """Check driver, GPUs, torch, CPUs, memory, ``/dev/shm``, limits and the dataset.

    Where it runs (:func:`detect_place` under ``root``) picks the rules and fixes: in a
    container the preflight's (no driver fails, exit 4, unless ``GPUFEED_ALLOW_CPU=1``); on a
    host no driver is a CPU-only machine, not a failure.

    Args:
        data_dir: the dataset folder to check (default ``GPUFEED_DATA_DIR``, else
            ``/data``).
        workers: DataLoader workers to size ``/dev/shm`` for (default: what
            :func:`gpufeed.make_loader` would plan on this machine).
        batch_bytes: one batch in shared memory (default: 256 uint8 224x224 RGB images).
        environ: the environment read (default ``os.environ``).
        probe_seconds: time for the dataset's read-speed probe.
        walk_seconds: time for walking the dataset's files.
        timeout: bounds each GPU/torch probe, in seconds.
        check_dataset: False skips the dataset checks.
        cgroup_root: where the cgroup file system is mounted (tests point it elsewhere).
        self_cgroup: the file naming this process's cgroup.
        shm_path: the shared-memory folder (default ``GPUFEED_SHM_PATH``, else
            ``/dev/shm``).
        require_gpu: no driver fails (exit 4) wherever it runs.
        root: the file system root where to look for signs of a container.

    Returns:
        A :class:`DoctorReport`: every check with its status and fix; ``ok`` and
        ``exit_code`` (the first failure's, as the preflight's) say whether this machine is
        set up to feed a GPU.
    """
    start = time.perf_counter()
    env = os.environ if environ is None else environ
    limits, problem = thresholds_check(env)
    if problem is not None:
        return DoctorReport([problem], time.perf_counter() - start)
    place = detect_place(root, env)
    smi_wait = float(env.get("GPUFEED_NVIDIA_SMI_TIMEOUT") or 10)
    probe_ok, probe = bounded(torch_probe, timeout)
    torch_cuda = probe.get("cuda") if probe_ok else None
    checks, driver = driver_checks(env, limits, torch_cuda, smi_wait, place, require_gpu)
    checks.insert(0, _place_check(place))
    checks += gpu_checks(env, driver, probe.get("gpus") if probe_ok else None, timeout, place)
    has_gpu = bool(driver.names) or bool(probe_ok and probe.get("gpus"))
    checks += torch_checks(probe_ok, probe, gpu_wanted=has_gpu or require_gpu or place.container)
    checks += host_checks(
        limits,
        workers,
        batch_bytes or 256 * _DEFAULT_SAMPLE_BYTES,
        has_gpu,
        cgroup_root,
        self_cgroup,
        shm_path or env.get("GPUFEED_SHM_PATH") or "/dev/shm",
        place,
    )
    if check_dataset:
        data = os.path.abspath(data_dir or env.get("GPUFEED_DATA_DIR") or "/data")
        checks += dataset_checks(data, walk_seconds, probe_seconds)
    return DoctorReport(checks, time.perf_counter() - start)


def _place_check(place: Place) -> Check:
    """Where doctor found itself, so a wrong guess is seen (and overridden) before its fixes."""
    text = (
        f"running {place.where} ({place.evidence}); the fixes below are for it "
        "(GPUFEED_IN_CONTAINER=1 or 0 says otherwise)"
    )
    data = {"container": place.container, "evidence": place.evidence}
    return Check("place", "place", INFO, text, None, data)


def add_arguments(parser) -> None:
    """Add ``gpufeed doctor``'s arguments.

    Args:
        parser: the subcommand's argparse parser.
    """
    parser.add_argument(
        "data_dir",
        nargs="?",
        metavar="DATA_DIR",
        help="dataset folder to check (default $GPUFEED_DATA_DIR, else /data)",
    )
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
    cpu = parser.add_mutually_exclusive_group()
    cpu.add_argument(
        "--allow-cpu",
        action="store_true",
        help="in a container: no driver is a warning, as GPUFEED_ALLOW_CPU=1 (on a host it is "
        "one already)",
    )
    cpu.add_argument(
        "--require-gpu",
        "--gpu",
        action="store_true",
        help="no NVIDIA driver fails (exit 4) wherever doctor runs, a host included",
    )


def main(args) -> int:
    """Run ``gpufeed doctor`` and print its report (JSON with ``--json``).

    Args:
        args: the parsed command line (see add_arguments, and the CLI's common --json,
            --quiet and --verbose).

    Returns:
        The exit status: 0 when nothing failed, else the first failure's code.
    """
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
        require_gpu=args.require_gpu,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    else:
        print(report.format(only_problems=args.quiet, data=args.verbose))
    return report.exit_code
