import warnings

import pytest

from gpufeed.data.distributed import (
    rank_and_world,
    rank_counts_by_shards,
    split_samples,
    split_shards,
)
from gpufeed.errors import ShardSplitWarning

SHARDS = [f"shard-{i:04d}.tar" for i in range(23)]


def _split(epoch, world, workers, **kw):
    return {
        (r, w): split_shards(
            SHARDS,
            seed=7,
            epoch=epoch,
            rank=r,
            world_size=world,
            worker_id=w,
            num_workers=workers,
            **kw,
        )
        for r in range(world)
        for w in range(workers)
    }


@pytest.mark.parametrize("world,workers", [(1, 1), (2, 3), (4, 2), (3, 1)])
def test_every_shard_exactly_once_per_epoch(world, workers):
    parts = _split(0, world, workers)
    seen = [s for part in parts.values() for s in part]
    assert sorted(seen) == sorted(SHARDS)
    sizes = [sum(len(parts[r, w]) for w in range(workers)) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_deterministic_and_changes_with_epoch_and_seed():
    assert _split(1, 2, 2) == _split(1, 2, 2)
    assert _split(1, 2, 2) != _split(2, 2, 2)
    a = split_shards(SHARDS, seed=1, epoch=0, rank=0, world_size=1, worker_id=0, num_workers=1)
    b = split_shards(SHARDS, seed=0, epoch=1, rank=0, world_size=1, worker_id=0, num_workers=1)
    assert a != b


def test_no_shuffle_keeps_order():
    part = split_shards(
        SHARDS,
        seed=0,
        epoch=0,
        rank=1,
        world_size=2,
        worker_id=0,
        num_workers=1,
        shuffle=False,
    )
    assert part == SHARDS[1::2]


def test_fewer_shards_than_ranks_raises():
    with pytest.raises(ValueError, match="repack into at least 4 shards"):
        split_shards(SHARDS[:3], seed=0, epoch=0, rank=0, world_size=4)


def test_fewer_shards_than_workers_warns_and_still_covers():
    with pytest.warns(ShardSplitWarning, match="get no shard"):
        split_shards(
            SHARDS[:5],
            seed=0,
            epoch=0,
            rank=0,
            world_size=2,
            worker_id=0,
            num_workers=4,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = [
            split_shards(
                SHARDS[:5],
                seed=0,
                epoch=0,
                rank=r,
                world_size=2,
                worker_id=w,
                num_workers=4,
            )
            for r in range(2)
            for w in range(4)
        ]
    assert sorted(s for p in parts for s in p) == sorted(SHARDS[:5])
    assert sum(1 for p in parts if not p) == 3


def test_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert rank_and_world() == (2, 3)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert rank_and_world() == (0, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        rank_and_world()


def test_worker_from_get_worker_info_in_dataloader():
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class DS(IterableDataset):
        def __iter__(self):
            yield from split_shards(SHARDS, seed=3, epoch=0, rank=0, world_size=1)

    got = list(DataLoader(DS(), batch_size=None, num_workers=2))
    assert sorted(got) == sorted(SHARDS)
    assert torch.utils.data.get_worker_info() is None


# -------------------------------------------------------------- split_samples (the default)

LAYOUTS = [
    [100] * 10 + [1],  # the 11 shards of 1001: whole shards gave ranks 600 and 401
    [5] * 11,
    [7],  # one shard, read by every rank
    [3, 0, 9, 1, 1, 40, 2],  # an empty shard among uneven ones
    [1] * 13,
    [2] * 9 + [1],
    [1000, 1, 1, 1],
]


def _samples(sizes, epoch, world, workers, shuffle=True):
    """{(rank, worker): [(shard, position), ...]} of split_samples."""
    return {
        (r, w): [
            (shard, p)
            for shard, a, b in split_samples(
                sizes,
                seed=3,
                epoch=epoch,
                rank=r,
                world_size=world,
                worker_id=w,
                num_workers=workers,
                shuffle=shuffle,
            )  # fmt: skip
            for p in range(a, b)
        ]
        for r in range(world)
        for w in range(workers)
    }


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("world,workers", [(1, 1), (2, 1), (2, 2), (3, 4), (4, 3), (7, 2)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_split_samples_gives_every_rank_and_worker_equal_disjoint_shares(
    sizes, world, workers, shuffle
):
    n = sum(sizes)
    if n < world:
        pytest.skip("fewer samples than ranks: refused (below)")
    for epoch in (0, 1):
        parts = _samples(sizes, epoch, world, workers, shuffle)
        per_worker = {w: {len(parts[r, w]) for r in range(world)} for w in range(workers)}
        # worker w yields as many samples on every rank: every rank, as many batches
        assert all(len(counts) == 1 for counts in per_worker.values()), per_worker
        counts = [len(p) for p in parts.values()]
        assert max(counts) - min(counts) <= 1
        seen = [s for p in parts.values() for s in p]
        assert len(seen) == len(set(seen))  # disjoint: each sample at most once
        assert all(0 <= pos < sizes[shard] for shard, pos in seen)
        # the rule: each rank n // world, the remainder (fewer than the ranks) unread
        assert len(seen) == n // world * world and n - len(seen) < world


def test_split_samples_reads_whole_shards_but_at_the_shares_edges():
    sizes = [100] * 10 + [1]
    parts = [
        split_samples(sizes, seed=0, epoch=0, rank=r, world_size=2, worker_id=w, num_workers=2)
        for r in range(2)
        for w in range(2)
    ]
    split = {s for p in parts for s, a, b in p if (a, b) != (0, sizes[s])}
    assert len(split) <= 2 * 2 - 1 + 1  # at the 3 edges between 4 shares, and the tail dropped
    assert max(len(p) for p in parts) <= 4  # long sequential runs, not scattered samples


def test_split_samples_ranks_step_in_lockstep_where_whole_shards_do_not():
    sizes = [100] * 10 + [1]
    by_shards = rank_counts_by_shards(sizes, seed=0, epoch=0, world_size=2)
    assert len(set(by_shards)) == 2 and sum(by_shards) == 1001  # the hang of issue 38
    counts = [
        sum(b - a for _, a, b in split_samples(sizes, seed=0, epoch=0, rank=r, world_size=2))
        for r in range(2)
    ]
    assert counts == [500, 500]


def test_split_samples_changes_with_epoch_and_is_deterministic():
    sizes = [10] * 7
    assert _samples(sizes, 1, 2, 2) == _samples(sizes, 1, 2, 2)
    assert _samples(sizes, 1, 2, 2) != _samples(sizes, 2, 2, 2)
    unread = [set(), set()]
    for epoch in range(2):
        seen = {s for p in _samples(sizes, epoch, 3, 1).values() for s in p}
        unread[epoch] = {(k, p) for k in range(7) for p in range(10)} - seen
    assert len(unread[0]) == len(unread[1]) == 70 % 3 and unread[0] != unread[1]


def test_split_samples_refuses_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="3 sample\\(s\\) cannot be split over 4 ranks"):
        split_samples([2, 1], seed=0, epoch=0, rank=0, world_size=4)
    assert split_samples([], seed=0, epoch=0, rank=1, world_size=2) == []
