import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from gpufeed.data.distributed import DistributedBlockSampler


def ranks(n, world, **kw):
    return [
        DistributedBlockSampler(n, num_replicas=world, rank=r, block_size=8, **kw)
        for r in range(world)
    ]


@pytest.mark.parametrize("n,world", [(100, 2), (101, 2), (1000, 3), (7, 4), (1, 3)])
def test_exact_coverage_with_padding(n, world):
    samplers = ranks(n, world, seed=1)
    seen = [i for s in samplers for i in s]
    ref = DistributedSampler(range(n), num_replicas=world, rank=0)
    assert all(len(s) == len(list(s)) == ref.num_samples for s in samplers)
    assert set(seen) == set(range(n))
    counts = np.bincount(seen, minlength=n)
    assert counts.sum() == ref.total_size
    assert counts.max() - counts.min() <= 1  # padding repeats each sample at most once more


@pytest.mark.parametrize("n,world", [(101, 2), (1000, 3)])
def test_drop_last_disjoint_equal_lengths(n, world):
    samplers = ranks(n, world, seed=1, drop_last=True)
    parts = [list(s) for s in samplers]
    assert {len(p) for p in parts} == {n // world}
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat))


def test_epochs_differ_and_are_deterministic():
    a, b = ranks(500, 2, seed=3)
    e0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = list(a)
    assert e0 != e1
    assert sorted(e1 + list(b)) == list(range(500))
    again = DistributedBlockSampler(500, num_replicas=2, rank=0, block_size=8, seed=3, epoch=1)
    assert list(again) == e1
    assert list(again.iter_from(100)) == e1[100:]


def test_no_shuffle_is_contiguous_and_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = DistributedBlockSampler(10, shuffle=False)
    assert (s.rank, s.num_replicas) == (1, 2)
    assert list(s) == [5, 6, 7, 8, 9]


def test_drop_last_tiny_dataset_is_an_error():
    with pytest.raises(ValueError, match="leaves every rank empty"):
        DistributedBlockSampler(2, num_replicas=4, rank=0, drop_last=True)
