"""Fixtures for tests against real containers of the built images.

As jupyter/docker-stacks does: each test gets its own container, always removed; host ports are
picked by Docker (never hard-coded); health is polled with a deadline. The images are named by
JUPYTER_IMAGE and SSH_IMAGE (`make test-images` builds them and sets both).
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Callable, Iterator

import docker.errors
import pytest
from imagetools import CPU_ENV, Running

import docker


def _image_name(variable: str) -> str:
    name = os.environ.get(variable)
    if not name:
        pytest.fail(
            f"{variable} is not set: run `make test-images`, which builds and names the images"
        )
    return name


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as error:
        pytest.fail(f"no Docker engine answers ({error}); start one (.ci/setup-docker.sh does)")
    yield client
    client.close()


@pytest.fixture(scope="session")
def jupyter_image(docker_client: docker.DockerClient) -> str:
    name = _image_name("JUPYTER_IMAGE")
    docker_client.images.get(name)
    return name


@pytest.fixture(scope="session")
def ssh_image(docker_client: docker.DockerClient) -> str:
    name = _image_name("SSH_IMAGE")
    docker_client.images.get(name)
    return name


@pytest.fixture
def run_container(docker_client: docker.DockerClient) -> Iterator[Callable[..., Running]]:
    """Start containers for one test; every one is removed afterwards, pass or fail."""
    started = []

    def run(image: str, *, ports: tuple[str, ...] = (), **kwargs) -> Running:
        kwargs.setdefault("environment", dict(CPU_ENV))
        container = docker_client.containers.run(
            image,
            detach=True,
            ports={port: ("127.0.0.1", None) for port in ports},
            name=f"gpufeed-test-{uuid.uuid4().hex[:10]}",
            labels={"io.gpufeed.test": "1"},
            **kwargs,
        )
        started.append(container)
        return Running(container)

    yield run
    for container in started:
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass


@pytest.fixture
def volume(docker_client: docker.DockerClient) -> Iterator[str]:
    """A named volume for one test, removed afterwards with the containers that use it."""
    name = f"gpufeed-test-{uuid.uuid4().hex[:10]}"
    docker_client.volumes.create(name, labels={"io.gpufeed.test": "1"})
    yield name
    for container in docker_client.containers.list(all=True, filters={"volume": name}):
        container.remove(force=True)
    docker_client.volumes.get(name).remove(force=True)


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="session")
def client_key():
    import paramiko

    return paramiko.ECDSAKey.generate(bits=256)
