"""make_loader over gpufeed's own packed datasets: the Batch protocol from __getitems__, lazy
per-process handles after the parent measured, tar shard splitting."""

import pytest
import torch

import gpufeed
from gpufeed.loading.make import make_loader

N = 103


@pytest.fixture(scope="module")
def packs(pack_factory):
    out = {}
    for fmt, kw in [("lmdb", {}), ("hdf5", {}), ("tar", {"shard_size": 10})]:
        out[fmt] = pack_factory(fmt, classes={"x": 60, "y": 43}, shape=(3, 8, 8), **kw)
    return out


def keys(batch):
    assert batch.samples.dtype == torch.uint8 and batch.samples.shape[1:] == (3, 8, 8)
    return [bytes(s.numpy().tobytes()) for s in batch.samples]


def epoch(dl):
    return [k for b in dl for k in keys(b)]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_map_style_packs_with_auto_workers_and_resume(packs, fmt):
    ds = gpufeed.open_dataset(packs[fmt])
    auto = make_loader(ds, 16, probe_budget_s=0.5)  # measures in this process first...
    assert auto.plan.measured and auto.plan.num_workers in (0, 1, 2)
    dl = make_loader(ds, 16, num_workers=2, seed=1)  # ...then workers open their own handles
    e0 = epoch(dl)
    assert len(e0) == len(set(e0)) == N
    dl.set_epoch(0)
    it = iter(dl)
    before = keys(next(it)) + keys(next(it))
    state = dl.state_dict()
    del it
    resumed = make_loader(ds, 16, num_workers=2, seed=1)
    resumed.load_state_dict(state)
    assert before + epoch(resumed) == e0


def test_tar_shards_split_over_workers_every_sample_once_and_resume(packs):
    ds = gpufeed.open_dataset(packs["tar"], map_style=False)
    dl = make_loader(ds, 8, num_workers=2)
    e0, e1 = epoch(dl), epoch(dl)
    assert len(e0) == len(set(e0)) == N and set(e0) == set(e1) and e0 != e1
    dl.set_epoch(1)
    it = iter(dl)
    before = keys(next(it)) + keys(next(it)) + keys(next(it))
    state = dl.state_dict()
    del it
    resumed = make_loader(gpufeed.open_dataset(packs["tar"], map_style=False), 8, num_workers=2)
    resumed.load_state_dict(state)
    assert before + epoch(resumed) == e1
