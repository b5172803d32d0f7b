"""gpufeed doctor: the preflight's rules (replayed from its own scenarios), bounded probes,
host limits from cgroup fixtures, the dataset probes, and the CLI's exit status and JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from gpufeed.system.native import install_hint
from gpufeed.system.thresholds import version_cmp
from gpufeed.tools import doctor
from gpufeed.tools.doctor import dataset, diagnose, gpu, probe, thresholds_check
from gpufeed.tools.doctor.driver import driver_checks
from gpufeed.tools.doctor.place import detect_place
from gpufeed.tools.doctor.report import FAIL, INFO, OK, WARN

ROOT = Path(__file__).resolve().parents[3]


def _load_harness():
    # By file, not through sys.path: tests/entrypoints on sys.path would make its conftest
    # shadow this folder's for `import conftest` elsewhere.
    if "preflight_harness" in sys.modules:  # the entrypoint tests ran first
        return sys.modules["preflight_harness"]
    path = ROOT / "tests" / "entrypoints" / "preflight_harness.py"
    spec = importlib.util.spec_from_file_location("preflight_harness", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preflight_harness"] = module
    spec.loader.exec_module(module)
    return module


_harness = _load_harness()
PREFLIGHT, SCENARIOS = _harness.PREFLIGHT, _harness.SCENARIOS
Sandbox, run_preflight = _harness.Sandbox, _harness.run_preflight

CGROUPS = Path(__file__).resolve().parents[1] / "fixtures" / "cgroup"
# file system roots with (or without) a container's markers, for detect_place(root)
PLACES = Path(__file__).resolve().parents[1] / "fixtures" / "place"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Sandbox:
    root = tmp_path_factory.mktemp("doctor-sandbox")
    return Sandbox.create(root, shm_path=root)


def quick(env, own_torch_build: bool = False, **kw):
    """diagnose() without the dataset probes (they have their own tests). Unless
    ``own_torch_build``, as if the installed torch had no CUDA build (as CI's CPU torch): these
    scenarios give the image's CUDA in the environment, and a host torch built for another
    CUDA (cu130 needs driver 580) would add its own verdict (driver_torch_cuda, tested on its
    own) to every old-driver scenario. In a container unless ``root`` says otherwise: the
    preflight's rules are the image's."""
    kw.setdefault("check_dataset", False)
    kw.setdefault("root", PLACES / "docker")
    if own_torch_build:
        return diagnose(environ=env, **kw)
    real_probe = doctor.torch_probe
    with mock.patch.object(doctor, "torch_probe", lambda: {**real_probe(), "cuda": None}):
        return diagnose(environ=env, **kw)


# ------------------------------------------------------------------ shared rules


@pytest.mark.parametrize(
    "a,b",
    [
        ("524.99", "525"),
        ("525", "525.0"),
        ("525.60.2", "525.60.13"),
        ("535.1", "525.60.13"),
        ("570.26", "570.26"),
        ("580.65.06", "580.65.6"),
        ("1", "1.0.0.1"),
    ],
)
def test_version_cmp_is_the_preflights(a, b):
    script = f'a=$1 b=$2; set -- --lib; . "{PREFLIGHT}"; pf_version_cmp "$a" "$b"'
    for x, y in ((a, b), (b, a)):
        shell = subprocess.run(
            ["sh", "-c", script, "sh", x, y], capture_output=True, text=True, check=True
        )
        assert version_cmp(x, y) == int(shell.stdout), (x, y, shell.stdout)


# Scenarios about the preflight's own switches (skipping, quiet output) have no doctor twin.
_REPLAYED = [
    sc
    for sc in SCENARIOS
    if not any(k in sc.env_overrides for k in ("GPUFEED_SKIP_PREFLIGHT", "GPUFEED_PREFLIGHT_QUIET"))
    and not sc.needs_small_shm
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", _REPLAYED, ids=[sc.id for sc in _REPLAYED])
def test_exit_status_agrees_with_preflight(sandbox, scenario):
    """The same environment gives the same verdict from the shell preflight and doctor."""
    env = scenario.env(sandbox)
    shell = run_preflight(env)
    report = quick(env, timeout=30)
    assert shell.returncode == scenario.returncode, shell.stderr
    assert report.exit_code == shell.returncode, (report.format(), shell.stderr)


def test_old_driver_names_minimum_and_fix(sandbox):
    env = {**sandbox.base_env(), "FAKE_NVIDIA_DRIVER": "470.82.01"}
    check = quick(env).by_name("driver")
    assert check.status == FAIL and check.exit_code == 3
    assert "470.82.01 is older than 525" in check.message and "CUDA 12.8" in check.message
    assert "update the host driver" in check.fix


def test_minor_version_compatibility_named(sandbox):
    env = {**sandbox.base_env(), "FAKE_NVIDIA_DRIVER": "535.129.03"}
    report = quick(env)
    compat = report.by_name("driver_image_cuda")
    assert compat.status == WARN and "minor-version compatibility" in compat.message
    assert "570.26" in compat.fix
    assert report.exit_code == 0
    full = quick({**env, "FAKE_NVIDIA_DRIVER": "575.51.03"})
    assert "driver_image_cuda" not in [c.name for c in full.checks]


def test_threshold_from_environment_and_file(sandbox, tmp_path):
    env = {**sandbox.base_env(), "FAKE_NVIDIA_DRIVER": "560.35.03"}
    assert quick(env).exit_code == 0
    assert quick({**env, "GPUFEED_MIN_DRIVER": "565"}).exit_code == 3
    custom = tmp_path / "thresholds.env"
    custom.write_text(
        "GPUFEED_MIN_DRIVER=561\nGPUFEED_CUDA_FULL_DRIVER=570\nGPUFEED_MIN_SHM_MB=1\n"
    )
    report = quick({**env, "GPUFEED_THRESHOLDS": str(custom)})
    assert report.exit_code == 3 and "older than 561" in report.by_name("driver").message


@pytest.mark.parametrize(
    "driver,torch_cuda,status,code,words",
    [
        ("575.51.03", "12.8", OK, 0, "fully supported"),
        ("560.35.03", "12.8", WARN, 0, "minor-version compatibility"),
        ("570.124.06", "13.0", FAIL, 3, "torch cannot use the GPU"),
        ("580.65.06", "13.0", OK, 0, "fully supported"),
    ],
)
def test_driver_against_torch_cuda_build(sandbox, driver, torch_cuda, status, code, words):
    env = {**sandbox.base_env(), "FAKE_NVIDIA_DRIVER": driver}
    limits = thresholds_check(env)[0]
    checks, _ = driver_checks(env, limits, torch_cuda, 5)
    check = next(c for c in checks if c.name == "driver_torch_cuda")
    assert check.status == status and check.exit_code == code
    assert words in check.message


# ------------------------------------------------------------------ never hangs


def test_hanging_nvidia_smi_is_bounded(sandbox):
    env = {**sandbox.base_env(), "FAKE_NVIDIA_MODE": "hang", "GPUFEED_NVIDIA_SMI_TIMEOUT": "1"}
    start = time.monotonic()
    report = quick(env)
    assert time.monotonic() - start < 15
    check = report.by_name("driver")
    assert check.exit_code == 4 and "did not answer within 1s" in check.message


def test_bounded_returns_on_timeout():
    start = time.monotonic()
    ok, why = probe.bounded(lambda: time.sleep(30), 0.2)
    assert (ok, why) == (False, "timeout") and time.monotonic() - start < 5
    ok, err = probe.bounded(lambda: 1 / 0, 5)
    assert not ok and isinstance(err, ZeroDivisionError)


# ------------------------------------------------------------------ GPUs, torch


def test_gpus_listed_with_memory_and_visibility(sandbox, monkeypatch):
    monkeypatch.setattr(gpu, "nvml_gpus", lambda: [])  # a real NVML must not answer here
    env = {
        **sandbox.base_env(),
        "FAKE_NVIDIA_GPUS": "NVIDIA A100-SXM4-40GB;NVIDIA H100 PCIe",
        "NVIDIA_VISIBLE_DEVICES": "0,1",
    }
    report = quick(env)
    gpus = report.by_name("gpus_driver")
    assert gpus.status == OK and "2 GPU(s)" in gpus.message
    assert [g["name"] for g in gpus.data["gpus"]] == ["NVIDIA A100-SXM4-40GB", "NVIDIA H100 PCIe"]
    assert "NVIDIA_VISIBLE_DEVICES=0,1" in report.by_name("visibility").message
    void = quick({**env, "NVIDIA_VISIBLE_DEVICES": "void"}).by_name("visibility")
    assert void.status == WARN and "--gpus" in void.fix


def test_torch_versions_as_torch_reports():
    import torch

    report = quick({**os.environ, "GPUFEED_ALLOW_CPU": "1"}, own_torch_build=True)
    check = report.by_name("torch")
    assert check.data["torch"] == torch.__version__
    build = report.by_name("cuda_build")
    if torch.version.cuda is None:
        assert build.status == WARN and "CPU-only" in build.message
    else:
        assert torch.version.cuda in build.message
    assert report.by_name("nccl").data["nccl"] == bool(
        torch.distributed.is_available() and torch.distributed.is_nccl_available()
    )


# ------------------------------------------------------------------ CPU, memory, shm, limits


def test_cpus_from_cgroup_quota_and_memory_limit(sandbox):
    root = CGROUPS / "v2_quota"
    report = quick(
        sandbox.base_env(), cgroup_root=str(root / "root"), self_cgroup=str(root / "self_cgroup")
    )
    cpus = report.by_name("cpus")
    affinity = len(os.sched_getaffinity(0))
    assert cpus.data["count"] == min(affinity, 2)
    assert cpus.data["quota"] == 2.5
    assert "4.0 GiB (cgroup)" in report.by_name("memory").message


def test_shm_against_threshold_and_workers(sandbox, tmp_path):
    env = sandbox.base_env()
    shm = quick(env, shm_path=str(tmp_path), workers=2, batch_bytes=1 << 20).by_name("shm")
    assert shm.status == OK and shm.data["need_bytes"] == 2 * 2 * (1 << 20)
    total_mb = shm.data["total_bytes"] >> 20
    over = quick({**env, "GPUFEED_MIN_SHM_MB": str(total_mb + 1)}, shm_path=str(tmp_path))
    assert (
        over.by_name("shm").status == WARN and "GPUFEED_MIN_SHM_MB" in over.by_name("shm").message
    )
    big = quick(env, shm_path=str(tmp_path), workers=4, batch_bytes=shm.data["free_bytes"])
    assert big.by_name("shm").status == WARN and "--shm-size" in big.by_name("shm").fix
    missing = quick(env, shm_path=str(tmp_path / "nope")).by_name("shm")
    assert missing.status == WARN and "does not exist" in missing.message


def test_jpeg_backend_named_with_why_not_faster(sandbox, monkeypatch):
    from gpufeed.data import decoders

    check = quick(sandbox.base_env()).by_name("jpeg_backend")
    name = decoders.RandomResizedCrop(4).backend
    assert check.section == "cpu" and check.data == {"backend": name}
    assert check.message.startswith(f"JPEG decoder: {name} (")
    assert check.status == (OK if name == "native" else INFO)
    monkeypatch.setattr(decoders, "native_status", lambda: (False, "gpufeed-jpeg: no module"))
    monkeypatch.setattr(decoders, "_opencv_import", lambda: (None, "cv2: no module named cv2"))
    check = quick(sandbox.base_env()).by_name("jpeg_backend")
    assert check.data == {"backend": "torch"} and check.status == INFO
    assert "native: gpufeed-jpeg: no module; opencv: cv2: no module named cv2" in check.message
    assert install_hint() in check.fix


def test_open_file_limit(sandbox):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    check = quick(sandbox.base_env()).by_name("nofile")
    assert check.data == {"soft": soft, "hard": hard}
    assert check.status == (WARN if soft != resource.RLIM_INFINITY and soft < 4096 else OK)


# ------------------------------------------------------------------ dataset


def test_dataset_missing_and_empty(tmp_path):
    missing = dataset.dataset_checks(str(tmp_path / "nope"), 1, 0.2)
    assert [c.status for c in missing] == [WARN] and "does not exist" in missing[0].message
    (tmp_path / "empty").mkdir()
    empty = dataset.dataset_checks(str(tmp_path / "empty"), 1, 0.2)
    assert "is empty" in empty[0].message and "-v /path/to/dataset" in empty[0].fix


def test_dataset_counts_sizes_and_read_speed(tmp_path):
    sizes = [10, 2000, 70_000, 300_000]
    for i, n in enumerate(sizes * 3):
        d = tmp_path / "data" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.bin").write_bytes(os.urandom(n))
    checks = {c.name: c for c in dataset.dataset_checks(str(tmp_path / "data"), 5, 0.4)}
    assert checks["dataset"].status in (OK, INFO)
    assert checks["files"].data["files"] == 12 and checks["files"].data["bytes"] == 3 * sum(sizes)
    assert checks["files"].data["complete"] is True
    speed = checks["read_speed"].data
    assert speed["seq_bytes"] > 0 and speed["random_reads"] > 0
    assert "MiB/s" in checks["read_speed"].message


def test_dataset_walk_is_bounded(tmp_path):
    for i in range(50):
        (tmp_path / f"d{i}").mkdir()
        (tmp_path / f"d{i}" / "x").write_bytes(b"x")
    walked = dataset.walk(tmp_path, time.monotonic() - 1, 10**6)  # deadline already passed
    assert walked["complete"] is False
    partial = dataset.walk(tmp_path, time.monotonic() + 10, 7)
    assert partial["complete"] is False and partial["files"] >= 7


def test_dataset_recognises_a_pack(tmp_path, image_folder):
    import gpufeed

    gpufeed.pack(image_folder, tmp_path / "p", format="hdf5", quiet=True, workers=0)
    files = {c.name: c for c in dataset.dataset_checks(str(tmp_path / "p"), 2, 0.2)}["files"]
    assert files.data["pack"] == {"format": "hdf5", "count": 12}


# ------------------------------------------------------------------ CLI


@pytest.mark.slow
def test_cli_json_and_exit_status(sandbox, python_env, tmp_path):
    env = {**python_env, **sandbox.base_env(), "PATH": sandbox.base_env()["PATH"]}
    env["FAKE_NVIDIA_DRIVER"] = "470.82.01"
    argv = [sys.executable, "-m", "gpufeed.cli", "doctor", "--json", "--probe-seconds", "0.2"]
    old = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(old.stdout)
    assert old.returncode == 3 == report["exit_code"] and report["ok"] is False
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    assert [c["name"] for c in failed] == ["driver"] and failed[0]["fix"]
    env["FAKE_NVIDIA_DRIVER"] = "580.65.06"
    text = subprocess.run(argv[:-3], env=env, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "[ OK ] NVIDIA driver 580.65.06 (minimum 525" in text.stdout
    assert text.stdout.rstrip().splitlines()[-1].startswith("ready:")


# ------------------------------------------------------------------ where it runs


@pytest.mark.parametrize(
    "root,env,container,evidence",
    [
        ("docker", {}, True, "/.dockerenv exists (Docker)"),
        ("podman", {}, True, "/run/.containerenv exists (Podman)"),
        ("cgroup-v1", {}, True, "/proc/self/cgroup names docker"),
        ("host", {}, False, "no container marker"),
        ("host", {"container": "lxc"}, True, "container=lxc is set"),
        ("host", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, True, "Kubernetes"),
        ("docker", {"GPUFEED_IN_CONTAINER": "0"}, False, "GPUFEED_IN_CONTAINER=0"),
        ("host", {"GPUFEED_IN_CONTAINER": "1"}, True, "GPUFEED_IN_CONTAINER=1"),
    ],
)
def test_place_detected_from_its_markers(root, env, container, evidence):
    place = detect_place(PLACES / root, env)
    assert place.container is container and evidence in place.evidence
    assert place.where == ("in this container" if container else "on this host")


def test_cpu_only_host_is_not_a_failure(sandbox, monkeypatch):
    """Issue 38 item 10: outside a container, no driver is a CPU-only machine (exit 0, no
    Docker fix, no "in this container"), unless a GPU is asked for; in a container, the
    preflight's verdict stays."""
    monkeypatch.setattr(gpu, "nvml_gpus", lambda: [])  # a real NVML must not answer here
    no_smi = {**sandbox.base_env(), "PATH": str(sandbox.root / "bin-no-smi")}
    host = quick(no_smi, root=PLACES / "host")
    driver = host.by_name("driver")
    assert host.exit_code == 0 and driver.status == INFO, host.format()
    assert "CPU-only machine" in driver.message and "NVIDIA driver" in driver.fix
    assert host.by_name("place").data == {"container": False, "evidence": ANY_HOST}
    assert "in this container" not in host.format()
    assert not [c.fix for c in host.checks if "docker" in (c.fix or "").lower()]
    assert host.by_name("visibility").message.startswith("on this host:")
    assert host.by_name("cuda_build").status in (OK, INFO)  # a CPU torch is right here

    required = quick(no_smi, root=PLACES / "host", require_gpu=True)
    assert required.exit_code == 4 and required.by_name("driver").status == FAIL
    assert "--require-gpu" in required.by_name("driver").message
    assert "docker" not in required.by_name("driver").fix

    broken = quick(
        {**sandbox.base_env(), "FAKE_NVIDIA_MODE": "fail-communication"}, root=PLACES / "host"
    )
    assert broken.exit_code == 0 and broken.by_name("driver").status == WARN
    assert "nvidia-smi is installed" in broken.by_name("driver").message
    assert "reboot" in broken.by_name("driver").fix

    boxed = quick(no_smi, root=PLACES / "docker")
    assert boxed.exit_code == 4 and "docker run --gpus all" in boxed.by_name("driver").fix
    assert boxed.by_name("visibility").message.startswith("in this container:")


ANY_HOST = "no container marker (/.dockerenv, /run/.containerenv, cgroup)"


def test_native_install_hint_is_the_one_that_works_here(tmp_path):
    """Not ``./app/native`` (true only in the repository root): the source tree's absolute
    path where gpufeed runs from one, else where the package is (it is not on PyPI)."""
    tree = tmp_path / "app" / "native"
    tree.mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[project]\nname = 'gpufeed-jpeg'\n")
    assert install_hint(tree).startswith(f"pip install {tree} ")
    elsewhere = install_hint(tmp_path / "site-packages" / "native")
    assert "checkout of gpufeed's source repository" in elsewhere
    here = install_hint()  # this test runs from the source tree
    assert here.startswith(f"pip install {ROOT / 'app' / 'native'} ")


@pytest.mark.slow
def test_cli_host_and_require_gpu(sandbox, python_env):
    env = {**python_env, **sandbox.base_env(), "PATH": str(sandbox.root / "bin-no-smi")}
    env["GPUFEED_IN_CONTAINER"] = "0"
    argv = [sys.executable, "-m", "gpufeed", "doctor", "--no-dataset", "-q"]
    host = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert host.returncode == 0, host.stdout + host.stderr
    required = subprocess.run(
        [*argv, "--require-gpu"], env=env, capture_output=True, text=True, timeout=120
    )
    assert required.returncode == 4 and "--require-gpu asks for one" in required.stdout
    both = subprocess.run(
        [*argv, "--gpu", "--allow-cpu"], env=env, capture_output=True, text=True, timeout=120
    )
    assert both.returncode == 2 and "not allowed with" in both.stderr
