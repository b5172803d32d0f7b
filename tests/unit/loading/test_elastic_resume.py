"""Elastic resumption: a loader checkpoint taken with N ranks resumes with M ranks, and the
epoch delivers every sample exactly once over the two runs (N=2 -> 3 and 3 -> 2, explicit
rank/world_size, a local pack)."""

from __future__ import annotations

import numpy as np
import pytest
from unit_sources import write_arrays

from gpufeed.data.open import open_dataset
from gpufeed.loading.make import make_loader
from gpufeed.write.pack import pack


@pytest.fixture(scope="module")
def dataset36(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    write_arrays(root / "src", None, count=36, shape=(4,), seed=7)
    pack(root / "src", root / "p", "mmap", quiet=True)
    return root / "p"


def loader(path, rank, world, **kw):
    ds = open_dataset(path, map_style=True)
    return make_loader(
        ds, 3, shuffle=True, num_workers=0, seed=11, rank=rank, world_size=world,
        distributed=True, block_size=4, **kw,
    )  # fmt: skip


def keys(batch) -> list[bytes]:
    return [s.numpy().tobytes() for s in batch.samples]


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_checkpoint_with_n_ranks_resumes_with_m_ranks(dataset36, before, after):
    everything = sorted(s.numpy().tobytes() for s, _ in open_dataset(dataset36, map_style=True))
    assert len(set(everything)) == 36  # samples tell themselves apart
    seen: list[bytes] = []
    states = []
    for rank in range(before):  # each rank: two steps of 3 samples, then the checkpoint
        first = loader(dataset36, rank, before)
        it = iter(first)
        for _ in range(2):
            seen += keys(next(it))
        states.append(first.state_dict())
    assert len({s["samples_seen"] for s in states}) == 1  # ranks step in lockstep
    shares = []
    for rank in range(after):
        resumed = loader(dataset36, rank, after)
        resumed.load_state_dict(states[0])  # any rank's state describes them all
        share = [k for batch in resumed for k in keys(batch)]
        shares.append(share)
        assert resumed.epoch == 1  # the epoch ran to its end
    rest = [k for share in shares for k in share]
    assert len({len(s) for s in shares}) == 1  # equal shares: DDP never waits on a rank
    assert sorted(seen + rest) == everything  # every sample exactly once


@pytest.mark.parametrize("drop_last", [False, True])
def test_one_process_with_the_defaults_goes_on_from_a_two_rank_checkpoint(dataset36, drop_last):
    """Issue 38 item 13: the default (distributed="auto", one process) resumes a checkpoint
    of 2 ranks; it needed distributed=True."""
    everything = sorted(s.numpy().tobytes() for s, _ in open_dataset(dataset36, map_style=True))
    seen: list[bytes] = []
    states = []
    for rank in range(2):
        first = loader(dataset36, rank, 2, drop_last=drop_last)
        it = iter(first)
        for _ in range(2):
            seen += keys(next(it))
        states.append(first.state_dict())
    alone = make_loader(
        open_dataset(dataset36, map_style=True), 3, shuffle=True, num_workers=0, seed=11,
        block_size=4, drop_last=drop_last,
    )  # fmt: skip
    alone.load_state_dict(states[1])
    rest = [k for batch in alone for k in keys(batch)]
    assert alone.epoch == 1
    assert sorted(seen + rest) == everything  # every sample exactly once (36 = 2 x 6 x 3)


def test_an_iterable_dataset_cannot_change_world_size(dataset36, tmp_path):
    pack_dir = tmp_path / "tar"
    pack(dataset36.parent / "src", pack_dir, "tar", shard_size=6, quiet=True)
    ds = open_dataset(pack_dir, map_style=False)
    a = make_loader(ds, 3, num_workers=0, rank=0, world_size=2)
    state = a.state_dict()
    b = make_loader(open_dataset(pack_dir, map_style=False), 3, num_workers=0, rank=0, world_size=3)
    with pytest.raises(ValueError, match="map-style"):
        b.load_state_dict(state)
    assert np.asarray(state["world_size"]) == 2
