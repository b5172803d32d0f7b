"""Tar streams' reads (issue 16 phase 7): the runs to come populated ahead, bounded, forgotten
when a stream stops early, drained before a fork; fixed-shape samples gathered from a heap
slot pool, every sample once per epoch."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.data import shuffle_buffer as pool_module
from gpufeed.data import streaming
from gpufeed.data.shuffle_buffer import RowPool, SamplePool, SlotPool, make_pool
from gpufeed.formats.open import open_reader
from gpufeed.pagecache import advise as readahead

N = 60


@pytest.fixture(scope="module")
def tar_pack(pack_factory):
    """60 samples uint8 [3, 16, 16] (768 bytes) in shards of 16."""
    return pack_factory("tar", classes={"x": 30, "y": 30}, shape=(3, 16, 16), seed=4, shard_size=16)


def stream(path, **kw):
    kw.setdefault("shuffle_buffer", 10)
    return gpufeed.open_dataset(path, map_style=False, read_size=4, **kw)


def every_label_and_pixel(ds, batch_size=8):
    xs, ys = [], []
    for x, y in ds.iter_batches(batch_size):
        xs.append(x.clone())
        ys.append(y.clone())
    return torch.cat(xs), torch.cat(ys)


def test_slot_pool_hands_out_every_sample_once_in_the_order_drawn():
    pool = SlotPool((2, 3), np.uint8, capacity=10)
    data = np.arange(8 * 6, dtype=np.uint8).reshape(8, 2, 3)
    pool.put(np.arange(4), data[:4])
    idx, got = pool.take(np.array([3, 0]))
    assert idx.tolist() == [3, 0] and np.array_equal(got, data[[3, 0]])
    pool.put(np.arange(4, 8), data[4:])  # into the freed slots and the rest
    assert pool.size == 6
    idx, got = pool.take(np.arange(6))
    assert idx.tolist() == [1, 2, 4, 5, 6, 7]  # positions: the samples held, in put order
    assert np.array_equal(got, data[idx])
    assert pool.size == 0 and len(pool.free) == 10


def test_slot_pool_refuses_a_run_that_overfills_it():
    pool = SlotPool((4,), np.uint8, capacity=3)
    with pytest.raises(ValueError, match="overfills"):
        pool.put(np.arange(4), np.zeros((4, 4), dtype=np.uint8))


def test_pool_kind_follows_the_samples_and_the_buffer_size(monkeypatch):
    rows = np.zeros((4, 3, 8, 8), dtype=np.uint8)
    assert isinstance(make_pool(rows, 100), SlotPool)
    assert isinstance(make_pool([b"jpeg", b"bytes"], 100), SamplePool)
    assert isinstance(make_pool(rows, 100, shuffled=False), SamplePool)
    gather = rows.__getitem__
    assert isinstance(make_pool(rows, 100, gather=gather), RowPool)
    assert isinstance(make_pool(rows, 100, False, gather), SamplePool)  # runs, copied once
    monkeypatch.setattr(pool_module, "SLOT_POOL_MAX_BYTES", 99 * 192)
    assert isinstance(make_pool(rows, 100), SamplePool)  # too big to copy: references


def test_sample_pool_copies_consecutive_rows_of_a_mapped_run_as_one_slice():
    base = np.arange(10 * 7, dtype=np.uint8)
    run = np.lib.stride_tricks.as_strided(base, (10, 5), (7, 1), writeable=False)
    pool = SamplePool()
    pool.put(np.arange(10), run)
    idx, got = pool.take(np.arange(2, 6))  # consecutive: the slice path
    assert idx.tolist() == [2, 3, 4, 5] and np.array_equal(got, run[2:6])
    idx, got = pool.take(np.array([3, 0, 5]))  # scattered: index_select
    assert idx.tolist() == [7, 0, 9] and np.array_equal(got, run[[7, 0, 9]])


def test_sample_pool_of_encoded_runs_pairs_each_index_with_its_bytes():
    pool = SamplePool()
    for start in (100, 200, 300):  # three runs as read, each sample's bytes name its index
        idx = np.arange(start, start + 5)
        pool.put(idx, [f"jpeg-{i}".encode() for i in idx.tolist()])
    seen = []
    for positions in ([14, 0, 7, 3], [1, 9, 2], list(range(8))):
        idx, got = pool.take(np.array(positions))
        assert got == [f"jpeg-{i}".encode() for i in idx.tolist()]
        seen += idx.tolist()
    assert sorted(seen) == [*range(100, 105), *range(200, 205), *range(300, 305)]
    assert pool.size == 0 and not pool.chunks  # every run dropped once handed out


@pytest.mark.parametrize("shuffle_buffer", [0, 10, 200])
def test_every_sample_once_per_epoch_through_either_pool(tar_pack, monkeypatch, shuffle_buffer):
    made = []
    real = streaming.make_pool
    monkeypatch.setattr(streaming, "make_pool", lambda *a: made.append(real(*a)) or made[-1])
    ds = stream(tar_pack, shuffle_buffer=shuffle_buffer, seed=3)
    reader = open_reader(tar_pack)
    want = reader.read_batch(np.arange(N))  # random access: the stored rows
    for epoch in range(2):
        ds.set_epoch(epoch)
        x, y = every_label_and_pixel(ds)
        assert len(y) == N
        order = sorted(range(N), key=lambda j: x[j].numpy().tobytes())
        ref = sorted(range(N), key=lambda j: want[j].tobytes())
        assert all(np.array_equal(x[a].numpy(), want[b]) for a, b in zip(order, ref, strict=True))
        assert torch.equal(torch.sort(y).values, torch.from_numpy(np.sort(reader.labels)))
    # shuffled: gathered from the shards' maps (a local pack, one stride a shard);
    # unshuffled: copied once, as read
    kind = RowPool if shuffle_buffer > 1 else SamplePool
    assert made and all(type(p) is kind for p in made)


@pytest.mark.parametrize("shuffle_buffer", [10, 200])
def test_the_row_pool_gives_the_slot_pools_batches(tar_pack, monkeypatch, shuffle_buffer):
    """The same seed, the same batches in the same order, whichever pool holds them."""
    fast = stream(tar_pack, shuffle_buffer=shuffle_buffer, seed=7)
    slow = stream(tar_pack, shuffle_buffer=shuffle_buffer, seed=7)
    monkeypatch.setattr(slow, "_gather", lambda: None)
    for epoch in range(2):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        got, want = list(fast.iter_batches(8)), list(slow.iter_batches(8))
        assert len(got) == len(want)
        for (x, y), (xs, ys) in zip(got, want, strict=True):
            assert torch.equal(x, xs) and torch.equal(y, ys)


def test_a_row_pool_hands_out_what_its_gather_gives_in_the_order_drawn():
    data = np.arange(8 * 6, dtype=np.uint8).reshape(8, 6)
    pool = RowPool(lambda idx: data[idx])
    pool.put(np.arange(4), None)
    idx, got = pool.take(np.array([3, 0]))
    assert idx.tolist() == [3, 0] and np.array_equal(got, data[[3, 0]])
    pool.put(np.arange(4, 8), None)
    idx, got = pool.take(np.arange(6))
    assert idx.tolist() == [1, 2, 4, 5, 6, 7] and np.array_equal(got, data[idx])
    assert pool.size == 0


def test_a_shuffled_stream_is_seeded(tar_pack):
    a = every_label_and_pixel(stream(tar_pack, seed=5))
    b = every_label_and_pixel(stream(tar_pack, seed=5))
    c = every_label_and_pixel(stream(tar_pack, seed=6))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def announced_runs(ds, monkeypatch, limit):
    """Run the stream with read-ahead windows of ``limit`` bytes: (runs announced, runs
    read, bytes announced and not yet read before each read)."""
    monkeypatch.setattr(streaming, "STREAM_AHEAD_BYTES", limit)
    reader = ds.reader
    announced, read, in_flight = [], [], []
    real_ahead, real_run = reader.read_runs_ahead, reader._read_run

    def read_runs_ahead(runs):
        announced.extend((int(a), int(b)) for a, b in runs)
        real_ahead(runs)

    def read_run(first, last):
        read.append(first)
        later = [(a, b) for a, b in announced if a not in read]
        in_flight.append(sum(reader.run_bytes(a, b) for a, b in later))
        return real_run(first, last)

    monkeypatch.setattr(reader, "read_runs_ahead", read_runs_ahead)
    monkeypatch.setattr(reader, "_read_run", read_run)
    return announced, read, in_flight


def test_read_ahead_announces_each_run_once_in_order_within_its_window(tar_pack, monkeypatch):
    ds = stream(tar_pack)
    run = ds.reader.run_bytes(0, 8)  # runs of max(read_size, batch size) samples
    announced, read, in_flight = announced_runs(ds, monkeypatch, 2 * run)
    every_label_and_pixel(ds, batch_size=8)
    firsts = [a for a, _ in announced]
    assert len(firsts) == len(set(firsts)) == len(read) - 1  # all but the first run
    assert firsts == read[1:]  # in the order read
    assert max(in_flight) <= 2 * run + run  # bounded: the window, plus one run past it
    assert max(in_flight) >= 2 * run  # and filled
    assert ds.reader.ahead.pending() == 0


def test_read_ahead_populates_the_runs_spans_on_the_threads(tar_pack, monkeypatch):
    populated = []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)

    def work(addr, n):
        return populated.append(threading.current_thread())

    monkeypatch.setattr(readahead, "populate", work)
    monkeypatch.setattr(readahead, "ask", work)  # the threads' jobs
    ds = stream(tar_pack, shuffle_buffer=0)
    x, _ = every_label_and_pixel(ds)
    assert len(x) == N and populated
    assert any(t is not threading.main_thread() for t in populated)
    assert ds.reader.ahead.pending() == 0


def test_a_warm_stream_submits_no_read_ahead_job(tar_pack, monkeypatch):
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: True)
    submitted = []
    monkeypatch.setattr(readahead.Background, "submit", lambda self, *a: submitted.append(a))
    every_label_and_pixel(stream(tar_pack))
    assert submitted == []


def _stream_waiting_on_its_runs_ahead(tar_pack, monkeypatch):
    """(dataset, its batches after the first, the gate that lets its read-ahead jobs end):
    a cold stream whose runs ahead are held in the read-ahead threads."""
    gate = threading.Event()
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)

    def work(*_):
        return gate.wait(10)

    monkeypatch.setattr(readahead, "populate", work)
    monkeypatch.setattr(readahead, "ask", work)  # the threads' jobs
    ds = stream(tar_pack, shuffle_buffer=0)
    batches = ds.iter_batches(4)
    next(batches)
    return ds, batches, gate


@pytest.mark.slow
def test_a_stream_stopped_early_forgets_its_runs_ahead(tar_pack, monkeypatch):
    ds, batches, gate = _stream_waiting_on_its_runs_ahead(tar_pack, monkeypatch)
    assert ds.reader.ahead.pending() > 0
    gate.set()
    batches.close()
    assert ds.reader.ahead.pending() == 0
    ds.reader.close()
    assert ds.reader.ahead.background._pool is None


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_fork_mid_stream_drains_the_read_ahead(tar_pack, monkeypatch):
    ds, batches, gate = _stream_waiting_on_its_runs_ahead(tar_pack, monkeypatch)
    ahead = ds.reader.ahead
    assert ahead.pending() > 0 and ahead.background._pool is not None
    threading.Timer(0.2, gate.set).start()  # the running job ends; the fork waits for it
    pid = os.fork()
    if pid == 0:
        ahead.ready_blocks([0])  # a child's first call: the parent's jobs are not its own
        os._exit(0 if ahead.pending() == 0 and ahead.background._pool is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ahead.background._pool is None  # drained before the fork
    rest = sum(len(y) for _, y in batches)  # the cancelled runs are read by the stream itself
    assert rest == N - 4 and ahead.pending() == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_over_the_stream_reads_every_sample_once(tar_pack, workers):
    ds = stream(tar_pack, seed=1)
    loader = gpufeed.make_loader(ds, 8, shuffle=True, seed=1, num_workers=workers)
    labels = torch.cat([y for _, y in loader])
    assert len(labels) == N
    assert torch.equal(torch.sort(labels).values, torch.from_numpy(np.sort(ds.reader.labels)))
