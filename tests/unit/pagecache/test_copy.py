"""pagecache/copy.py: a batch's large rows copied on several threads, only where that pays."""

import os
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from unit_sources import write_arrays

import gpufeed
from gpufeed.loading.workers import WorkerInit
from gpufeed.pagecache import copy as rowcopy
from gpufeed.pagecache.copy import PARALLEL_COPY_MIN_BYTES, copy_buffers, copy_threads, take_rows

ROW = PARALLEL_COPY_MIN_BYTES  # the smallest row copied on several threads


@pytest.fixture
def copiers(monkeypatch):
    """The threads each part of a copy ran on (its first index): rowcopy._take recorded,
    with two copy threads whatever this machine has."""
    seen = []
    real = rowcopy._take

    def take(data, indices, out):
        seen.append((int(indices[0]), threading.get_ident()))
        return real(data, indices, out)

    monkeypatch.setattr(rowcopy, "_take", take)
    monkeypatch.setattr(rowcopy, "copy_threads", lambda: 2)
    _helpers_start_at_once(monkeypatch)
    return seen


def _helpers_start_at_once(monkeypatch):
    """A helper's part is handed over only once the helper runs: else the caller, done with
    its own part first, copies the part itself (as it should), and which thread copied what
    would be a race."""
    real_submit = rowcopy._HELPERS.submit
    monkeypatch.setattr(
        rowcopy._HELPERS, "submit", lambda fn, *a: _started(real_submit, threading.Event(), fn, *a)
    )


def rows(n: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, width), dtype=np.uint8)


def test_large_rows_in_memory_are_split_between_two_threads(copiers):
    data = rows(40, ROW)
    idx = np.array([39, 0, 7, 7, 23, 5, 11], dtype=np.int64)
    out = np.empty((len(idx), ROW), dtype=np.uint8)
    assert take_rows(data, idx, out) is out
    np.testing.assert_array_equal(out, data[idx])
    assert [first for first, _ in sorted(copiers)] == [7, 39]  # two halves: [:3] and [3:]
    assert len({thread for _, thread in copiers}) == 2


def test_small_rows_are_copied_by_the_calling_thread(copiers):
    data = rows(40, ROW // 2)
    idx = np.arange(40)[::-1].copy()
    out = np.empty((40, ROW // 2), dtype=np.uint8)
    take_rows(data, idx, out)
    np.testing.assert_array_equal(out, data[idx])
    assert copiers == [(39, threading.get_ident())]


def test_one_row_is_copied_by_the_calling_thread(copiers):
    data = rows(4, ROW)
    out = np.empty((1, ROW), dtype=np.uint8)
    take_rows(data, np.array([2]), out)
    np.testing.assert_array_equal(out[0], data[2])
    assert copiers == [(2, threading.get_ident())]


def test_rows_of_a_mapped_file_not_in_the_page_cache_are_copied_by_one_thread(
    tmp_path, copiers, evict
):
    path = tmp_path / "rows.bin"
    want = rows(16, ROW, seed=3)
    want.tofile(path)
    evict(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", shape=want.shape).view(np.ndarray)
    idx = np.array([1, 9, 14, 4])
    out = np.empty((4, ROW), dtype=np.uint8)
    take_rows(data, idx, out)
    np.testing.assert_array_equal(out, want[idx])
    assert copiers == [(1, threading.get_ident())]
    copiers.clear()
    take_rows(data, idx, out)  # now cached: split
    assert len(copiers) == 2


def test_a_part_whose_thread_has_not_started_is_copied_by_the_caller(copiers, monkeypatch):
    never_started = []

    def submit(fn, *args):
        never_started.append(Future())  # pending: cancel() succeeds, as for a queued job
        return never_started[-1]

    monkeypatch.setattr(rowcopy._HELPERS, "submit", submit)
    data = rows(10, ROW)
    idx = np.arange(10)[::-1].copy()
    out = np.empty((10, ROW), dtype=np.uint8)
    take_rows(data, idx, out)
    np.testing.assert_array_equal(out, data[idx])
    assert len(never_started) == 1 and never_started[0].cancelled()
    assert {thread for _, thread in copiers} == {threading.get_ident()}


def test_an_error_in_a_helper_thread_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(rowcopy, "copy_threads", lambda: 2)
    real = rowcopy._take
    caller = threading.get_ident()

    def take(data, indices, out):
        if threading.get_ident() != caller:
            raise MemoryError("helper failed")
        return real(data, indices, out)

    monkeypatch.setattr(rowcopy, "_take", take)
    data = rows(8, ROW)
    _helpers_start_at_once(monkeypatch)
    with pytest.raises(MemoryError, match="helper failed"):
        take_rows(data, np.arange(8), np.empty((8, ROW), dtype=np.uint8))


def _started(submit, event, fn, *args):
    def run(*a):
        event.set()
        return fn(*a)

    future = submit(run, *args)
    assert event.wait(10)
    return future


def test_copy_threads_bounded_by_the_loaders_cpus(monkeypatch):
    monkeypatch.setattr(rowcopy.sysinfo, "loader_cpus", lambda: (64, "test"))
    assert copy_threads() == rowcopy.COPY_THREADS
    monkeypatch.setattr(rowcopy.sysinfo, "loader_cpus", lambda: (1, "test"))
    assert copy_threads() == rowcopy.COPY_THREADS  # read once per process
    rowcopy.sysinfo._process_loader_cpus.cache_clear()
    assert copy_threads() == 1


class _ThreadsSeen(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return copy_threads()


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_make_loaders_workers_copy_on_their_own_thread(context, monkeypatch):
    monkeypatch.setattr(rowcopy.sysinfo, "process_loader_cpus", lambda: 2)  # this process: two
    assert copy_threads() == 2
    init = WorkerInit(0, SimpleNamespace(value=0), 0, None)  # what make_loader's workers run
    loader = torch.utils.data.DataLoader(
        _ThreadsSeen(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context=context,
        worker_init_fn=init,
    )
    assert list(loader) == [1, 1]
    assert copy_threads() == 2  # told to the worker, not to this process


def _threads_seen(sample):
    return torch.tensor(copy_threads())


@pytest.mark.slow
def test_a_packs_dataset_in_a_plain_dataloaders_worker_copies_on_its_own_thread(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(rowcopy.sysinfo, "process_loader_cpus", lambda: 2)
    write_arrays(tmp_path / "src", {"x": 2, "y": 2}, shape=(4,), seed=1)
    gpufeed.pack(tmp_path / "src", tmp_path / "ds.mmap", format="mmap", workers=1, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "ds.mmap", transform=_threads_seen)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    assert [x.tolist() for x, _ in loader] == [[1, 1], [1, 1]]


@pytest.mark.slow
def test_a_tar_stream_in_a_plain_dataloaders_worker_copies_on_its_own_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(rowcopy.sysinfo, "process_loader_cpus", lambda: 2)
    write_arrays(tmp_path / "src", {"x": 2, "y": 2}, shape=(4,), seed=1)
    gpufeed.pack(tmp_path / "src", tmp_path / "ds.tar", format="tar", workers=1, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "ds.tar", map_style=False, transform=_threads_seen)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=2, num_workers=1, multiprocessing_context="fork"
    )
    assert [x.tolist() for x, _ in loader] == [[1, 1], [1, 1]]


def test_copy_buffers_fills_rows_on_two_threads_when_large(copiers_of_buffers):
    values = [bytes(rows(1, ROW, seed=s)[0]) for s in range(5)]
    out = np.empty((5, ROW // 4), dtype=np.int32)  # the bytes land whatever the dtype
    assert copy_buffers(values, out) is out
    assert out.tobytes() == b"".join(values)
    assert sorted(first for first, _ in copiers_of_buffers) == [0, 2]


def test_copy_buffers_of_small_values_stays_on_the_calling_thread(copiers_of_buffers):
    values = [bytes([k]) * 100 for k in range(6)]
    out = np.empty((6, 100), dtype=np.uint8)
    copy_buffers(values, out)
    assert out.tobytes() == b"".join(values)
    assert copiers_of_buffers == [(0, threading.get_ident())]


@pytest.fixture
def copiers_of_buffers(monkeypatch):
    """The threads each part of copy_buffers ran on (its first position), two copy threads."""
    seen = []
    real = rowcopy._assign

    def assign(buffers, a, b, out):
        seen.append((a, threading.get_ident()))
        return real(buffers, a, b, out)

    monkeypatch.setattr(rowcopy, "_assign", assign)
    monkeypatch.setattr(rowcopy, "copy_threads", lambda: 2)
    _helpers_start_at_once(monkeypatch)
    return seen


@pytest.mark.parametrize("fmt", ["lmdb", "tar", "mmap", "hdf5"])
def test_large_samples_read_back_exactly_through_each_format(
    tmp_path, fmt, copiers, copiers_of_buffers
):
    """Samples of 64 KiB: the copy on two threads (tar: rows of its shards' maps; LMDB:
    its values), in any order, equal what was packed."""
    from unit_sources import write_arrays

    import gpufeed
    from gpufeed.formats.manifest import read_sources
    from gpufeed.formats.open import open_reader

    paths = write_arrays(tmp_path / "src", {"a": 6, "b": 6}, shape=(4, 128, 128), seed=4)
    dest = tmp_path / f"ds.{fmt}"
    shards = {"shard_size": 5} if fmt == "tar" else {}  # tar: a batch across shards
    gpufeed.pack(tmp_path / "src", dest, format=fmt, workers=1, quiet=True, **shards)
    reader = open_reader(dest)
    want = {os.path.relpath(p, tmp_path / "src"): np.load(p) for p in paths}
    sources = read_sources(dest / "sources.txt")
    order = np.array([11, 0, 5, 5, 7, 2, 9])
    got = reader.read_batch(order)
    assert len(got) == len(order)
    for j, i in enumerate(order.tolist()):
        assert np.array_equal(np.asarray(got[j]), want[sources[i]]), (fmt, i)
    threads = {thread for _, thread in copiers + copiers_of_buffers}
    assert len(threads) == 2, "the pack was just written (cached): two threads copy"
