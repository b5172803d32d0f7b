"""Two containers of the compose `train` service on one compose network as two "nodes", one
torchrun job across them (c10d rendezvous, one process per node, gloo): the multi-node path
the Kubernetes and Slurm recipes take, end to end."""

from __future__ import annotations

import subprocess
from collections import Counter

import pytest
from trainrun import (
    EXAMPLE,
    EXAMPLES_MOUNT,
    SAMPLES,
    by_epoch,
    make_pack,
    read_log,
    train_project,
    writable,
)

EPOCHS = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory, ssh_image):
    root = tmp_path_factory.mktemp("multinode")
    dataset = make_pack(root)
    out = writable(root / "out")
    with train_project(dataset, ssh_image) as compose:
        names = [f"{compose.project}-node{i}" for i in range(2)]
        endpoint = f"{names[0]}:29400"
        try:
            for i, name in enumerate(names):
                # node0 hosts the rendezvous store: its container name, which the endpoint
                # uses, is not its hostname, so torchrun is told (as the k8s recipe does)
                up = compose(
                    "run", "--detach", "--name", name, "-v", f"{out}:/out", "-v", EXAMPLES_MOUNT,
                    "-e", "PET_NNODES=2", "-e", "PET_NPROC_PER_NODE=1",
                    "-e", f"PET_RDZV_ENDPOINT={endpoint}", "-e", f"PET_RDZV_ID={compose.project}",
                    "-e", f"PET_RDZV_CONF=is_host={'true' if i == 0 else 'false'}",
                    "train", EXAMPLE, "--data", "/data/pack", "--epochs", str(EPOCHS),
                    "--batch-size", "8", "--workers", "0", "--checkpoint", "/out/ckpt.pt",
                    "--sample-log", "/out/log",
                )  # fmt: skip
                assert up.returncode == 0, up.stderr
            codes = [
                subprocess.run(
                    ["docker", "wait", name], capture_output=True, text=True, timeout=180
                ).stdout.strip()
                for name in names
            ]
            logs = [
                subprocess.run(
                    ["docker", "logs", "--timestamps", name],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                ).stdout.decode(errors="replace")
                for name in names
            ]
            states = [_state(name) for name in names]
        finally:
            subprocess.run(["docker", "rm", "--force", *names], capture_output=True)
    # a failure keeps both nodes' whole logs (a rank's abort is rarely in the last lines)
    kept = [root / f"node{i}.log" for i in range(len(names))]
    for path, log in zip(kept, logs, strict=True):
        path.write_text(log)
    assert codes == ["0", "0"], "\n\n".join(
        f"node{i}: exit {code} ({state}); whole log: {path}\n{log[-3000:]}"
        for i, (code, state, path, log) in enumerate(zip(codes, states, kept, logs, strict=True))
    )
    return {"logs": logs, "ranks": read_log(out / "log"), "out": out}


def _state(name: str) -> str:
    """The container's end as Docker saw it (an OOM kill reads like a crash otherwise)."""
    return subprocess.run(
        ["docker", "inspect", "-f", "OOMKilled={{.State.OOMKilled}} {{.State.Error}}", name],
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_one_job_of_world_two_across_two_containers(job):
    assert any("world 2 on cpu (gloo)" in log for log in job["logs"]), job["logs"]
    ranks = job["ranks"]
    assert set(ranks) == {0, 1}
    hosts = {rank: {row["host"] for row in rows} for rank, rows in ranks.items()}
    assert len(hosts[0]) == len(hosts[1]) == 1 and hosts[0] != hosts[1], hosts


def test_every_sample_once_per_epoch_across_nodes(job):
    per_rank = {rank: by_epoch(rows) for rank, rows in job["ranks"].items()}
    for epoch in range(EPOCHS):
        counts = Counter(per_rank[0][epoch] + per_rank[1][epoch])
        assert len(counts) == SAMPLES and set(counts.values()) == {1}, epoch


def test_checkpoint_on_the_shared_volume(job):
    assert (job["out"] / "ckpt.pt").stat().st_size > 0
