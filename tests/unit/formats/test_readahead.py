"""Reading large samples ahead: madvise(WILLNEED) really fills the page cache, batches carry the
batch after them to the reader, and what the loader yields does not change."""

from __future__ import annotations

import mmap
import os
import pickle
import time

import numpy as np
import pytest
import torch
from unit_sources import evict, resident_pages, write_arrays

import gpufeed
from gpufeed.data.samplers import LookaheadBatch, SortedBatchSampler
from gpufeed.formats.open import open_reader
from gpufeed.pagecache.advise import (
    READ_AHEAD_MIN_BYTES,
    BlocksAhead,
    advise_rows,
    looks_cached,
)
from gpufeed.pagecache.copy import take_rows
from gpufeed.pagecache.plan import NO_READ_AHEAD, ReadAheadPlan

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]
ROW = 128 << 10  # one sample: 128 KiB, above READ_AHEAD_MIN_BYTES


def test_take_rows_equals_fancy_indexing():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, (50, 3, 8, 8), dtype=np.uint8)
    idx = np.array([49, 0, 7, 7, 23], dtype=np.int64)
    out = np.empty((len(idx), 3, 8, 8), dtype=np.uint8)
    assert take_rows(data, idx, out) is out
    np.testing.assert_array_equal(out, data[idx])


def test_advise_rows_reads_just_those_rows_into_the_page_cache(tmp_path):
    path = tmp_path / "rows.bin"  # raw, so rows start on page boundaries
    np.ones((64, ROW), dtype=np.uint8).tofile(path)
    os.sync()
    evict(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", shape=(64, ROW))
    per_row = ROW // mmap.PAGESIZE
    if resident_pages(data).reshape(64, per_row).any(axis=1).all():
        pytest.skip(f"{tmp_path}: this filesystem keeps files in memory (tmpfs?)")
    wanted = np.array([40, 3, 17], dtype=np.int64)
    advise_rows(data, wanted)
    deadline = time.monotonic() + 10
    while True:
        rows = resident_pages(data).reshape(64, per_row).all(axis=1)
        if rows[wanted].all() or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert rows[wanted].all(), "the advised rows did not reach the page cache"
    # far from any advised row: left alone (the kernel's own readahead window is < 1 row)
    assert not rows[[10, 30, 55]].any()


def test_advise_rows_leaves_small_rows_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "gpufeed.pagecache.advise.advise_willneed", lambda regions, *_: calls.append(list(regions))
    )
    monkeypatch.setattr("gpufeed.pagecache.advise.looks_cached", lambda *_: False)
    advise_rows(np.zeros((8, READ_AHEAD_MIN_BYTES // 2), np.uint8), np.arange(8))
    assert calls == []
    advise_rows(np.zeros((8, READ_AHEAD_MIN_BYTES), np.uint8), np.array([5, 1]))
    assert [n for _, n in calls[0]] == [READ_AHEAD_MIN_BYTES] * 2


def test_advise_rows_leaves_cached_rows_alone(monkeypatch):
    calls, asked = [], []
    monkeypatch.setattr(
        "gpufeed.pagecache.advise.advise_willneed", lambda regions, *_: calls.append(list(regions))
    )

    def cached(addr, length):
        asked.append((addr, length))
        return True

    monkeypatch.setattr("gpufeed.pagecache.advise.looks_cached", cached)
    data = np.zeros((8, READ_AHEAD_MIN_BYTES), np.uint8)
    advise_rows(data, np.array([5, 1, 6]))
    assert calls == []
    base = data.ctypes.data  # the batch's first and last rows were checked
    assert asked == [(base + 5 * READ_AHEAD_MIN_BYTES, READ_AHEAD_MIN_BYTES)] + [
        (base + 6 * READ_AHEAD_MIN_BYTES, READ_AHEAD_MIN_BYTES)
    ]


def test_lookahead_batches_carry_the_batch_k_later():
    plain = SortedBatchSampler(list(range(23))[::-1], 5)
    ahead = SortedBatchSampler(list(range(23))[::-1], 5, read_ahead=ReadAheadPlan(lookahead=2))
    want = list(plain)
    got = list(ahead)
    assert [list(b) for b in got] == want
    assert all(isinstance(b, LookaheadBatch) for b in got)
    assert [b.ahead for b in got] == [want[2], want[3], want[4], None, None]
    back = pickle.loads(pickle.dumps(got[1]))  # what a DataLoader worker receives
    assert list(back) == want[1] and back.ahead == want[3]


@pytest.fixture(scope="module")
def large_arrays(tmp_path_factory):
    root = tmp_path_factory.mktemp("large")
    write_arrays(root, {"x": 12, "y": 12}, shape=(2, 256, 256), seed=3)  # 128 KiB each
    return root


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_read_ahead_is_a_hint_that_changes_nothing(large_arrays, tmp_path, fmt):
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(large_arrays, dest, format=fmt, workers=1, quiet=True)
    reader = open_reader(dest)
    assert reader.mean_sample_bytes() == 2 * 256 * 256
    idx = np.array([3, 9, 20], dtype=np.int64)
    before = reader.read_batch(idx)
    reader.read_ahead(idx)
    reader.read_ahead(np.array([0, 23], dtype=np.int64))
    np.testing.assert_array_equal(reader.read_batch(idx), before)


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_reads_the_next_batch_ahead_for_large_samples(
    large_arrays, tmp_path, monkeypatch, fmt, workers
):
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(large_arrays, dest, format=fmt, workers=1, quiet=True)
    asked: list[list[int]] = []
    if workers == 0:
        reader_cls = type(open_reader(dest))
        real = reader_cls.read_ahead
        monkeypatch.setattr(
            reader_cls,
            "read_ahead",
            lambda self, idx: (asked.append(idx.tolist()), real(self, idx)),
        )
    ds = gpufeed.open_dataset(dest)
    loader = gpufeed.make_loader(ds, 4, shuffle=True, seed=5, num_workers=workers)
    assert loader.plan.lookahead == max(1, workers)
    got = [(x.clone(), y.clone()) for x, y in loader]
    loader.set_epoch(0)
    loader.batch_sampler.set_read_ahead(NO_READ_AHEAD)
    want = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got) == len(want) == 6
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
    if workers == 0:
        # every batch but the first was asked for one batch early
        loader.batch_sampler.set_epoch(0)
        order = list(loader.batch_sampler._batches())
        assert asked == order[1:]


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
def test_loader_does_not_read_ahead_small_samples(array_folder, tmp_path, monkeypatch, fmt):
    # not with the switch off
    monkeypatch.setattr("gpufeed.loading.make.READ_AHEAD_RANGES", False)
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True)
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, shuffle=True, num_workers=0)
    assert loader.plan.lookahead == 0
    assert not any(isinstance(b, LookaheadBatch) for b in loader.batch_sampler)


def test_loader_does_not_read_blocks_ahead_in_storage_order(array_folder, tmp_path):
    dest = tmp_path / "ds.mmap"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, shuffle=False, num_workers=0)
    assert loader.plan.lookahead == 0 and loader.batch_sampler.range_block == 0
    shuffled = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, shuffle=True, num_workers=0)
    assert shuffled.batch_sampler.range_block > 0


def test_blocks_ahead_reads_one_span_a_range_clipped_to_the_array(monkeypatch):
    data = np.zeros((10, 3, 4), np.uint8)  # rows of 12 bytes: small rows count too
    ahead = BlocksAhead()
    ahead.cached = lambda *_: False
    spans: list = []
    monkeypatch.setattr(ahead.background, "submit", lambda fn, *span: spans.append(span))
    ahead.announce_ranges(data, None, [(2, 5), (8, 16), (12, 14)])
    base = data.ctypes.data
    assert spans == [(base + 24, 36), (base + 96, 24)]


def test_range_batches_announce_each_block_once_a_window_early():
    order = np.random.default_rng(1).permutation(100)
    plain = SortedBatchSampler(order.tolist(), 8)
    want = list(plain)

    s = SortedBatchSampler(order.tolist(), 8, read_ahead=ReadAheadPlan(lookahead=3, range_block=10))
    got = list(s)
    assert [list(b) for b in got] == want
    announced = [r for b in got for r in (b.ranges or [])]
    assert len(announced) == len(set(announced)) == 10  # every block, once
    flat = [i for b in want for i in b]
    first_read = sorted(
        {i // 10 * 10 for i in flat},
        key=lambda a: min(k for k, i in enumerate(flat) if i // 10 * 10 == a),
    )
    assert [a for a, _ in announced] == first_read  # asked for in the order first read
    assert all(a % 10 == 0 and b == a + 10 for a, b in announced)
    for j, batch in enumerate(want):
        early = {r for b in got[: max(0, j - 3) + 1] for r in (b.ranges or [])}
        # each block a batch reads was announced with the batch 3 places earlier or before
        assert {((i // 10) * 10, (i // 10) * 10 + 10) for i in batch} <= early
    back = pickle.loads(pickle.dumps(got[0]))  # what a DataLoader worker receives
    assert list(back) == want[0] and back.ranges == got[0].ranges and back.ahead is None


@pytest.mark.parametrize("fmt", ["mmap", "hdf5"])
def test_reader_read_ahead_ranges_populates_the_ranges_bytes(tmp_path, monkeypatch, fmt):
    src = tmp_path / "src"
    write_arrays(src, {"x": 6, "y": 6}, shape=(3, 64, 64), seed=4)  # 12 KiB, as the raw case
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(src, dest, format=fmt, workers=1, quiet=True)
    reader = open_reader(dest)
    calls = []
    monkeypatch.setattr("gpufeed.pagecache.advise.looks_cached", lambda *_: False)
    n, row = reader.count, int(reader.mean_sample_bytes())
    before = reader.read_batch(np.arange(n, dtype=np.int64))
    monkeypatch.setattr(reader.ahead.background, "submit", lambda fn, *span: calls.append(span))
    reader.read_ahead_ranges([(0, 2), (n - 1, n + 5)])
    if fmt == "hdf5" and not isinstance(reader.handle, np.ndarray):
        assert calls == []  # read through h5py: nothing to populate
    else:
        assert [length for _, length in calls] == [2 * row, row]
    reader.ahead.drain()  # the recorded jobs are no futures
    np.testing.assert_array_equal(reader.read_batch(np.arange(n, dtype=np.int64)), before)


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_reads_blocks_ahead_for_small_samples(
    array_folder, tmp_path, monkeypatch, workers, fmt
):
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True)
    asked: list = []
    reader_cls = type(open_reader(dest))
    real = reader_cls.read_ahead_ranges
    monkeypatch.setattr(
        reader_cls, "read_ahead_ranges", lambda self, r: (asked.append(list(r)), real(self, r))
    )
    monkeypatch.setattr(reader_cls, "looks_warm", lambda self: False)  # the pack just written
    ds = gpufeed.open_dataset(dest)
    loader = gpufeed.make_loader(
        ds, 4, shuffle=True, seed=5, num_workers=workers, block_size=2, buffer_blocks=4
    )
    assert loader.batch_sampler.range_block == 2
    assert loader.plan.lookahead == max(2, workers)  # a window: 2 x 4 indices, 2 batches
    got = [(x.clone(), y.clone()) for x, y in loader]
    loader.set_epoch(0)
    loader.batch_sampler.set_read_ahead(NO_READ_AHEAD)
    want = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got) == len(want) and len(got) > 1
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)
    if workers == 0:
        blocks = sorted(r for call in asked for r in call)
        assert blocks == [(k, k + 2) for k in range(0, len(ds), 2)]


def test_looks_cached_tells_an_evicted_range_from_a_read_one(tmp_path):
    path = tmp_path / "rows.bin"
    np.ones((16, ROW), dtype=np.uint8).tofile(path)
    os.sync()
    evict(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    # no read-around: a fault reads its own page (hosts with a large read_ahead_kb read
    # the whole 2 MiB file around the first fault otherwise)
    mapped.madvise(mmap.MADV_RANDOM)
    data = np.frombuffer(mapped, dtype=np.uint8).reshape(16, ROW)
    if resident_pages(data).any():
        pytest.skip(f"{tmp_path}: this filesystem keeps files in memory (tmpfs?)")
    assert not looks_cached(data.ctypes.data, data.nbytes)
    assert int(np.asarray(data[:4]).sum()) == 4 * ROW  # read the first 4 rows
    assert looks_cached(data.ctypes.data, 4 * ROW)
    assert not looks_cached(data.ctypes.data, data.nbytes)  # its middle and end are not
