import warnings

import pytest

from gpufeed.data.distributed import rank_and_world, split_shards
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
