"""torch.compile in both images, on the CPU: a small model compiles and trains (forward and
backward, mode="default") with the gradients of eager mode, and a second container on the same
cache volume reuses the first one's kernels, as compose's torch-cache volume (shared by the
jupyter, ssh and train services) makes it do.

The reuse is read from torch's own counters (Inductor's FX graph cache and AOTAutograd's cache:
hits and misses), never from timing; the compile times of both starts are printed as a ratio.
tests/gpu/compile_check.py is the same check `make smoke-gpu` runs on the GPU.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from imagetools import CPU_ENV, REPO

COMPOSE_FILES = ["-f", str(REPO / "compose.yaml"), "-f", str(REPO / "compose.cpu.yaml")]
COMPOSE_SERVICES = ("jupyter", "ssh", "train")


def image_env(docker_client, image: str) -> dict[str, str]:
    config = docker_client.images.get(image).attrs["Config"]
    return dict(item.split("=", 1) for item in config["Env"])


@pytest.fixture(scope="session")
def cache_mount() -> str:
    """Where compose mounts its torch-cache volume, the same in every service."""
    config = subprocess.run(
        ["docker", "compose", *COMPOSE_FILES, "--profile", "train", "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    services = json.loads(config.stdout)["services"]
    targets = {
        name: [v["target"] for v in services[name]["volumes"] if v.get("source") == "torch-cache"]
        for name in COMPOSE_SERVICES
    }
    assert all(len(t) == 1 for t in targets.values()), targets
    (mount,) = {t[0] for t in targets.values()}
    return mount


def compile_in_container(run_container, image: str, volume: str | None, mount: str) -> dict:
    volumes = {str(REPO): {"bind": "/src", "mode": "ro"}}
    if volume:
        volumes[volume] = {"bind": mount}
    running = run_container(
        image,
        command=["python", "tests/gpu/compile_check.py", "--device", "cpu"],
        environment={**CPU_ENV, "GPUFEED_PREFLIGHT_QUIET": "1"},
        working_dir="/src",
        volumes=volumes,
    )
    code = running.wait_exit(timeout=300)
    logs = running.logs()
    assert code == 0, logs
    lines = [line for line in logs.splitlines() if line.startswith("{")]
    assert lines, logs
    return json.loads(lines[-1])


def test_compile_in_both_images_and_the_cache_outlives_the_container(
    docker_client, run_container, volume, cache_mount, jupyter_image, ssh_image
):
    for image in (ssh_image, jupyter_image):
        env = image_env(docker_client, image)
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert env[variable].startswith(cache_mount + "/"), (image, variable, env[variable])

    # Each image compiles once for real: the SSH image into the cache volume, the Jupyter image
    # into its own layer (plain `docker run`, no volume: the folder is the user's too).
    cold = compile_in_container(run_container, ssh_image, volume, cache_mount)
    cold_jupyter = compile_in_container(run_container, jupyter_image, None, cache_mount)
    # A second container on the volume (another service, as compose shares it) compiles nothing.
    warm = compile_in_container(run_container, jupyter_image, volume, cache_mount)

    for result in (cold, cold_jupyter, warm):
        assert result["loss_difference"] < result["tolerance"], result
        assert result["grad_difference"] < result["tolerance"], result
        assert result["cache_dir"] == image_env(docker_client, ssh_image)["TORCHINDUCTOR_CACHE_DIR"]
    for result in (cold, cold_jupyter):  # forward and backward graphs compiled, nothing found
        assert result["cache"]["fxgraph_miss"] >= 2 and result["cache"]["fxgraph_hit"] == 0, result
        assert result["cache"]["aotautograd_miss"] >= 1, result
        assert result["cache"]["aotautograd_hit"] == 0, result
    # every graph from the cache: hits, and not one miss
    assert warm["cache"]["fxgraph_hit"] >= 2 and warm["cache"]["fxgraph_miss"] == 0, warm
    assert warm["cache"]["aotautograd_hit"] >= 1 and warm["cache"]["aotautograd_miss"] == 0, warm
    seconds = [r["first_compiled_step_s"] for r in (cold, cold_jupyter, warm)]
    print(
        f"first compiled step: {seconds[0]:.1f} s (ssh) and {seconds[1]:.1f} s (jupyter) "
        f"compiling, {seconds[2]:.1f} s from the cache: {seconds[1] / seconds[2]:.1f}x faster; "
        f"compiled step {cold['speedup']:.2f}x / {cold_jupyter['speedup']:.2f}x eager"
    )


def test_tensorboard_writer_and_reader_in_the_ssh_image(run_container, ssh_image):
    # torch.utils.tensorboard writes an event file; TensorBoard's own reader reads it back.
    code = (
        "from torch.utils.tensorboard import SummaryWriter\n"
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
        "w = SummaryWriter('/tmp/runs/probe')\n"
        "for step in range(3): w.add_scalar('loss', 1.0 / (step + 1), step)\n"
        "w.close()\n"
        "acc = EventAccumulator('/tmp/runs/probe'); acc.Reload()\n"
        "print('scalars', [round(e.value, 3) for e in acc.Scalars('loss')])\n"
    )
    running = run_container(
        ssh_image,
        command=["python", "-c", code],
        environment={**CPU_ENV, "GPUFEED_PREFLIGHT_QUIET": "1"},
    )
    assert running.wait_exit(timeout=120) == 0, running.logs()
    assert "scalars [1.0, 0.5, 0.333]" in running.logs(), running.logs()
