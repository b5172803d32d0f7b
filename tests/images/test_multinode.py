"""Two containers of the compose `train` service on one compose network as two "nodes", one
torchrun job across them (c10d rendezvous, one process per node, gloo): the multi-node path
the Kubernetes and Slurm recipes take, end to end."""

from __future__ import annotations

import subprocess
import tempfile
from collections import Counter
from pathlib import Path

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


HOOKS = Path(__file__).parent / "hooks"
LATE = 8  # seconds: far longer than a trainer takes to exit, so rank 0's is gone by then


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_pack(tmp_path_factory.mktemp("multinode"))


@pytest.fixture(scope="module")
def job(dataset, ssh_image):
    return run_job(dataset, ssh_image, epochs=EPOCHS)


@pytest.fixture(scope="module")
def late_job(dataset, ssh_image):
    """The same job, whose last rank reaches its end LATE seconds after rank 0's trainer has
    exited, and then asks the workers' store once more (tests/images/hooks/sitecustomize.py)."""
    hook = ["-v", f"{HOOKS}:/opt/gpufeed-test-hooks:ro", "-e", "PYTHONPATH=/opt/gpufeed-test-hooks"]
    return run_job(
        dataset, ssh_image, epochs=1, extra=(*hook, "-e", f"GPUFEED_TEST_LAST_RANK_LATE={LATE}")
    )


def run_job(dataset: Path, ssh_image: str, epochs: int, extra: tuple[str, ...] = ()) -> dict:
    """One torchrun job across two containers; both must exit 0."""
    root = dataset.parent
    out = writable(Path(tempfile.mkdtemp(dir=root)))
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
                    "-e", f"PET_RDZV_CONF=is_host={'true' if i == 0 else 'false'}", *extra,
                    "train", EXAMPLE, "--data", "/data/pack", "--epochs", str(epochs),
                    "--batch-size", "8", "--workers", "0", "--checkpoint", "/out/ckpt.pt",
                    "--sample-log", "/out/log",
                )  # fmt: skip
                assert up.returncode == 0, up.stderr
            codes = [_wait(name) for name in names]
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
    kept = [out / f"node{i}.log" for i in range(len(names))]
    for path, log in zip(kept, logs, strict=True):
        path.write_text(log)
    assert codes == ["0", "0"], "\n\n".join(
        f"node{i}: exit {code} ({state}); whole log: {path}\n{log[-3000:]}"
        for i, (code, state, path, log) in enumerate(zip(codes, states, kept, logs, strict=True))
    )
    return {"logs": logs, "ranks": read_log(out / "log"), "out": out}


def _wait(name: str, timeout: float = 180) -> str:
    """The container's exit code, or "timeout" (a hung node is a failure with logs too)."""
    try:
        done = subprocess.run(
            ["docker", "wait", name], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return done.stdout.strip()


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


def test_a_rank_that_ends_late_still_reaches_the_store(late_job):
    """The end-of-job race: the ranks' store lives in rank 0's trainer (the recipes set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for restarts), so a rank that asks it after rank 0's
    trainer has exited gets "Did the remote server shutdown or crash?" or hangs. train_ddp.py's
    exit handshake keeps rank 0 until every rank is done with the store."""
    node_logs = "\n".join(late_job["logs"])
    assert f"late rank 1: the store answered {LATE} s after" in node_logs, node_logs[-3000:]
