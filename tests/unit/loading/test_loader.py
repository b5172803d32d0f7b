import json
import random
import time
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from gpufeed.data.distributed import DistributedBlockSampler
from gpufeed.errors import ShmBudgetWarning
from gpufeed.loading import make as make_mod
from gpufeed.loading import plan as plan_mod
from gpufeed.loading.cpu_budget import worker_count_for
from gpufeed.loading.make import make_loader
from gpufeed.loading.plan import clear_plan_cache
from gpufeed.loading.settings import SETTINGS_KEYS


class Batch(NamedTuple):
    samples: torch.Tensor
    labels: torch.Tensor


class MemDataset(Dataset):
    """The gpufeed map-style protocol: __getitems__ returns the list of samples, get_batch
    (the fast path) one stacked Batch."""

    def __init__(self, n=200, shape=(3, 8, 8), delay=0.0):
        self.x = torch.arange(n, dtype=torch.int64).view(n, 1, 1, 1).expand(n, *shape)
        self.x = (self.x % 251).to(torch.uint8).contiguous()
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i], int(i)

    def get_batch(self, indices):
        if self.delay:
            time.sleep(self.delay)
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return Batch(self.x[idx], idx.clone())

    def __getitems__(self, indices):
        batch = self.get_batch(indices)
        return list(zip(batch.samples, batch.labels.tolist(), strict=True))


class PlainDataset(Dataset):
    """No __getitems__: default_collate path."""

    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((2,), i), i


class EpochIterable(IterableDataset):
    """Order depends on set_epoch, split over DataLoader workers like tar shards."""

    def __init__(self, n=60):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng([7, self.epoch]).permutation(self.n)
        for i in order[wid::nw]:
            yield torch.tensor([int(i)]), int(i)


class RandomDataset(Dataset):
    """Returns what the worker's RNGs produce: checks per-worker, per-epoch seeding."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor(
            [
                info.id if info else -1,
                random.random(),
                float(np.random.rand()),
                torch.rand(1)[0],
            ]
        )


def labels_of(batch):
    return batch.labels.tolist() if hasattr(batch, "labels") else batch[1].tolist()


def epoch_indices(loader):
    return [i for b in loader for i in labels_of(b)]


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_plan_cache()
    yield
    clear_plan_cache()


@pytest.mark.parametrize("workers", [0, 2])
def test_map_style_every_index_once_and_new_order_each_epoch(workers):
    ds = MemDataset(203)
    dl = make_loader(ds, 16, True, num_workers=workers, block_size=8, buffer_blocks=2, seed=1)
    assert len(dl) == 13
    first = next(iter(dl))
    assert isinstance(first, tuple) and first._fields == ("samples", "labels")
    assert first.samples.shape == (16, 3, 8, 8) and first.samples.dtype == torch.uint8
    assert first.labels.dtype == torch.int64
    assert torch.equal(first.samples[:, 0, 0, 0], (first.labels % 251).to(torch.uint8))
    dl.set_epoch(0)  # the peek above was abandoned: epoch 0 again
    e0 = epoch_indices(dl)
    e1 = epoch_indices(dl)  # a finished pass advances the epoch by itself
    assert sorted(e0) == sorted(e1) == list(range(203))
    assert e0 != e1
    assert dl.epoch == 2
    again = make_loader(ds, 16, True, num_workers=0, block_size=8, buffer_blocks=2, seed=1)
    assert epoch_indices(again) == e0
    other = make_loader(ds, 16, True, num_workers=0, block_size=8, buffer_blocks=2, seed=2)
    assert epoch_indices(other) != e0


def test_default_collate_path_drop_last_and_no_shuffle():
    dl = make_loader(PlainDataset(50), 8, num_workers=0, shuffle=False, drop_last=True)
    batches = list(dl)
    assert len(batches) == len(dl) == 6
    x, y = batches[0]
    assert x.shape == (8, 2) and y.tolist() == list(range(8))
    assert [i for b in batches for i in b[1].tolist()] == list(range(48))


def test_sorted_batches_follow_dataset_hint():
    ds = MemDataset(100)
    ds.prefers_sorted_reads = True
    dl = make_loader(ds, 10, num_workers=0, block_size=4)
    assert dl.plan.sorted_batches
    for b in dl:
        assert labels_of(b) == sorted(labels_of(b))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(workers):
    ds = MemDataset(150)
    kw = dict(shuffle=True, num_workers=workers, block_size=8, seed=4)
    dl = make_loader(ds, 16, **kw)
    dl.set_epoch(3)
    full = epoch_indices(make_loader(ds, 16, **kw) if False else dl)
    dl.set_epoch(3)
    before = []
    for k, b in enumerate(dl):  # workers have prefetched beyond this point
        before += labels_of(b)
        if k == 3:
            state = dl.state_dict()
            break
    assert state["epoch"] == 3 and state["samples_seen"] == 64
    json.dumps(state)  # checkpointable as plain data
    resumed = make_loader(ds, 16, **kw)
    resumed.load_state_dict(state)
    after = epoch_indices(resumed)
    assert before + after == full
    assert resumed.epoch == 4 and resumed.state_dict()["samples_seen"] == 0
    nxt = epoch_indices(resumed)  # the following epoch is complete again
    assert sorted(nxt) == list(range(150)) and nxt != full


def test_resume_rejects_a_different_setup():
    ds = MemDataset(100)
    state = make_loader(ds, 10, num_workers=0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has seed=2"):
        make_loader(ds, 10, num_workers=0, seed=2).load_state_dict(state)
    # another world size resumes elastically (test_elastic_resume), over the same dataset only
    other = MemDataset(90)
    with pytest.raises(ValueError, match="dataset_len=100 but this loader has dataset_len=90"):
        make_loader(other, 10, num_workers=0, seed=1, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not a gpufeed loader state"):
        make_loader(ds, 10, num_workers=0).load_state_dict({"epoch": 1})


def test_distributed_ranks_cover_once_and_resume_across_ranks(monkeypatch):
    ds = MemDataset(101)
    monkeypatch.setenv("WORLD_SIZE", "2")
    loaders = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        loaders.append(make_loader(ds, 8, num_workers=0, block_size=4, seed=9))
    assert all(isinstance(dl.sampler, DistributedBlockSampler) for dl in loaders)
    assert [dl.rank for dl in loaders] == [0, 1]
    seen, states = [], []
    for k, dl in enumerate(loaders):
        it = iter(dl)
        for _ in range(2 + k):
            seen += labels_of(next(it))
        states.append(dl.state_dict())
    for r, state in enumerate(states):
        fresh = make_loader(ds, 8, num_workers=0, block_size=4, seed=9, rank=r, world_size=2)
        fresh.load_state_dict(state)
        seen += epoch_indices(fresh)
    counts = np.bincount(seen, minlength=101)
    assert counts.sum() == 102 and set(counts.tolist()) == {
        1,
        2,
    }  # one pad sample, like DDP


def test_iterable_set_epoch_reaches_persistent_workers_and_resume_replays():
    ds = EpochIterable(60)
    dl = make_loader(ds, 5, num_workers=2, persistent_workers=True)
    assert dl.plan.persistent_workers
    e0, e1 = epoch_indices(dl), epoch_indices(dl)
    assert sorted(e0) == sorted(e1) == list(range(60))
    assert e0 != e1  # the epoch reached the long-lived workers
    dl.set_epoch(1)
    assert epoch_indices(dl) == e1
    dl.set_epoch(1)
    it = iter(dl)
    before = labels_of(next(it)) + labels_of(next(it)) + labels_of(next(it))
    state = dl.state_dict()
    del it
    resumed = make_loader(EpochIterable(60), 5, num_workers=2)
    resumed.load_state_dict(state)
    assert before + epoch_indices(resumed) == e1


def test_iterable_in_process_calls_set_epoch():
    ds = EpochIterable(20)
    dl = make_loader(ds, 4, num_workers=0)
    dl.set_epoch(5)
    got = epoch_indices(dl)
    assert ds.epoch == 5 and got == np.random.default_rng([7, 5]).permutation(20).tolist()


def _rng_rows(dl):
    return torch.cat(list(dl))


def test_workers_seeded_per_worker_epoch_and_reproducible():
    ds = RandomDataset()
    kw = dict(num_workers=2, shuffle=False, seed=11)
    a = make_loader(ds, 2, **kw)
    e0, e1 = _rng_rows(a), _rng_rows(a)
    b = make_loader(ds, 2, **kw)
    assert torch.equal(_rng_rows(b), e0)  # same seed, same epoch -> same randomness
    assert not torch.equal(e0[:, 1:], e1[:, 1:])  # new epoch, new randomness
    w0, w1 = e0[e0[:, 0] == 0, 1:], e0[e0[:, 0] == 1, 1:]
    assert len(w0) and len(w1) and not torch.equal(w0[:1], w1[:1])  # workers differ
    c = make_loader(ds, 2, num_workers=2, shuffle=False, seed=12)
    assert not torch.equal(_rng_rows(c)[:, 1:], e0[:, 1:])


@pytest.fixture
def one_torch_thread():
    # The unit-test machine is shared: under load, 2 OpenMP threads in this process wait on
    # each other for whole scheduler slices, which workers (1 thread each) never do.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_auto_plan_follows_its_measurement_and_caches(monkeypatch, one_torch_thread):
    # Cheap samples on 2 shared cores: in-process and 2 workers measure close (1.13x either
    # way was seen), so which wins is the machine's; the plan must follow its own numbers.
    ds = MemDataset(4000, shape=(3, 64, 64))
    dl = make_loader(ds, 64, probe_budget_s=1.0)
    m = dl.plan.measured
    assert "in_process_batches_per_s" in m and any(k.startswith("workers") for k in m)
    workers_won = m["speedup_workers_vs_in_process"] > plan_mod._WORKER_MARGIN
    assert dl.plan.num_workers == (2 if workers_won else 0), str(dl.plan)
    assert ("faster than in-process" in dl.plan.reason) == workers_won
    calls = []
    monkeypatch.setattr(plan_mod, "_measure_workers", lambda *a, **k: calls.append(1))
    again = make_loader(ds, 64)
    assert again.plan.reason == dl.plan.reason and not calls  # cached, not re-measured


def _fixed_in_process(seconds_per_batch):
    """_measure_in_process with a fixed time per batch (the first batch is still read, for
    its size)."""

    def measure(batches, budget_s, max_batches=16):
        first = next(batches, None)
        return seconds_per_batch, first, 8

    return measure


def test_auto_keeps_in_process_when_workers_are_slower(monkeypatch):
    # The rule, apart from the machine: the worker probe and the IPC model both slower than
    # in-process (a second a batch), so the loader stays in-process and says why. In-process
    # reads at a fixed 5 ms a batch: timed, it took over 10 ms on a loaded machine.
    monkeypatch.setattr(plan_mod, "_measure_in_process", _fixed_in_process(0.005))
    monkeypatch.setattr(plan_mod, "_measure_workers", lambda *a, **k: (1.0, 0.01))
    monkeypatch.setattr(plan_mod, "_ipc_seconds", lambda batch: 1.0)
    dl = make_loader(MemDataset(4000, shape=(3, 8, 8)), 64, probe_budget_s=1.0)
    assert dl.plan.num_workers == 0, str(dl.plan)
    assert dl.plan.persistent_workers is False and dl.plan.prefetch_factor is None
    assert "in-process" in dl.plan.reason and "worker IPC outweighs" in dl.plan.reason
    assert dl.plan.measured["speedup_workers_vs_in_process"] < 0.01


def test_a_model_never_overturns_workers_measured_slower(monkeypatch):
    # In-process measured 20% faster than the workers; the IPC model (the in-process cost
    # spread over the workers, no IPC) says workers would be far faster. It used to stand in
    # ("2 workers modelled (the measurement was slower)"); the measurement decides.
    monkeypatch.setattr(plan_mod, "_measure_in_process", _fixed_in_process(0.010))
    monkeypatch.setattr(plan_mod, "_measure_workers", lambda *a, **k: (0.012, 0.01))
    monkeypatch.setattr(plan_mod, "_ipc_seconds", lambda batch: 0.0)
    dl = make_loader(MemDataset(4000, shape=(3, 8, 8)), 64, probe_budget_s=1.0)
    assert dl.plan.num_workers == 0, str(dl.plan)
    assert "modelled" not in dl.plan.reason and "measured" in dl.plan.reason, dl.plan.reason
    assert dl.plan.measured["speedup_workers_vs_in_process"] == pytest.approx(0.010 / 0.012)


def test_the_model_may_still_lift_workers_measured_faster(monkeypatch):
    # Workers measured a little faster (within the margin): the measurement does not separate
    # the two, and the model, in the measurement's direction, may stand in.
    monkeypatch.setattr(plan_mod, "_measure_in_process", _fixed_in_process(0.010))
    monkeypatch.setattr(plan_mod, "_measure_workers", lambda *a, **k: (0.0095, 0.01))
    monkeypatch.setattr(plan_mod, "_ipc_seconds", lambda batch: 0.0)
    dl = make_loader(MemDataset(4000, shape=(3, 8, 8)), 64, probe_budget_s=1.0)
    assert dl.plan.num_workers == worker_count_for(dl.plan.cpus) >= 1, str(dl.plan)
    assert "modelled" in dl.plan.reason, dl.plan.reason


def test_auto_picks_workers_when_loading_is_slow():
    ds = MemDataset(4000, delay=0.01)  # 10 ms of I/O latency per batch
    dl = make_loader(ds, 16, probe_budget_s=1.5, multiprocessing_context="fork")
    assert dl.plan.num_workers >= 1, str(dl.plan)
    assert dl.plan.measured["speedup_workers_vs_in_process"] > 1.1
    assert dl.plan.persistent_workers and dl.plan.prefetch_factor == 2
    assert "faster than in-process" in dl.plan.reason


class LoggingDataset(MemDataset):
    """Appends every index it reads, in whichever process reads it, to a file."""

    def __init__(self, log, n=4000):
        super().__init__(n)
        self.log = str(log)

    def get_batch(self, indices):
        with open(self.log, "a") as f:
            f.write(" ".join(map(str, indices)) + "\n")
        return super().get_batch(indices)


def test_probe_rounds_all_read_the_first_batches(tmp_path):
    """The in-process round reads batches into the page cache; workers and the second round
    read the same ones, so a plan made on a cold start is a plan for warm epochs too."""
    log = tmp_path / "reads.txt"
    ds = LoggingDataset(log)
    order = list(range(4000))[::-1]
    batches = [sorted(order[i : i + 16]) for i in range(0, 4000, 16)]
    plan_mod.plan_workers(
        ds,
        16,
        batch_indices=iter(batches),
        cpus=2,
        multiprocessing_context="fork",
        use_cache=False,
    )
    read = [list(map(int, line.split())) for line in log.read_text().splitlines()]
    first = {i for b in batches[:17] for i in b}
    assert len(read) > 17 + 8  # in-process, then the workers (forked: same log file)
    assert {i for b in read for i in b} <= first


def test_explicit_num_workers_skips_the_probe(monkeypatch):
    monkeypatch.setattr(make_mod, "plan_workers", lambda *a, **k: pytest.fail("probed"))
    dl = make_loader(MemDataset(10), 4, num_workers=1)
    assert dl.num_workers == 1 and dl.plan.reason == "as requested"


def test_settings_dict_file_env_and_explicit_wins(tmp_path, monkeypatch):
    ds = MemDataset(40)
    dl = make_loader(ds, 4, settings={"num_workers": 1, "block_size": 5, "_note": "x"})
    assert dl.num_workers == 1 and dl.sampler.block_size == 5
    assert set(dl.plan.from_settings) == {"num_workers", "block_size"}
    f = tmp_path / "loader.json"
    f.write_text(json.dumps({"num_workers": 0, "prefetch_factor": 4, "buffer_blocks": 3}))
    monkeypatch.setenv("GPUFEED_LOADER_SETTINGS", str(f))
    dl = make_loader(ds, 4, block_size=7)
    assert (dl.num_workers, dl.sampler.buffer_blocks, dl.sampler.block_size) == (
        0,
        3,
        7,
    )
    assert dl.plan.reason == "from settings"
    dl = make_loader(ds, 4, num_workers=1)
    assert dl.num_workers == 1 and dl.plan.prefetch_factor == 4
    assert set(dl.plan.settings()) == set(SETTINGS_KEYS)
    with pytest.raises(ValueError, match="unknown loader setting.*num_wrokers"):
        make_loader(ds, 4, settings={"num_wrokers": 2})
    monkeypatch.setenv("GPUFEED_LOADER_SETTINGS", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="gpufeed tune"):
        make_loader(ds, 4)


def test_shm_budget_warning(monkeypatch):
    from gpufeed.system import sysinfo

    monkeypatch.setattr(
        sysinfo, "shm_info", lambda path: sysinfo.ShmInfo(str(path), 64 << 20, 60 << 20)
    )
    ds = MemDataset(64, shape=(3, 256, 256))  # 192 KiB a sample, 12 MiB a batch of 64
    with pytest.warns(ShmBudgetWarning, match=r"--shm-size=1g.*shm_size.*num_workers=2"):
        dl = make_loader(ds, 64, num_workers=3, prefetch_factor=2)
    assert dl.plan.batch_bytes == 64 * 3 * 256 * 256
    with pytest.warns(ShmBudgetWarning, match="below GPUFEED_MIN_SHM_MB=1024"):
        make_loader(ds, 64, num_workers=1, prefetch_factor=2)  # fits, but under the floor
    monkeypatch.setenv("GPUFEED_MIN_SHM_MB", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShmBudgetWarning)
        make_loader(ds, 64, num_workers=0)  # in-process needs no shared memory
        make_loader(ds, 64, num_workers=1, prefetch_factor=2)  # 24 MiB fits in 60


def test_multiprocessing_context_default(monkeypatch):
    assert plan_mod.default_multiprocessing_context() == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert plan_mod.default_multiprocessing_context() == "spawn"
    with pytest.raises(ValueError, match="'fork', 'spawn' or 'forkserver'"):
        make_loader(MemDataset(4), 2, num_workers=0, multiprocessing_context="thread")


def test_pin_memory_only_with_cuda(monkeypatch):
    assert make_loader(MemDataset(4), 2, num_workers=0).plan.pin_memory is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_loader(MemDataset(4), 2, num_workers=0).plan.pin_memory is True


def test_worker_budget_divides_cpus_among_local_ranks(monkeypatch):
    from gpufeed.system import sysinfo

    monkeypatch.setattr(sysinfo, "usable_cpus", lambda: sysinfo.CpuBudget(16, None, 16, "x"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    dl = make_loader(MemDataset(8), 2, num_workers=0)
    assert dl.plan.cpus == 4 and "LOCAL_WORLD_SIZE=4" in dl.plan.cpu_source
    assert worker_count_for(4) == 3 and worker_count_for(2) == 2


def test_spawn_context_is_estimated_not_probed(monkeypatch):
    monkeypatch.setattr(plan_mod, "_measure_workers", lambda *a, **k: pytest.fail("probed"))
    # a 40 ms sleep per batch: the model's IPC term (timed here, inflated on a loaded machine)
    # stays small beside it, so the estimate favours workers however busy the machine is
    slow = make_loader(MemDataset(2000, delay=0.04), 16, multiprocessing_context="spawn")
    assert "estimated (spawn workers start too slowly to probe)" in slow.plan.reason
    assert slow.plan.num_workers >= 1 and slow.plan.multiprocessing_context == "spawn"
    m = slow.plan.measured
    # the in-process time per batch spread over 2 workers, plus the measured IPC cost
    t_in = 1 / m["in_process_batches_per_s"]
    expect = 1 / (t_in / 2 + m["ipc_ms_per_batch"] / 1e3)
    assert m["workers2_batches_per_s_estimated"] == pytest.approx(expect)
    assert t_in >= 0.01  # it did sleep 10 ms per batch: the timing is real


class FailingInWorkers(MemDataset):
    def get_batch(self, indices):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("corrupt sample 17 in shard 3")
        return super().get_batch(indices)


def test_a_worker_error_during_the_probe_reaches_the_user():
    with pytest.raises(RuntimeError, match="corrupt sample 17"):
        make_loader(FailingInWorkers(500), 8, probe_budget_s=0.5)


def test_non_distributed_sampler_under_a_world_warns():
    with pytest.warns(UserWarning, match="every rank reads the same samples"):
        make_loader(MemDataset(10), 2, num_workers=0, sampler=range(10), rank=0, world_size=2)


def test_plan_is_readable_and_round_trips_as_settings():
    dl = make_loader(MemDataset(300), 16, probe_budget_s=0.5)
    text = str(dl.plan)
    assert f"num_workers={dl.plan.num_workers} ({dl.plan.reason})" in text
    assert "in_process_batches_per_s=" in text and "usable CPUs:" in text
    again = make_loader(MemDataset(300), 16, settings=dl.plan.settings())
    assert again.plan.settings() == dl.plan.settings()
    assert again.plan.reason == "from settings"


def test_plan_measured_once_per_pack_read_the_same_way(array_folder, tmp_path):
    import gpufeed

    dest = tmp_path / "pack"
    gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    a, b = gpufeed.open_dataset(dest), gpufeed.open_dataset(dest)
    assert a.fingerprint() == b.fingerprint()
    flipped = gpufeed.open_dataset(dest, transform=torch.clone)
    assert flipped.fingerprint() != a.fingerprint()
    assert gpufeed.open_dataset(dest, use_mmap=False).fingerprint() != a.fingerprint()
    make_loader(a, 4)
    measured = len(plan_mod._PLAN_CACHE)
    make_loader(b, 4)  # a second dataset object over the same pack: the plan is reused
    assert len(plan_mod._PLAN_CACHE) == measured
    make_loader(flipped, 4)
    assert len(plan_mod._PLAN_CACHE) == measured + 1


def test_tar_stream_plan_measured_once_per_pack_not_per_seed(array_folder, tmp_path):
    """A rebuilt stream (a new seed each epoch, as the bench's passes do) reuses the plan: a
    probe per loader would read ahead of the timed pass and warm a cold cache."""
    import gpufeed

    dest = tmp_path / "pack"
    gpufeed.pack(array_folder, dest, format="tar", workers=1, quiet=True, shard_size=4)
    a, b = (gpufeed.open_dataset(dest, map_style=False, seed=s) for s in (1, 2))
    assert a.fingerprint() == b.fingerprint()
    assert (
        gpufeed.open_dataset(dest, map_style=False, shuffle_buffer=3).fingerprint()
        != a.fingerprint()
    )
    assert gpufeed.open_dataset(dest).fingerprint() != a.fingerprint()
    make_loader(a, 4)
    measured = len(plan_mod._PLAN_CACHE)
    make_loader(b, 4)
    assert len(plan_mod._PLAN_CACHE) == measured


@pytest.mark.slow
@pytest.mark.parametrize("split", ["samples", "shards"])
def test_probe_warns_nothing_of_its_own_workers_on_a_one_shard_tar(array_folder, tmp_path, split):
    """A small set packs into one tar shard: the probe's 2 workers outnumber its shards, and
    split="shards" warned (ShardSplitWarning, from the probe's worker) of a run the user never
    asked for. The probe is silent; the user's own run with 2 workers still warns."""
    import gpufeed
    from gpufeed.errors import ShardSplitWarning

    dest = tmp_path / "pack"
    gpufeed.pack(array_folder, dest, format="tar", workers=1, quiet=True)
    ds = gpufeed.open_dataset(dest, map_style=False, split=split)
    assert len(ds.reader.shard_start) == 2  # one shard
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # forked probe workers inherit it: a warning raises
        dl = make_loader(ds, 4, multiprocessing_context="fork")
        assert sum(len(labels_of(b)) for b in dl) == len(ds)
        if split == "shards":
            with pytest.raises(ShardSplitWarning, match="1 shard"):
                list(make_loader(ds, 4, num_workers=2, multiprocessing_context="fork"))
    workers = worker_count_for(dl.plan.cpus)
    assert f"workers{workers}_batches_per_s" in dl.plan.measured, str(dl.plan)  # it probed


def test_arguments_are_dataloaders_in_order_and_default():
    import inspect

    from torch.utils.data import DataLoader

    theirs = inspect.signature(DataLoader).parameters
    ours = inspect.signature(make_loader).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert list(ours)[: len(positional)] == positional  # shuffle is the third, as there
    # where the defaults differ, the docstring says why
    differ = {"num_workers", "pin_memory", "persistent_workers"}
    for name, p in theirs.items():
        assert name in ours, name
        assert ours[name].kind == p.kind, name
        if name not in differ and name != "self":
            assert ours[name].default == p.default, name
    for name in differ:
        assert f"``{name}=" in make_loader.__doc__


def test_shuffle_is_off_by_default_as_in_dataloader():
    ds = MemDataset(50)
    assert epoch_indices(make_loader(ds, 8, num_workers=0)) == list(range(50))
    assert epoch_indices(make_loader(ds, 8, True, num_workers=0)) != list(range(50))


def test_batch_sampler_generator_and_dataloaders_argument_rules():
    from torch.utils.data import BatchSampler, SequentialSampler

    ds = MemDataset(30)
    bs = BatchSampler(SequentialSampler(range(30)), 7, drop_last=False)
    dl = make_loader(ds, batch_sampler=bs, num_workers=0)
    assert [labels_of(b) for b in dl] == [list(range(i, min(i + 7, 30))) for i in range(0, 30, 7)]
    assert len(dl) == 5
    it = iter(dl)
    first = labels_of(next(it))
    state = dl.state_dict()
    resumed = make_loader(ds, batch_sampler=bs, num_workers=0)
    resumed.load_state_dict(state)
    assert first + epoch_indices(resumed) == list(range(30))  # replayed, not repeated
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive"):
        make_loader(ds, 8, batch_sampler=bs)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        make_loader(ds, 8, True, sampler=range(30))
    with pytest.raises(ValueError, match="prefetch_factor"):
        make_loader(ds, 8, num_workers=1, prefetch_factor=0)

    def order(gen):
        return epoch_indices(make_loader(ds, 8, True, num_workers=0, generator=gen))

    g = torch.Generator
    assert order(g().manual_seed(1)) == order(g().manual_seed(1)) != order(g().manual_seed(2))
    with pytest.raises(ValueError, match="seed or generator"):
        make_loader(ds, 8, seed=1, generator=g())


@pytest.mark.slow
def test_in_order_false_still_reads_every_sample_once():
    dl = make_loader(MemDataset(64), 8, True, num_workers=2, in_order=False)
    assert dl.dataloader.in_order is False
    assert sorted(epoch_indices(dl)) == list(range(64))


def test_iterable_shuffle_follows_dataloader():
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        make_loader(EpochIterable(10), 2, True, num_workers=0)
    assert len(epoch_indices(make_loader(EpochIterable(10), 2, False, num_workers=0))) == 10
