"""The read-ahead as one explicit plan (gpufeed.pagecache.plan): make_loader builds it once
and gives it to the batch sampler; each batch carries one BatchReadAhead, which the dataset
hands to the reader's one entry (Reader.read_ahead_batch)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

import gpufeed
from gpufeed.data.samplers import BlockShuffleSampler, LookaheadBatch, SortedBatchSampler
from gpufeed.pagecache.plan import NO_READ_AHEAD, BatchReadAhead, ReadAheadPlan


def test_a_sampler_made_with_a_plan_yields_each_batch_its_hints():
    order = list(range(20))[::-1]
    plain = list(SortedBatchSampler(order, 4))
    sampler = SortedBatchSampler(order, 4, read_ahead=ReadAheadPlan(lookahead=1))
    got = list(sampler)
    assert [list(b) for b in got] == plain
    assert all(isinstance(b.read_ahead, BatchReadAhead) for b in got)
    assert [b.read_ahead.ahead for b in got] == [*plain[1:], None]
    assert all(b.read_ahead.ranges is None for b in got)
    back = pickle.loads(pickle.dumps(got[0]))  # what a DataLoader worker receives
    assert back.read_ahead == got[0].read_ahead and list(back) == plain[0]


def test_the_plan_is_given_not_patched_on():
    sampler = SortedBatchSampler(list(range(8)), 4)
    assert sampler.read_ahead is NO_READ_AHEAD and sampler.lookahead == 0
    with pytest.raises(AttributeError):
        sampler.lookahead = 2  # read from the plan: set a plan instead
    with pytest.raises(dataclasses.FrozenInstanceError):
        sampler.read_ahead.lookahead = 2
    plan = ReadAheadPlan(lookahead=2, range_block=4)
    sampler.set_read_ahead(plan)
    assert sampler.read_ahead is plan and (sampler.lookahead, sampler.range_block) == (2, 4)


class _Given(SortedBatchSampler):
    """A batch sampler that records the plans it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: list[ReadAheadPlan] = []

    def set_read_ahead(self, plan: ReadAheadPlan) -> None:
        self.given.append(plan)
        super().set_read_ahead(plan)


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
def test_make_loader_builds_the_plan_once_from_the_reader_and_the_sampler(
    array_folder, tmp_path, fmt
):
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True)
    ds = gpufeed.open_dataset(dest)
    order = BlockShuffleSampler(len(ds), block_size=2, buffer_blocks=4, seed=1)
    batches = _Given(order, 4)
    loader = gpufeed.make_loader(ds, batch_sampler=batches, num_workers=0)
    assert loader.batch_sampler is batches
    assert len(batches.given) == 1  # once, by make_loader, not per epoch
    plan = batches.given[0]
    assert batches.read_ahead is plan
    assert plan == ReadAheadPlan(lookahead=2, range_block=2, looks_warm=ds.reader.looks_warm)
    assert loader.plan.lookahead == plan.lookahead
    list(loader)
    loader.set_epoch(1)
    list(loader)
    assert len(batches.given) == 1


def test_the_dataset_hands_the_batchs_hints_to_the_reader(array_folder, tmp_path, monkeypatch):
    dest = tmp_path / "ds.mmap"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    ds = gpufeed.open_dataset(dest)
    asked = []
    monkeypatch.setattr(ds.reader, "read_ahead", lambda idx: asked.append(("ahead", idx)))
    monkeypatch.setattr(ds.reader, "read_ahead_ranges", lambda r: asked.append(("ranges", r)))
    want = ds.get_batch([0, 1])
    hints = BatchReadAhead(ahead=[-1, 2], ranges=[(4, 6)])
    got = ds.get_batch(LookaheadBatch([0, 1], hints))
    assert got.labels.tolist() == want.labels.tolist()
    assert [k for k, _ in asked] == ["ahead", "ranges"]
    n = len(ds)
    assert asked[0][1].tolist() == [n - 1, 2]  # checked as the batch's are: negatives wrapped
    assert asked[1][1] == [(4, 6)]
    with pytest.raises(IndexError, match=str(dest)):  # a later batch out of range
        ds.get_batch(LookaheadBatch([0], BatchReadAhead(ahead=[n])))


def test_a_multipart_reader_forwards_a_batchs_hints_to_its_parts(tmp_path, monkeypatch):
    from unit_sources import write_arrays

    from gpufeed.formats.open import open_reader

    parts = []
    for k in range(2):
        write_arrays(tmp_path / f"src{k}", {"x": 3, "y": 3}, shape=(4,), seed=k)
        part = tmp_path / f"p{k}.mmap"
        gpufeed.pack(tmp_path / f"src{k}", part, format="mmap", workers=1, quiet=True)
        parts.append(part)
    merged = tmp_path / "all.mmap"
    gpufeed.merge(parts, merged)
    reader = open_reader(merged)
    asked = []
    for k, part in enumerate(reader.parts):
        monkeypatch.setattr(part, "read_ahead", lambda idx, k=k: asked.append((k, idx.tolist())))
        monkeypatch.setattr(
            part, "read_ahead_ranges", lambda r, k=k: asked.append((k, [tuple(x) for x in r]))
        )
    reader.read_ahead_batch(BatchReadAhead(ahead=np.array([1, 7]), ranges=[(4, 8)]))
    assert (0, [1]) in asked and (1, [1]) in asked  # index 7: the second part's 1
    assert (0, [(4, 6)]) in asked and (1, [(0, 2)]) in asked
