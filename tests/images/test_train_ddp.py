"""examples/train_ddp.py under torchrun (2 processes, gloo) in the built image, through the
compose `train` service with compose.cpu.yaml, as a user runs it: the loss falls, every sample
is trained on once per epoch across the ranks, and a run killed mid-epoch resumes from its
checkpoint with no sample repeated or lost (and the very same losses as a run never killed).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from imagetools import REPO
from trainrun import (
    EXAMPLE,
    EXAMPLES_MOUNT,
    SAMPLES,
    by_epoch,
    make_pack,
    mean_loss,
    read_log,
    train_project,
)
from trainrun import writable as make_writable

EPOCHS, BATCH, EVERY = 3, 8, 4
STEPS_PER_EPOCH = SAMPLES // 2 // BATCH  # 10: 80 samples per rank
CRASH_AT = 15  # epoch 1, step 5 of 10; the last checkpoint before it is step 12


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ssh_image):
    """Runs of one job in one compose project: A uninterrupted; B with its last rank SIGKILLed
    after step 15; C the same command as B again, resuming from B's checkpoint; D killed the
    same way under torchrun --max-restarts 1."""
    root = tmp_path_factory.mktemp("train_ddp")
    dataset = make_pack(root)
    out = make_writable(root / "out")
    results = {}
    with train_project(dataset, ssh_image) as compose:

        def train(checkpoint: str, log: str, *extra: str, env: tuple[str, ...] = ()):
            args = [
                "--data", "/data/pack", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
                "--lr", "0.05", "--workers", "1", "--checkpoint-every", str(EVERY),
                "--checkpoint", f"/out/{checkpoint}", "--sample-log", f"/out/{log}",
            ]  # fmt: skip
            mounts = ["-v", f"{out}:/out", "-v", EXAMPLES_MOUNT]
            options = [item for e in env for item in ("-e", e)]
            return compose(
                "run", "--rm", "-T", *mounts, *options, "train", EXAMPLE, *args, *extra
            )  # fmt: skip

        results["A"] = train("a.pt", "a")
        results["B"] = train("b.pt", "b", "--crash-at-step", str(CRASH_AT))
        results["C"] = train("b.pt", "c")
        # D: the same kill under torchrun --max-restarts 1: torchrun restarts both workers,
        # and they resume from the checkpoint by themselves, in one run
        crash = ("--crash-at-step", str(CRASH_AT))
        results["D"] = train("d.pt", "d", *crash, env=("PET_MAX_RESTARTS=1",))
    for name in ("A", "C", "D"):
        proc = results[name]
        assert proc.returncode == 0, f"run {name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return {name: read_log(out / name.lower()) for name in "ABCD"} | {"procs": results}


def test_runs_two_ranks_on_gloo_under_torchrun(runs):
    out = runs["procs"]["A"].stdout
    assert f"world 2 on cpu (gloo), {SAMPLES} samples, {STEPS_PER_EPOCH} steps/epoch/rank" in out
    assert set(runs["A"]) == {0, 1}


def test_loss_decreases(runs):
    rows = runs["A"][0]
    first, last = mean_loss(rows, 0), mean_loss(rows, EPOCHS - 1)
    print(f"mean loss epoch 0 {first:.4f} -> epoch {EPOCHS - 1} {last:.4f}")
    assert last < 0.8 * first, (first, last)


def test_every_sample_once_per_epoch_across_ranks(runs):
    per_rank = {rank: by_epoch(rows) for rank, rows in runs["A"].items()}
    for epoch in range(EPOCHS):
        seen = per_rank[0][epoch] + per_rank[1][epoch]
        assert len(per_rank[0][epoch]) == len(per_rank[1][epoch]) == SAMPLES // 2
        counts = Counter(seen)
        assert len(counts) == SAMPLES and set(counts.values()) == {1}, epoch
    assert set(per_rank[0][0] + per_rank[1][0]) == set(per_rank[0][1] + per_rank[1][1])
    assert per_rank[0][0] != per_rank[0][1]  # a new order (and split) each epoch


def test_killed_mid_epoch_then_resumes_with_no_sample_repeated_or_lost(runs):
    crashed, resumed = runs["procs"]["B"], runs["procs"]["C"]
    assert crashed.returncode != 0
    assert "Signal 9 (SIGKILL)" in crashed.stdout + crashed.stderr
    match = re.search(r"resumed at step (\d+) \(epoch (\d+)\)", resumed.stdout)
    assert match, resumed.stdout
    ckpt_step, ckpt_epoch = int(match[1]), int(match[2])
    assert (ckpt_step, ckpt_epoch) == (12, 1)  # mid-epoch: 2 of epoch 1's 10 steps were saved

    committed = {}
    for rank in (0, 1):
        before, after = runs["B"][rank], runs["C"][rank]
        # B ran past its checkpoint before it died: those steps were not saved and are redone
        assert max(r["step"] for r in before) > ckpt_step
        assert after[0]["step"] == ckpt_step + 1 and after[0]["epoch"] == ckpt_epoch
        committed[rank] = [r for r in before if r["step"] <= ckpt_step] + after
        steps = [r["step"] for r in committed[rank]]
        assert steps == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
        # the same samples in the same order as the run never killed, and the same losses
        reference = runs["A"][rank]
        assert by_epoch(committed[rank]) == by_epoch(reference)
        for got, want in zip(committed[rank], reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), got["step"]
    for epoch in range(EPOCHS):
        seen = by_epoch(committed[0])[epoch] + by_epoch(committed[1])[epoch]
        assert len(seen) == len(set(seen)) == SAMPLES, epoch


def test_the_image_ships_the_example(docker_client, ssh_image):
    shipped = docker_client.containers.run(ssh_image, entrypoint=["cat", EXAMPLE], remove=True)
    assert shipped == (REPO / "app" / "examples" / "train_ddp.py").read_bytes()


def test_torchrun_restart_resumes_by_itself(runs):
    """Under --max-restarts the agent restarts the workers (TORCHELASTIC_RESTART_COUNT 1) and
    they pick up the checkpoint: the kept steps are again exactly the uninterrupted run's."""
    for rank in (0, 1):
        rows = runs["D"][rank]
        first = [r for r in rows if r["attempt"] == 0]
        second = [r for r in rows if r["attempt"] == 1]
        assert second and second[0]["step"] == 13, rows[:1]
        kept = [r for r in first if r["step"] <= 12] + second
        assert by_epoch(kept) == by_epoch(runs["A"][rank])
        assert [r["step"] for r in kept] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
