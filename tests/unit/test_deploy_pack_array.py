"""deploy/slurm/pack-array.sbatch run as Slurm would, without Slurm: each array task's step
with SLURM_ARRAY_TASK_ID set (bash, no sbatch), then the merge step; the pack holds every
listed sample once, in the list's order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gpufeed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "pack-array.sbatch"


def run_step(env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {**env, "GPUFEED": f"{sys.executable} -m gpufeed", "FORMAT": "tar", **extra}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_array_tasks_pack_their_slices_and_the_last_step_merges(tmp_path, python_env, make_images):
    paths = make_images(tmp_path / "imgs", {"a": 4, "b": 3})
    lines = [f"{os.path.relpath(p, tmp_path)} {k % 2}" for k, p in enumerate(sorted(paths))]
    listfile = tmp_path / "list.txt"
    listfile.write_text("# images\n" + "\n".join(lines) + "\n")
    out = tmp_path / "out" / "pack"
    for task in range(3):
        run = run_step(
            python_env, str(listfile), str(out), SLURM_ARRAY_TASK_ID=str(task), TASKS="3"
        )
        assert run.returncode == 0, run.stderr
    counts = [
        len(gpufeed.open_dataset(out.with_name("pack.parts") / f"part-{k:06d}")) for k in range(3)
    ]
    assert counts == [3, 3, 1]
    run = run_step(python_env, str(listfile), str(out), STEP="merge", SLURM_ARRAY_TASK_COUNT="3")
    assert run.returncode == 0, run.stderr
    ds = gpufeed.open_dataset(out)
    assert len(ds) == 7
    assert ds.reader.sources() == [str(tmp_path / line.rsplit(" ", 1)[0]) for line in lines]
    assert [int(ds[i][1]) for i in range(7)] == [k % 2 for k in range(7)]
