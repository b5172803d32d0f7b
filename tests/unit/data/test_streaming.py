"""The streamed tar dataset (gpufeed.data.streaming) under several ranks: every rank reads the
same number of samples and batches, with and without DataLoader workers, whatever the shard
layout (issue 38: 11 shards of 1001 samples gave ranks 600 and 401, and DDP hung)."""

import warnings

import numpy as np
import pytest
from torch.utils.data import DataLoader

import gpufeed
from gpufeed.errors import ShardSplitWarning, UsageError

N, SHARD, BATCH = 1001, 100, 16  # 11 shards: 10 of 100 and one of 1


@pytest.fixture(scope="module")
def eleven(tmp_path_factory):
    dest = tmp_path_factory.mktemp("stream") / "tar"
    with gpufeed.Writer(dest, format="tar", shard_size=SHARD) as w:
        for i in range(N):
            w.write({"i": np.array([i], dtype=np.int64)})
    return dest


def _rank(path, rank, **kw):
    return gpufeed.open_dataset(path, map_style=False, rank=rank, world_size=2, **kw)


def _epoch(loader) -> list[list[int]]:
    return [b["i"].flatten().tolist() for b in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_rank_gets_the_same_batches_from_uneven_shards(eleven, num_workers):
    assert len(gpufeed.open_dataset(eleven, map_style=False).shards) == 11
    ranks = [
        _epoch(DataLoader(_rank(eleven, r), batch_size=BATCH, num_workers=num_workers))
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1])  # was 38 and 26 batches: DDP hung
    seen = [i for batches in ranks for b in batches for i in b]
    assert len(seen) == len(set(seen)) == N // 2 * 2  # at most once; one sample left over
    assert set(seen) <= set(range(N))


def test_iter_batches_counts_match_and_len_is_the_share(eleven):
    for drop_last in (False, True):
        counts = {len(list(_rank(eleven, r).iter_batches(BATCH, drop_last))) for r in range(2)}
        assert len(counts) == 1
    assert [len(_rank(eleven, r)) for r in range(2)] == [N // 2, N // 2]


def test_split_shards_keeps_whole_shards_and_warns_naming_the_counts(eleven):
    ds = _rank(eleven, 0, split="shards")
    with pytest.warns(ShardSplitWarning, match=r"\[600, 401\] samples") as caught:
        items = list(ds)
    assert str(eleven) in str(caught[0].message)
    assert len(items) == 600
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rank 1 says nothing: rank 0 speaks for the job
        assert len(list(_rank(eleven, 1, split="shards"))) == 401


def test_an_unknown_split_is_a_usage_error(eleven):
    with pytest.raises(UsageError, match="split='rows'"):
        _rank(eleven, 0, split="rows")


def test_a_stream_of_mixed_size_images_names_the_pack(tmp_path):
    # iter_batches (make_loader's path) said "the images differ in size" without the pack
    from unit_sources import write_images

    write_images(tmp_path / "src", {"a": 3}, size=(82, 71), ext=".jpg")
    write_images(tmp_path / "src", {"b": 3}, size=(40, 60), ext=".jpg", seed=1)
    gpufeed.pack(tmp_path / "src", tmp_path / "tar", format="tar", workers=1, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "tar", map_style=False, shuffle_shards=False)
    with pytest.raises(UsageError, match="differ in size") as err:
        list(ds.iter_batches(6))
    assert str(tmp_path / "tar") in str(err.value)
