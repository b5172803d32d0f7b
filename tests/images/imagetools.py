"""Helpers shared by the image tests (SSH logins, free ports)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

import docker.models.containers
import paramiko

REPO = Path(__file__).resolve().parents[2]
# A container on a host without a GPU (every image test): the preflight accepts a missing driver.
CPU_ENV = {"GPUFEED_ALLOW_CPU": "1"}


def public_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()} gpufeed-test"


def free_port() -> int:
    """A free loopback port, for compose files that take the port as a setting."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ssh_connect(
    port: int, key: paramiko.PKey, *, user: str = "trainer", timeout: float = 30
) -> paramiko.SSHClient:
    """Log in with a key, retrying while the server is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            client.connect(
                "127.0.0.1",
                port=port,
                username=user,
                pkey=key,
                timeout=5,
                allow_agent=False,
                look_for_keys=False,
            )
            return client
        except (paramiko.ssh_exception.NoValidConnectionsError, paramiko.SSHException, OSError):
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def ssh_run(client: paramiko.SSHClient, command: str, timeout: float = 120) -> tuple[int, str]:
    _, stdout, stderr = client.exec_command(command, timeout=timeout)
    output = stdout.read().decode() + stderr.read().decode()
    return stdout.channel.recv_exit_status(), output


@dataclass
class Running:
    """A started container and the host ports Docker published for it."""

    container: docker.models.containers.Container

    def host_port(self, container_port: str) -> int:
        self.container.reload()
        bindings = self.container.attrs["NetworkSettings"]["Ports"][container_port]
        return int(bindings[0]["HostPort"])

    def logs(self) -> str:
        return self.container.logs().decode(errors="replace")

    def exec(self, *command: str, user: str | None = None) -> tuple[int, str]:
        result = self.container.exec_run(list(command), user=user or "")
        return result.exit_code, result.output.decode(errors="replace")

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.container.reload()
            state = self.container.attrs["State"]
            if state["Status"] == "exited":
                raise AssertionError(f"container exited ({state['ExitCode']}):\n{self.logs()}")
            if state.get("Health", {}).get("Status") == "healthy":
                return
            time.sleep(0.5)
        raise AssertionError(f"not healthy after {timeout} s:\n{self.logs()}")

    def wait_exit(self, timeout: float = 60) -> int:
        return int(self.container.wait(timeout=timeout)["StatusCode"])
