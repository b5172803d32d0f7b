"""gpufeed tune: the search climbs to workers where they pay off, stays in-process where
they do not, and writes a settings file make_loader applies."""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed import cli, tune


class SleepyDataset(Dataset):
    """Each sample waits 3 ms without using the CPU (a slow disk or network): workers pay."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.zeros(4, dtype=torch.uint8), i % 3


class CheapDataset(Dataset):
    """Samples cost nothing: worker IPC can only lose."""

    def __init__(self):
        self.data = torch.zeros(20000, 4, dtype=torch.uint8)

    def __len__(self):
        return len(self.data)

    def __getitems__(self, idx):
        return gpufeed.Batch(self.data[idx], torch.zeros(len(idx), dtype=torch.int64))


def test_tune_climbs_to_workers_for_io_bound_samples():
    result = tune.tune(
        SleepyDataset(), batch_size=16, budget_s=3, batch_sizes=[16], cpus=2, compare=False
    )
    stages = [t.stage for t in result.trials]
    assert stages[:2] == ["in-process", "workers"]
    assert result.best.settings["num_workers"] >= 2
    single = result.trials[0].samples_per_s
    assert result.best.samples_per_s > 1.5 * single


def test_tune_keeps_cheap_samples_in_process_and_compares():
    result = tune.tune(CheapDataset(), batch_size=256, budget_s=2.5, batch_sizes=[256], cpus=2)
    assert result.best.settings["num_workers"] == 0
    assert set(result.comparison) == {"tuned", "defaults", "1x_cores", "2x_cores"}
    assert result.ratios()["2x_cores"] > 1.0


def test_tune_keeps_to_its_budget_with_worker_start_up():
    # every trial pays worker start-up and shutdown; the budget has to hold them too
    t = time.perf_counter()
    result = tune.tune(SleepyDataset(), batch_size=16, budget_s=4, cpus=2)
    took = time.perf_counter() - t
    assert took <= 4.4, f"tune took {took:.2f} s for a 4 s budget"
    assert set(result.comparison) == {"tuned", "defaults", "1x_cores", "2x_cores"}


def test_tune_command_writes_settings_make_loader_reads(tmp_path, array_folder, capsys):
    dest = tmp_path / "pack"
    gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    out = tmp_path / "loader.json"
    code = cli.main(
        [
            "tune",
            str(dest),
            "-b",
            "4",
            "--batch-sizes",
            "4",
            "--budget",
            "1",
            "--no-compare",
            "--write",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "make_loader(dataset, batch_size=4" in printed and str(out) in printed
    saved = json.loads(out.read_text())
    assert saved["_batch_size"] == 4 and "num_workers" in saved
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, settings=out)
    assert loader.plan.num_workers == saved["num_workers"]
    assert "num_workers" in loader.plan.from_settings
    assert sum(len(b.labels) for b in loader) == 17


def test_snippet_is_valid_python():
    best = tune.Trial({"num_workers": 3, "prefetch_factor": 4}, 128, 1.0, 0.1, "prefetch")
    result = tune.TuneResult(best=best, trials=[best], cpus=2, seconds=1.0)
    code = tune.snippet(result, "/data/pack", "loader.json")
    compile(code, "<snippet>", "exec")
    assert "num_workers=3, prefetch_factor=4" in code
    assert np.isclose(result.file_content()["measured"]["samples_per_s"], 1.0)
