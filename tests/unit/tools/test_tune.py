"""gpufeed tune: the search climbs to workers where they pay off, stays in-process where
they do not, and writes a settings file make_loader applies."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed import cli
from gpufeed.tools import tune, tune_compare, tune_result


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

    def get_batch(self, idx):
        return gpufeed.Batch(self.data[idx], torch.zeros(len(idx), dtype=torch.int64))


@pytest.mark.slow
def test_tune_climbs_to_workers_for_io_bound_samples():
    # 6 s: on a loaded machine a worker's start-up is estimated long, and with 3 s the trial of
    # 2 workers did not fit the budget (best stayed at 1 worker: flaky under load)
    result = tune.tune(
        SleepyDataset(), batch_size=16, budget_s=6, batch_sizes=[16], cpus=2, compare=False
    )
    stages = [t.stage for t in result.trials]
    assert stages[:2] == ["in-process", "workers"]
    assert result.best.settings["num_workers"] >= 2
    single = result.trials[0].samples_per_s
    assert result.best.samples_per_s > 1.5 * single


@pytest.mark.slow
def test_tune_keeps_cheap_samples_in_process_and_compares():
    result = tune.tune(CheapDataset(), batch_size=256, budget_s=2.5, batch_sizes=[256], cpus=2)
    assert result.best.settings["num_workers"] == 0
    assert set(result.comparison) == {"tuned", "defaults", "1x_cores", "2x_cores"}
    assert result.ratios()["2x_cores"] > 1.0


@pytest.mark.slow
def test_tune_keeps_to_its_budget_with_worker_start_up():
    # every trial pays worker start-up and shutdown; the budget has to hold them too
    t = time.perf_counter()
    result = tune.tune(SleepyDataset(), batch_size=16, budget_s=4, cpus=2)
    took = time.perf_counter() - t
    # the budget holds every start-up it has measured; what runs whatever the budget (on a
    # loaded machine, make_loader's probe alone can take half of 4 s) and one trial's start-up
    # beyond what was measured before it can run past it
    allowed = max(4, result.minimum_s) + result.overhead_miss_s + 0.1
    assert took <= allowed, f"tune took {took:.2f} s for a 4 s budget (allowed {allowed:.2f})"
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
    best = tune_result.Trial({"num_workers": 3, "prefetch_factor": 4}, 128, 1.0, 0.1, "prefetch")
    result = tune_result.TuneResult(best=best, trials=[best], cpus=2, seconds=1.0)
    code = tune_result.snippet(result, "/data/pack", "loader.json")
    compile(code, "<snippet>", "exec")
    assert "num_workers=3, prefetch_factor=4" in code
    assert np.isclose(result.file_content()["measured"]["samples_per_s"], 1.0)


class _StubCosts(tune_compare.TrialCosts):
    """Side-by-side readings by worker count, as a shared machine might give them."""

    def __init__(self, rates):
        super().__init__()
        self.rates = rates
        self.sizes: dict[int, set[int]] = {}

    def measure(self, dataset, bs, settings, seconds, to_device=None):
        nw = int(settings.get("num_workers", 0) or 0)
        self.sizes.setdefault(nw, set()).add(bs)
        return self.rates[nw], 0.01


def _checked(rates, tuned_workers, tuned_bs=256):
    searched = {"num_workers": tuned_workers, "prefetch_factor": 8, "block_size": 1024}
    best = tune_result.Trial(searched, tuned_bs, 1, 0.1, "x")
    result = tune_result.TuneResult(best=best, trials=[best], cpus=2, seconds=0.0)
    costs = _StubCosts(rates)
    tune_compare.compare_side_by_side(
        CheapDataset(), result, time.perf_counter() + 1, None, lambda s: None, costs, 1.05, 256
    )
    result.sizes = costs.sizes
    return result


def test_side_by_side_check_keeps_the_defaults_unless_beaten_by_min_gain():
    # the defaults pick in-process on CheapDataset; the search's 4 workers read 3% faster
    result = _checked({0: 100.0, 2: 90.0, 4: 103.0}, tuned_workers=4)
    assert result.chosen == "defaults" and result.best.settings == {"num_workers": 0}
    assert result.searched.settings["num_workers"] == 4
    assert result.ratios() == {"tuned": 100 / 103, "1x_cores": 100 / 90, "2x_cores": 100 / 103}
    # 20% faster: the search's choice stands
    result = _checked({0: 100.0, 2: 90.0, 4: 120.0}, tuned_workers=4)
    assert result.chosen == "tuned" and result.best.settings["prefetch_factor"] == 8
    assert result.searched is None and result.ratios()["defaults"] == 1.2
    # the 1x cores rule measured fastest by far: it is the recommendation
    result = _checked({0: 100.0, 2: 150.0, 4: 120.0}, tuned_workers=4)
    assert result.chosen == "1x_cores"
    assert result.best.settings == {"num_workers": 2, "prefetch_factor": 2}


def test_side_by_side_runs_the_others_at_the_requested_batch_size():
    # tune found batch 512 (4 workers); without tune one runs 256: that is what it is against
    result = _checked({0: 100.0, 2: 90.0, 4: 130.0}, tuned_workers=4, tuned_bs=512)
    assert result.sizes[4] == {512, 256}  # tuned at 512, the 2x cores rule (4) at 256
    assert result.sizes[0] == {256} and result.sizes[2] == {256}
    assert result.chosen == "tuned" and result.best.batch_size == 512
    result = _checked({0: 100.0, 2: 90.0, 4: 101.0}, tuned_workers=4, tuned_bs=512)
    assert result.chosen == "defaults" and result.best.batch_size == 256


@pytest.mark.slow
def test_tune_chooses_the_native_decoders_threads(tmp_path, jpeg_folder, monkeypatch):
    from gpufeed.data import native_jpeg

    if not native_jpeg.available():
        import pytest

        pytest.skip(native_jpeg.status())
    from gpufeed.system import sysinfo

    monkeypatch.setattr(sysinfo, "usable_cpus", lambda *a: sysinfo.CpuBudget(4, None, 4, "test"))
    gpufeed.pack(jpeg_folder, tmp_path / "p", format="mmap", workers=1, quiet=True)
    crop = gpufeed.RandomResizedCrop(8, backend="native")
    ds = gpufeed.open_dataset(tmp_path / "p", decode=crop)
    result = tune.tune(ds, batch_size=4, budget_s=4, batch_sizes=[4], cpus=4, compare=False)
    tried = [t.settings["decoder_threads"] for t in result.trials if t.stage == "threads"]
    first = [t for t in result.trials if t.stage in ("in-process", "workers")]
    each = 4 // max(1, max(first, key=lambda t: t.samples_per_s).settings["num_workers"])
    # one, half and all of each process's CPUs, but "auto"'s own count (the trials before)
    assert tried == sorted({1, max(1, each // 2), each} - {each})
    assert result.best.settings.get("decoder_threads", "auto") in {"auto", 1, 2, 4}
    # the chosen count is a setting make_loader takes, and the loader tells the decoder
    loader = gpufeed.make_loader(ds, 4, settings={"decoder_threads": 3})
    assert loader.plan.decoder_threads == 3 and crop.threads_for(0) == 3
    assert "decoder_threads=3" in str(loader.plan)
    loader = gpufeed.make_loader(ds, 4, num_workers=0)  # a new loader: auto again
    assert crop.loader_threads is None and crop.threads_for(0) == 4
    own = gpufeed.RandomResizedCrop(8, backend="native", threads=2)  # the decoder's own wins
    ds = gpufeed.open_dataset(tmp_path / "p", decode=own)
    gpufeed.make_loader(ds, 4, num_workers=0, decoder_threads=3)
    assert own.threads_for(0) == 2


# --- decisions from fixed readings: the clock is a parameter, so these never time anything ---

DEFAULT_WORKERS = 0  # what the fake make_loader's defaults pick
NOISE = (1.0, 0.9, 1.1, 0.95, 1.05)  # a shared machine's swing, reading after reading


def fake_plan(dataset, batch_size, settings):
    """The settings make_loader would run with, as its plan resolves them."""
    nw = settings.get("num_workers", DEFAULT_WORKERS)
    prefetch = settings.get("prefetch_factor") or (2 if nw else None)
    return {
        "num_workers": nw,
        "prefetch_factor": prefetch if nw else None,
        "persistent_workers": bool(nw) and settings.get("persistent_workers", True),
        "block_size": settings.get("block_size", getattr(dataset, "preferred_block_size", 256)),
    }


class FixedClock:
    """Readings by worker count, a setting's n-th reading scaled by the n-th factor of
    ``noise`` (from ``phase`` on); logs every (batch size, settings) it measured, in order."""

    def __init__(self, rates, noise=NOISE, phase=0):
        self.rates, self.noise, self.phase = rates, noise, phase
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, dataset, bs, settings, seconds, to_device=None):
        n = self.phase + sum(c == (bs, dict(settings)) for c in self.calls)
        self.calls.append((bs, dict(settings)))
        factor = self.noise[n % len(self.noise)]
        nw = int(settings.get("num_workers", DEFAULT_WORKERS))
        return self.rates.get(nw, self.rates[max(self.rates)]) * factor, 0.01


def _side_by_side(tuned, rates, clock=None, tuned_bs=256, min_gain=1.05):
    best = tune_result.Trial(dict(tuned), tuned_bs, 1.0, 0.1, "x")
    result = tune_result.TuneResult(best=best, trials=[best], cpus=2, seconds=0.0)
    clock = clock or FixedClock(rates)
    costs = tune_compare.TrialCosts(clock, fake_plan)
    deadline = time.perf_counter() + 5
    tune_compare.compare_side_by_side(
        CheapDataset(), result, deadline, None, lambda s: None, costs, min_gain, 256
    )
    return result, clock


def test_a_search_that_ends_at_the_defaults_reports_no_gain_over_them():
    # the search's best is make_loader's defaults written out (in-process, the default block
    # size): it was measured as a separate contender and a lucky reading said "1.28x defaults"
    tuned = {"num_workers": 0, "persistent_workers": True, "block_size": 256}
    clock = FixedClock({0: 100.0, 2: 80.0, 4: 70.0}, noise=(1.0, 1.28, 0.9, 1.2, 0.95, 1.1))
    result, clock = _side_by_side(tuned, None, clock)
    assert result.chosen == "defaults"
    assert result.ratios()["tuned"] == 1.0  # the same readings: 1.00x, never a gain
    assert result.comparison["tuned"] == result.comparison["defaults"]
    assert "= the defaults, measured once" in result.comparison_settings["tuned"]
    # the defaults' loader was measured once a round, not once as "defaults", once as "tuned"
    rounds = len([c for c in clock.calls if c[1] == {}])
    assert rounds >= tune_compare.MIN_ROUNDS
    assert len(clock.calls) == 3 * rounds  # defaults, 1x cores, 2x cores
    assert "tuned" not in {k for k, v in result.ratios().items() if v != 1.0}


def test_a_gain_within_the_noise_keeps_the_defaults():
    # 4 workers read 8% faster (their median), past min_gain, but the rounds swing +-10%
    result, _ = _side_by_side({"num_workers": 4, "prefetch_factor": 2}, {0: 100, 2: 60, 4: 108})
    assert result.chosen == "defaults", result.verdict
    assert result.best.settings == {"num_workers": DEFAULT_WORKERS}
    assert result.verdict.startswith("within noise") and "1.08x" in result.verdict
    assert result.noise == pytest.approx(0.2 / 1.0, rel=0.01)  # (1.1 - 0.9) / median


def test_a_gain_beyond_the_noise_wins():
    result, _ = _side_by_side({"num_workers": 4, "prefetch_factor": 8}, {0: 100, 2: 60, 4: 150})
    assert result.chosen == "tuned", result.verdict
    assert result.best.settings == {"num_workers": 4, "prefetch_factor": 8}
    assert result.ratios()["defaults"] == pytest.approx(1.5)
    assert "beyond the noise" in result.verdict


def test_without_noise_min_gain_still_holds():
    steady = FixedClock({0: 100, 2: 60, 4: 103}, noise=(1.0,))
    result, _ = _side_by_side({"num_workers": 4}, None, steady)
    assert result.noise == 0.0 and result.chosen == "defaults"


def test_rounds_are_interleaved_in_rotated_order():
    result, clock = _side_by_side({"num_workers": 4, "prefetch_factor": 8}, {0: 1, 2: 1, 4: 1})
    order = [c[1].get("prefetch_factor", c[1].get("num_workers", "d")) for c in clock.calls]
    names = order[:4]
    assert len(set(names)) == 4 and len(order) % 4 == 0 and len(order) >= 8
    for r in range(len(order) // 4):  # round r starts r places further on
        k = r % 4
        assert order[4 * r : 4 * r + 4] == names[k:] + names[:k]


def test_decide_needs_the_gain_to_exceed_the_spread():
    rates = {"defaults": [100, 90, 110], "tuned": [115, 104, 120]}
    chosen, noise, verdict = tune_compare.decide(rates, {}, 1.05)
    assert chosen == "defaults" and noise == pytest.approx(0.2) and "within noise" in verdict
    rates["tuned"] = [130, 128, 131]
    assert tune_compare.decide(rates, {}, 1.05)[0] == "tuned"
    twins = {"defaults": rates["defaults"], "tuned": rates["defaults"]}
    chosen, _, verdict = tune_compare.decide(twins, {"tuned": "defaults"}, 1.05)
    assert chosen == "defaults" and "make_loader's defaults" in verdict


@pytest.mark.parametrize("phase", range(len(NOISE)))
def test_tune_with_fixed_readings_recommends_the_same_whatever_the_noise_phase(phase):
    # workers within the noise of in-process: each phase of the same noise used to be able to
    # tip a one-reading decision (three runs recommended 0, 2, 0 workers)
    # 10% faster with workers: past min_gain, within the noise (+-10%)
    clock = FixedClock({0: 100, 1: 60, 2: 110, 3: 109, 4: 108}, phase=phase)
    result = tune.tune(
        CheapDataset(),
        batch_size=64,
        budget_s=2,
        batch_sizes=[64],
        cpus=2,
        measure=clock,
        plan=fake_plan,
    )
    assert result.chosen == "defaults" and result.best.settings == {"num_workers": 0}
    assert "within noise" in result.verdict, result.verdict


def test_tune_command_prints_the_verdict_and_1x_for_the_defaults(
    tmp_path, array_folder, capsys, monkeypatch
):
    clock = FixedClock({0: 100, 1: 60, 2: 50}, noise=(1.0,))  # the search ends at the defaults
    monkeypatch.setattr(tune_compare, "measure_settings", clock)
    monkeypatch.setattr(tune_compare, "loader_settings", fake_plan)
    dest = tmp_path / "pack"
    gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    out = tmp_path / "loader.json"
    args = [
        "tune",
        str(dest),
        "-b",
        "4",
        "--batch-sizes",
        "4",
        "--budget",
        "2",
        "--write",
        str(out),
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "1.00x tuned" in printed and "= the defaults, measured once" in printed, printed
    assert "the search's best is make_loader's defaults" in printed
    saved = json.loads(out.read_text())
    assert saved["_batch_size"] == 4 and saved["measured"]["vs_tuned"] == 1.0
    assert "noise" in saved["measured"] and saved["measured"]["verdict"]


def test_a_tuned_file_applied_at_another_batch_size_warns(tmp_path):
    from gpufeed.errors import TunedBatchSizeWarning

    best = tune_result.Trial({"num_workers": 0}, 256, 1.0, 0.1, "x")
    result = tune_result.TuneResult(best=best, trials=[best], cpus=2, seconds=0.0)
    path = tune.write_settings(result, tmp_path / "loader.json")
    with pytest.warns(TunedBatchSizeWarning, match="batch_size=256.*batch_size=32") as w:
        loader = gpufeed.make_loader(CheapDataset(), 32, settings=path)
    assert str(path) in str(w[0].message) and loader.plan.num_workers == 0
    assert w[0].filename == __file__  # points at the caller's line
