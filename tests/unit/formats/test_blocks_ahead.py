"""Blocks populated ahead (BlocksAhead, mmap and mapped HDF5): a batch waits for or reads
its own blocks before it is copied, never the queue before them; a warm pass submits no
job; forks and closes drain the threads; batches are unchanged."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from unit_sources import write_arrays

import gpufeed
from gpufeed.formats.open import open_reader
from gpufeed.pagecache import advise as readahead
from gpufeed.pagecache import copy as rowcopy
from gpufeed.pagecache.advise import BlocksAhead


def blocks_of(n_blocks: int, block: int = 4, row: int = 8) -> np.ndarray:
    return np.arange(n_blocks * block * row, dtype=np.uint8).reshape(n_blocks * block, row)


def test_a_batch_populates_its_own_queued_block_instead_of_waiting_behind_others(monkeypatch):
    gate, started, done = threading.Event(), threading.Event(), []

    def slow_populate(addr, length):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            gate.wait(10)  # the threads are busy with blocks announced first
        done.append((addr, threading.current_thread() is threading.main_thread()))

    monkeypatch.setattr(readahead, "populate", slow_populate)
    monkeypatch.setattr(readahead, "ask", slow_populate)  # the threads' jobs
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    data = blocks_of(4)
    ahead = BlocksAhead(threads=1)
    ahead.announce_ranges(data, None, [(0, 4), (4, 8), (8, 12), (12, 16)])
    assert started.wait(10)
    ahead.ready(np.array([13, 14]))  # block 12, last in the queue: read here, at once
    assert done == [(data.ctypes.data + 12 * 8, True)]
    gate.set()
    ahead.ready(np.array([1]))  # block 0, running on the thread: waited for
    assert (data.ctypes.data, False) in done
    assert ahead.pending() == 2  # blocks 4 and 8 not asked for yet
    ahead.drain()
    assert ahead.pending() == 0
    assert sum(1 for addr, _ in done if addr == data.ctypes.data + 12 * 8) == 1


def test_the_threads_ask_for_blocks_and_only_a_batch_populates(monkeypatch):
    """A job asks for its block (WILLNEED: reads in flight, nothing mapped); populating
    (waited for, mapped) is left to a batch whose block no thread has started."""
    asked, populated = [], []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    monkeypatch.setattr(
        readahead,
        "advise_willneed",
        lambda regions: asked.extend((a, threading.current_thread().name) for a, _ in regions),
    )
    monkeypatch.setattr(readahead, "populate", lambda addr, n: populated.append(addr))
    data = blocks_of(2)
    ahead = BlocksAhead(threads=1)
    ahead.announce_ranges(data, None, [(0, 4), (4, 8)])
    end = time.monotonic() + 10
    while len(asked) < 2 and time.monotonic() < end:
        time.sleep(0.001)
    ahead.ready(np.arange(8))  # both asked for already: nothing left to populate
    assert [a for a, _ in asked] == [data.ctypes.data, data.ctypes.data + 32]
    assert all(name.startswith("gpufeed-ahead") for _, name in asked)
    assert populated == []
    ahead.drain()


def test_a_streams_runs_are_populated_on_the_threads(monkeypatch):
    """mapped=True (a tar stream's runs, read next and in order): populated, not asked."""
    asked, populated = [], []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    monkeypatch.setattr(readahead, "advise_willneed", lambda regions: asked.extend(regions))
    monkeypatch.setattr(
        readahead, "populate", lambda addr, n: populated.append(threading.current_thread().name)
    )
    data = blocks_of(1)
    ahead = BlocksAhead(threads=1)
    ahead.announce([(0, data.ctypes.data, data.nbytes)], mapped=True)
    end = time.monotonic() + 10
    while not populated and time.monotonic() < end:
        time.sleep(0.001)
    ahead.drain()
    assert asked == [] and populated and populated[0].startswith("gpufeed-ahead")


def test_a_batch_waits_for_its_own_block_running_on_a_thread(monkeypatch):
    gate, finished = threading.Event(), threading.Event()

    def slow_populate(addr, length):
        gate.wait(10)
        finished.set()

    monkeypatch.setattr(readahead, "populate", slow_populate)
    monkeypatch.setattr(readahead, "ask", slow_populate)  # the threads' jobs
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    ahead = BlocksAhead(threads=1)
    ahead.announce_ranges(blocks_of(1), None, [(0, 4)])
    threading.Timer(0.2, gate.set).start()
    ahead.ready(np.array([2]))
    assert finished.is_set()  # ready returned only once the block was in
    ahead.drain()


def test_a_warm_pass_submits_no_job(monkeypatch):
    submitted = []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: True)
    ahead = BlocksAhead()
    monkeypatch.setattr(ahead.background, "submit", lambda *a: submitted.append(a))
    ahead.announce_ranges(blocks_of(4), None, [(0, 4), (4, 8)])
    ahead.ready(np.arange(8))
    assert submitted == [] and ahead.pending() == 0


def test_encoded_samples_are_announced_by_their_offsets(monkeypatch):
    spans = []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    ahead = BlocksAhead()
    monkeypatch.setattr(ahead.background, "submit", lambda fn, *span: spans.append(span))
    data = np.zeros(100, np.uint8)
    offsets = np.array([0, 10, 25, 40, 70, 100])
    ahead.announce_ranges(data, offsets, [(0, 2), (4, 6)])
    base = data.ctypes.data
    assert spans == [(base, 25), (base + 70, 30)]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_fork_drains_the_threads_and_the_child_starts_afresh(monkeypatch):
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)
    ahead = BlocksAhead()
    ahead.announce_ranges(blocks_of(4), None, [(0, 4), (4, 8)])
    pid = os.fork()
    if pid == 0:
        ok = ahead.background._pool is None and (ahead.ready(np.arange(8)) or True)
        ok = ok and ahead.pending() == 0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ahead.background._pool is None  # drained before the fork
    ahead.ready(np.arange(8))  # cancelled jobs: read here instead
    assert ahead.pending() == 0


@pytest.mark.parametrize("fmt", ["mmap", "hdf5"])
def test_a_reader_with_blocks_pending_closes_cleanly(tmp_path, monkeypatch, fmt):
    src = tmp_path / "src"
    write_arrays(src, {"x": 20, "y": 20}, shape=(3, 16, 16), seed=2)
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(src, dest, format=fmt, workers=1, quiet=True)
    reader = open_reader(dest)
    # gpufeed's own HDF5 packs are contiguous, so mapped: the case BlocksAhead serves
    assert isinstance(reader.handle, np.ndarray), type(reader.handle)
    gate = threading.Event()
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)

    def work(*_):
        return gate.wait(10)

    monkeypatch.setattr(readahead, "populate", work)
    monkeypatch.setattr(readahead, "ask", work)  # the threads' jobs
    reader.read_ahead_ranges([(a, a + 4) for a in range(0, 40, 4)])
    assert reader.ahead.pending() == 10
    threading.Timer(0.2, gate.set).start()
    reader.close()  # waits for the running job, cancels the rest
    assert reader.ahead.pending() == 0 and reader.ahead.background._pool is None
    assert reader.read_batch(np.arange(4)).shape == (4, 3, 16, 16)  # reopens


@pytest.mark.parametrize("fmt", ["mmap", "hdf5"])
@pytest.mark.parametrize("workers", [0, 2])
def test_loader_batches_are_unchanged_by_blocks_ahead(tmp_path, monkeypatch, fmt, workers):
    src = tmp_path / "src"
    write_arrays(src, {"x": 30, "y": 30}, shape=(3, 16, 16), seed=3)
    dest = tmp_path / f"ds.{fmt}"
    gpufeed.pack(src, dest, format=fmt, workers=1, quiet=True)
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)  # every block a job

    def epoch(read_ahead: bool):
        monkeypatch.setattr("gpufeed.loading.make.READ_AHEAD_RANGES", read_ahead)
        loader = gpufeed.make_loader(
            gpufeed.open_dataset(dest), 4, shuffle=True, seed=7, num_workers=workers
        )
        assert (loader.batch_sampler.range_block > 0) == read_ahead
        return [(x.clone(), y.clone()) for x, y in loader]

    got, want = epoch(True), epoch(False)
    assert len(got) == len(want) == 15
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_read_batch_makes_its_blocks_ready_before_the_copy(tmp_path, monkeypatch):
    src = tmp_path / "src"
    write_arrays(src, {"x": 10, "y": 10}, shape=(3, 16, 16), seed=5)
    dest = tmp_path / "ds.mmap"
    gpufeed.pack(src, dest, format="mmap", workers=1, quiet=True)
    reader = open_reader(dest)
    order = []
    monkeypatch.setattr(reader.ahead, "ready", lambda idx: order.append(("ready", list(idx))))
    real_take = rowcopy.take_rows
    monkeypatch.setattr(
        "gpufeed.formats.mapped.take_rows",  # the copy of every mapped reader
        lambda *a: (order.append(("copy", None)), real_take(*a))[1],
    )
    reader.read_batch(np.array([3, 9]))
    assert order == [("ready", [3, 9]), ("copy", None)]
