"""`make smoke-gpu`'s failure path, on the CPU: where no GPU is visible it must fail loudly
(a GPU runner that lost its GPU must not pass), never skip."""

from __future__ import annotations

import json
import os
import subprocess

from imagetools import REPO


def _smoke(docker_client, ssh_image, out, environment):
    out.mkdir(mode=0o777, exist_ok=True)
    out.chmod(0o777)
    container = docker_client.containers.run(
        ssh_image,
        ["python", "tests/gpu/smoke.py", "--out", "/out"],
        detach=True,
        environment=environment,
        working_dir="/src",
        volumes={str(REPO): {"bind": "/src", "mode": "ro"}, str(out): {"bind": "/out"}},
    )
    try:
        code = container.wait(timeout=120)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def test_no_gpu_stops_at_the_image_preflight(docker_client, ssh_image, tmp_path):
    code, logs = _smoke(docker_client, ssh_image, tmp_path / "out", {})
    assert code == 4, logs  # the entrypoint's preflight: no NVIDIA driver answered
    assert "no NVIDIA driver" in logs, logs


def test_no_gpu_fails_the_smoke_script_itself_with_results(docker_client, ssh_image, tmp_path):
    # Past the entrypoint (GPUFEED_ALLOW_CPU=1): the script re-runs the preflight strictly.
    code, logs = _smoke(docker_client, ssh_image, tmp_path / "out", {"GPUFEED_ALLOW_CPU": "1"})
    assert code == 4, logs
    assert "FAIL preflight" in logs, logs
    results = json.loads((tmp_path / "out" / "smoke-gpu.json").read_text())
    assert results["preflight"]["status"] == "FAILED"
    assert "| preflight | FAILED" in (tmp_path / "out" / "smoke-gpu.md").read_text()


def test_make_smoke_gpu_fails_without_the_nvidia_runtime(ssh_image, tmp_path):
    proc = subprocess.run(
        ["make", "-s", "smoke-gpu", f"SSH_IMAGE={ssh_image}", f"SMOKE_OUT={tmp_path / 'out'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert proc.returncode != 0, proc.stdout
    assert "nvidia" in proc.stderr.lower() or "gpu" in proc.stderr.lower(), proc.stderr
