"""One source of truth for the worker plan: make_loader, gpufeed tune, gpufeed.watch and gpufeed
doctor give the same answer about workers (it was: tune picked 0, watch on that loader said
"try num_workers=2", doctor said "loaders plan 2 worker(s)")."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed.loading.cpu_budget import worker_count_for, worker_outlook
from gpufeed.loading.make import make_loader
from gpufeed.loading.plan import clear_plan_cache
from gpufeed.loading.settings import SETTINGS_ENV
from gpufeed.tools import tune
from gpufeed.tools.doctor.report import WARN


class CheapDataset(Dataset):
    """Samples cost nothing: worker IPC can only lose, so make_loader keeps them in-process."""

    def __init__(self):
        self.data = torch.zeros(20000, 16, dtype=torch.uint8)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], 0

    def get_batch(self, idx):
        return gpufeed.Batch(self.data[idx], torch.zeros(len(idx), dtype=torch.int64))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    clear_plan_cache()
    yield
    clear_plan_cache()


def advice_on(loader) -> list[str]:
    w = gpufeed.watch(loader, progress=False, report=False, gpu=False)
    for n, _ in enumerate(w):  # no step at all: the loop only waits for data
        if n == 30:
            break
    return w.summary().advice


def cpu_check():
    report = gpufeed.diagnose(check_dataset=False, environ={**os.environ, "GPUFEED_ALLOW_CPU": "1"})
    return report.by_name("cpus")


def test_watch_and_doctor_say_what_make_loader_measured():
    loader = make_loader(CheapDataset(), 64, probe_budget_s=1.0)
    outlook = worker_outlook()
    assert loader.plan.num_workers == 0, loader.plan  # cheap samples: in-process wins
    # the count make_loader measured against is the one doctor and watch talk about
    assert f"workers{outlook.candidate}_batches_per_s" in " ".join(loader.plan.measured)
    advice = advice_on(loader)
    assert not any("try num_workers=" in a for a in advice), advice
    assert any("kept it in-process" in a for a in advice), advice
    cpus = cpu_check()
    assert cpus.data["workers"] == outlook.candidate == worker_count_for(loader.plan.cpus)
    assert "make_loader measures in-process loading against" in cpus.message
    assert cpus.data["worker_plan"]["cpus"] == loader.plan.cpus


@pytest.mark.slow
def test_tune_settings_are_what_make_loader_watch_and_doctor_use(tmp_path, monkeypatch):
    result = tune.tune(CheapDataset(), batch_size=64, budget_s=2.0, batch_sizes=[64])
    path = tune.write_settings(result, tmp_path / "loader.json")
    chosen = json.loads(path.read_text())["num_workers"]
    monkeypatch.setenv(SETTINGS_ENV, str(path))
    loader = make_loader(CheapDataset(), 64)  # reads the file from the environment
    assert loader.plan.num_workers == chosen and "num_workers" in loader.plan.from_settings
    cpus = cpu_check()
    assert cpus.data["workers"] == chosen
    assert f"make_loader uses num_workers={chosen} (from {SETTINGS_ENV}=" in cpus.message
    advice = advice_on(loader)
    assert not any("try num_workers=" in a or "raise num_workers" in a for a in advice), advice
    if chosen == 0:
        assert any("comes from the loader settings" in a for a in advice), advice


def test_an_unreadable_settings_file_is_a_doctor_warning(tmp_path, monkeypatch):
    bad = tmp_path / "loader.json"
    bad.write_text("{not json")
    monkeypatch.setenv(SETTINGS_ENV, str(bad))
    report = gpufeed.diagnose(check_dataset=False, environ={**os.environ, "GPUFEED_ALLOW_CPU": "1"})
    check = report.by_name("loader_settings")
    assert check.status == WARN and "not valid JSON" in check.message
    with pytest.raises(ValueError, match="not valid JSON"):
        make_loader(CheapDataset(), 64)  # make_loader says the same


def test_local_world_size_divides_the_cpus_everywhere(monkeypatch):
    from gpufeed.system import sysinfo

    monkeypatch.setattr(sysinfo, "usable_cpus", lambda *a: sysinfo.CpuBudget(8, None, 8, "test"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    outlook = worker_outlook()
    assert (outlook.cpus, outlook.candidate) == (4, 3)
    loader = make_loader(CheapDataset(), 64, num_workers=0)
    assert loader.plan.cpus == 4
