"""Helpers for the torchrun tests: a small learnable gpufeed pack, the compose `train` service
run with the CPU override, and reading the per-rank sample logs train_ddp.py writes."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from imagetools import REPO

COMPOSE_FILES = ["-f", str(REPO / "compose.yaml"), "-f", str(REPO / "compose.cpu.yaml")]
EXAMPLE = "/opt/gpufeed/examples/train_ddp.py"
# The tree's examples over the image's copy (read-only, as docker-stacks mounts its test
# scripts): the image bakes them in, but an edit to an example should not need a rebuild to
# be tested. test_train_ddp checks the image ships the same file.
EXAMPLES_MOUNT = f"{REPO / 'app' / 'examples'}:/opt/gpufeed/examples:ro"
CLASSES, PER_CLASS, SHAPE = 4, 40, (3, 8, 8)
SAMPLES = CLASSES * PER_CLASS


def make_pack(root: Path) -> Path:
    """160 distinct uint8 [3, 8, 8] arrays in 4 classes (a class pattern plus noise), packed as
    HDF5 into root/dataset/pack; root/dataset is what the service mounts at /data."""
    import gpufeed

    rng = np.random.default_rng(7)
    patterns = rng.random((CLASSES, *SHAPE)) * 120
    for c in range(CLASSES):
        folder = root / "src" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(PER_CLASS):
            arr = (patterns[c] + rng.random(SHAPE) * 135).astype(np.uint8)
            np.save(folder / f"{i:03d}.npy", arr)
    dataset = root / "dataset"
    gpufeed.pack(root / "src", dataset / "pack", "hdf5", quiet=True, workers=1)
    for path in [dataset, *dataset.rglob("*")]:  # the container runs as uid 1000
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dataset


@contextmanager
def train_project(dataset: Path, ssh_image: str) -> Iterator:
    """``compose(*args)`` for one compose project (unique name), taken down with its volumes."""
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": f"gpufeed-test-{uuid.uuid4().hex[:8]}",
        "SSH_IMAGE": ssh_image,
        "DATASET_DIR": str(dataset),
    }

    def compose(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", "compose", *COMPOSE_FILES, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    compose.project = env["COMPOSE_PROJECT_NAME"]
    try:
        yield compose
    finally:
        compose("down", "--volumes", "--remove-orphans", "--timeout", "5")


def writable(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    return path


def read_log(folder: Path) -> dict[int, list[dict]]:
    """rank -> the rows train_ddp.py logged, one per step, in order."""
    logs = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        logs[int(path.stem.removeprefix("rank"))] = rows
    return logs


def by_epoch(rows: list[dict]) -> dict[int, list[str]]:
    """epoch -> the sample digests one rank trained on, in order."""
    out: dict[int, list[str]] = {}
    for row in rows:
        out.setdefault(row["epoch"], []).extend(row["samples"])
    return out


def mean_loss(rows: list[dict], epoch: int) -> float:
    losses = [r["loss"] for r in rows if r["epoch"] == epoch]
    return sum(losses) / len(losses)
