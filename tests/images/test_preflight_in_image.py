"""The preflight scenarios of tests/entrypoints, replayed against the preflight installed in the
built images (their sh, awk, df and thresholds file), with the same fake nvidia-smi."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

ENTRYPOINT_TESTS = Path(__file__).resolve().parents[1] / "entrypoints"
sys.path.insert(0, str(ENTRYPOINT_TESTS))

from imagetools import Running  # noqa: E402
from preflight_harness import SCENARIOS, Result, Sandbox, run_preflight  # noqa: E402

# The image's own environment is always there in a container (docker exec adds to it, and
# cannot unset CUDA_VERSION, say), so scenarios that point at another thresholds file or remove
# a variable cannot mean the same inside.
HOST_ONLY = {
    scenario.id
    for scenario in SCENARIOS
    if "GPUFEED_THRESHOLDS" in scenario.env_overrides
    or any(value is None for value in scenario.env_overrides.values())
}


@pytest.fixture(scope="module", params=["jupyter", "ssh"])
def preflight_container(request, module_container):
    image = request.getfixturevalue(f"{request.param}_image")
    root = Path(tempfile.mkdtemp(prefix="gpufeed-preflight-image-"))
    root.chmod(0o755)
    sandbox = Sandbox.create(root, shm_path=root)
    running = module_container(
        image,
        entrypoint=["sleep", "infinity"],
        command=[],
        volumes={
            str(root): {"bind": str(root), "mode": "ro"},
            str(ENTRYPOINT_TESTS): {"bind": str(ENTRYPOINT_TESTS), "mode": "ro"},
        },
    )
    return running, sandbox


@pytest.fixture(scope="module")
def module_container(docker_client):
    # Module-scoped twin of conftest's fixture: one container serves every scenario.
    started = []

    def run(image, **kwargs):
        container = docker_client.containers.run(
            image, detach=True, labels={"io.gpufeed.test": "1"}, **kwargs
        )
        started.append(container)
        return Running(container)

    yield run
    for container in started:
        container.remove(force=True)


def in_image_runner(container):
    def run(argv, env):
        env = {**env, "GPUFEED_THRESHOLDS": "/etc/gpufeed/thresholds.env"}
        result = container.exec_run(list(argv), environment=env, demux=True)
        stdout, stderr = result.output
        return Result(result.exit_code, (stdout or b"").decode(), (stderr or b"").decode())

    return run


@pytest.mark.parametrize(
    "scenario",
    [s for s in SCENARIOS if s.id not in HOST_ONLY and not s.needs_small_shm],
    ids=lambda s: s.id,
)
def test_scenario_in_image(preflight_container, scenario):
    running, sandbox = preflight_container
    result = run_preflight(
        scenario.env(sandbox),
        runner=in_image_runner(running.container),
        shell="/bin/sh",
        script="/usr/local/bin/preflight.sh",
    )
    scenario.check(result)
