"""compose.yaml + compose.cpu.yaml bring both services up healthy, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest
import requests
from imagetools import REPO, free_port, public_line, ssh_connect, ssh_run

COMPOSE_FILES = ["-f", str(REPO / "compose.yaml"), "-f", str(REPO / "compose.cpu.yaml")]


@pytest.fixture
def compose_project(tmp_path, jupyter_image, ssh_image, client_key, token):
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "sample.bin").write_bytes(b"gpufeed")
    dataset.chmod(0o755)
    project = f"gpufeed-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": project,
        "JUPYTER_IMAGE": jupyter_image,
        "SSH_IMAGE": ssh_image,
        "DATASET_DIR": str(dataset),
        "JUPYTER_PORT": str(free_port()),
        "SSH_PORT": str(free_port()),
        "JUPYTER_TOKEN": token,
        "SSH_AUTHORIZED_KEYS": public_line(client_key),
    }

    def compose(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", "compose", *COMPOSE_FILES, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=check,
        )

    try:
        yield compose, env
    finally:
        compose("down", "--volumes", "--timeout", "10", check=False)


def wait_all_healthy(compose, services: tuple[str, ...], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        listing = compose("ps", "--all", "--format", "json").stdout
        # Compose 2.21+ prints one JSON object a line; older ones a JSON array.
        rows = (
            json.loads(listing)
            if listing.lstrip().startswith("[")
            else [json.loads(line) for line in listing.splitlines() if line.strip()]
        )
        states = {row["Service"]: (row["State"], row.get("Health", "")) for row in rows}
        if all(states.get(name) == ("running", "healthy") for name in services):
            return
        if any(state == "exited" for state, _ in states.values()):
            break
        time.sleep(1)
    logs = compose("logs", "--no-color", check=False).stdout
    raise AssertionError(f"services not healthy: {states}\n{logs}")


def test_compose_up_both_services_healthy_with_read_only_data(compose_project, client_key, token):
    compose, env = compose_project
    up = compose("up", "--detach", "--no-build", "jupyter", "ssh", check=False)
    assert up.returncode == 0, up.stderr
    wait_all_healthy(compose, ("jupyter", "ssh"))

    for service in ("jupyter", "ssh"):
        read = compose("exec", "-T", service, "cat", "/data/sample.bin", check=False)
        assert read.stdout == "gpufeed", read.stderr
        write = compose("exec", "-T", service, "touch", "/data/new-file", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, write
        shm = compose("exec", "-T", service, "df", "-Pk", "/dev/shm", check=False).stdout
        assert int(shm.splitlines()[-1].split()[1]) >= 8 * 1024 * 1024, shm

    # Published on loopback only, on the ports the settings named.
    ports = compose("port", "jupyter", "8888").stdout.strip()
    assert ports == f"127.0.0.1:{env['JUPYTER_PORT']}", ports
    url = f"http://127.0.0.1:{env['JUPYTER_PORT']}"
    assert requests.get(f"{url}/api/kernels", timeout=10).status_code == 403
    assert requests.get(
        f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10
    ).ok

    # torch.compile's cache: one volume both services write as the non-root user, and SSH
    # sessions are told where it is.
    probe = compose(
        "exec", "-T", "jupyter", "sh", "-c", 'touch "$TORCHINDUCTOR_CACHE_DIR/probe"', check=False
    )
    assert probe.returncode == 0, probe.stderr

    ssh_ports = compose("port", "ssh", "2222").stdout.strip()
    assert ssh_ports == f"127.0.0.1:{env['SSH_PORT']}", ssh_ports
    client = ssh_connect(int(env["SSH_PORT"]), client_key)
    try:
        code, out = ssh_run(client, "cat /data/sample.bin")
        assert code == 0 and out == "gpufeed", out
        code, out = ssh_run(
            client,
            'test -f "$TORCHINDUCTOR_CACHE_DIR/probe" && test -w "$TRITON_CACHE_DIR" && '
            'echo "$TORCHINDUCTOR_CACHE_DIR"',
        )
        assert code == 0 and out.strip() == "/var/cache/torch/inductor", out
    finally:
        client.close()
