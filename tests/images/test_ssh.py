"""The SSH image: keys only, no root, the container's environment in sessions, stable host keys."""

from __future__ import annotations

import paramiko
import pytest
from imagetools import public_line, ssh_connect, ssh_run

PORT = "2222/tcp"


def start_ssh(run_container, image, key, *, environment=None, volumes=None):
    env = {"GPUFEED_ALLOW_CPU": "1", "SSH_AUTHORIZED_KEYS": public_line(key), **(environment or {})}
    running = run_container(image, ports=(PORT,), environment=env, volumes=volumes or {})
    running.wait_healthy()
    return running, running.host_port(PORT)


def host_key(port: int) -> str:
    transport = paramiko.Transport(("127.0.0.1", port))
    try:
        transport.start_client(timeout=10)
        return transport.get_remote_server_key().get_fingerprint().hex()
    finally:
        transport.close()


def allowed_auth_types(port: int, user: str) -> list[str]:
    transport = paramiko.Transport(("127.0.0.1", port))
    try:
        transport.start_client(timeout=10)
        with pytest.raises(paramiko.BadAuthenticationType) as refused:
            transport.auth_none(user)
        return refused.value.allowed_types
    finally:
        transport.close()


def test_key_login_runs_torch_with_the_container_environment(run_container, ssh_image, client_key):
    _, port = start_ssh(run_container, ssh_image, client_key)
    client = ssh_connect(port, client_key)
    try:
        code, out = ssh_run(client, "python -c 'import torch; print(torch.__version__)'")
        assert code == 0, out
        assert out.strip().startswith("2.9.1"), out
        code, out = ssh_run(
            client,
            "id -u; command -v python; "
            'echo "$NVIDIA_VISIBLE_DEVICES|$GPUFEED_DATA_DIR|$VIRTUAL_ENV"',
        )
        uid, python, env_line = out.split()
        assert uid != "0"
        assert python == "/opt/venv/bin/python"
        assert env_line == "all|/data|/opt/venv"
        # A login shell reads /etc/profile, which resets PATH on Debian and Ubuntu.
        code, out = ssh_run(client, "bash -lc 'command -v python gpufeed'")
        assert out.split() == ["/opt/venv/bin/python", "/opt/venv/bin/gpufeed"], out
    finally:
        client.close()


def test_passwords_and_root_are_refused(run_container, ssh_image, client_key):
    _, port = start_ssh(run_container, ssh_image, client_key)
    assert allowed_auth_types(port, "trainer") == ["publickey"]
    with pytest.raises(paramiko.AuthenticationException):
        ssh_connect(port, client_key, user="root", timeout=5)
    other = paramiko.ECDSAKey.generate(bits=256)
    with pytest.raises(paramiko.AuthenticationException):
        ssh_connect(port, other, timeout=5)
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    with pytest.raises((paramiko.AuthenticationException, paramiko.BadAuthenticationType)):
        client.connect(
            "127.0.0.1",
            port=port,
            username="trainer",
            password="trainer",
            allow_agent=False,
            look_for_keys=False,
            timeout=10,
        )


def test_public_key_variable_and_key_file(run_container, ssh_image, client_key, tmp_path):
    runpod_key = paramiko.ECDSAKey.generate(bits=256)
    file_key = paramiko.ECDSAKey.generate(bits=256)
    keys_file = tmp_path / "authorized_keys"
    keys_file.write_text(public_line(file_key) + "\n")
    keys_file.chmod(0o644)
    _, port = start_ssh(
        run_container,
        ssh_image,
        client_key,
        environment={"PUBLIC_KEY": public_line(runpod_key)},
        volumes={str(keys_file): {"bind": "/run/secrets/authorized_keys", "mode": "ro"}},
    )
    for key in (client_key, runpod_key, file_key):
        client = ssh_connect(port, key)
        assert ssh_run(client, "true")[0] == 0
        client.close()


def test_no_key_stops_with_a_clear_message(run_container, ssh_image):
    running = run_container(ssh_image, environment={"GPUFEED_ALLOW_CPU": "1"})
    assert running.wait_exit() != 0
    assert "no public key given" in running.logs()


def test_host_key_survives_restart_and_new_container(run_container, ssh_image, client_key, volume):
    volumes = {volume: {"bind": "/var/lib/gpufeed/ssh", "mode": "rw"}}
    running, port = start_ssh(run_container, ssh_image, client_key, volumes=volumes)
    first = host_key(port)
    running.container.restart(timeout=10)
    running.wait_healthy()
    assert host_key(running.host_port(PORT)) == first
    running.container.remove(force=True)
    _, port = start_ssh(run_container, ssh_image, client_key, volumes=volumes)
    assert host_key(port) == first
    # Without the volume each container makes its own: nothing came from the image.
    _, fresh_port = start_ssh(run_container, ssh_image, client_key)
    assert host_key(fresh_port) != first


def test_sshd_runs_as_the_user_under_tini(run_container, ssh_image, client_key):
    running, _ = start_ssh(run_container, ssh_image, client_key)
    assert running.exec("cat", "/proc/1/comm")[1].strip() == "tini"
    code, processes = running.exec("ps", "-o", "uid=,args=", "-C", "sshd")
    assert code == 0 and processes.strip(), processes
    assert all(line.split()[0] != "0" for line in processes.splitlines()), processes
