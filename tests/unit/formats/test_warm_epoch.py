"""An epoch whose data is already cached announces no block: before an epoch read ahead by
block, the reader looks at pages spread over its sample bytes (Reader.looks_warm); all cached,
the sampler hands out plain batches (the checks that find each block cached cost a warm
pass 4-7%). A tar stream asks for a run it reads (WILLNEED) only when it is not cached (the
advice walks every page: 6% of a warm stream)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from unit_sources import write_arrays

import gpufeed
from gpufeed.data.samplers import LookaheadBatch, SortedBatchSampler
from gpufeed.formats.open import open_reader
from gpufeed.pagecache import advise as readahead
from gpufeed.pagecache.advise import WARM_PROBES, ask_unless_cached, looks_warm
from gpufeed.pagecache.plan import ReadAheadPlan

FORMATS = ["mmap", "hdf5", "lmdb", "tar"]


def test_looks_warm_checks_single_bytes_spread_over_every_span():
    asked: list[tuple[int, int]] = []
    spans = [(1000, 10), (5000, 0), (8000, 30)]
    assert looks_warm(spans, lambda addr, length: asked.append((addr, length)) or True)
    assert len(asked) == WARM_PROBES and {n for _, n in asked} == {1}
    addrs = [a for a, _ in asked]
    assert addrs[0] == 1000 and addrs[-1] == 8029  # the first and the last byte
    assert all(1000 <= a < 1010 or 8000 <= a < 8030 for a in addrs)
    assert sum(a < 1010 for a in addrs) in (15, 16, 17)  # by bytes: a quarter of them
    assert addrs == sorted(addrs)


def test_looks_warm_stops_at_the_first_cold_page_and_knows_nothing_of_no_bytes():
    asked: list[int] = []
    assert not looks_warm([(0, 1 << 20)], lambda addr, _: asked.append(addr) or len(asked) < 3)
    assert len(asked) == 3
    assert not looks_warm([], lambda *_: True)
    assert not looks_warm([(100, 0)], lambda *_: True)


def test_ask_unless_cached_asks_only_for_ranges_that_are_not(monkeypatch):
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(readahead, "ask", lambda addr, length: asked.append((addr, length)))
    ask_unless_cached(4096, 8192, lambda *_: True)
    ask_unless_cached(4096, 0, lambda *_: False)
    assert asked == []
    ask_unless_cached(4096, 8192, lambda *_: False)
    assert asked == [(4096, 8192)]


def test_a_tar_stream_asks_for_the_runs_it_reads_only_when_they_are_cold(tmp_path, monkeypatch):
    write_arrays(tmp_path / "src", {"x": 16, "y": 16}, shape=(3, 16, 16), seed=5)
    gpufeed.pack(tmp_path / "src", tmp_path / "tar", format="tar", workers=1, quiet=True)
    asked: list[int] = []

    def madvise(addr, length, advice):
        if advice == mmap.MADV_WILLNEED:  # not the read-ahead threads' POPULATE_READ
            asked.append(length)
        return 0

    monkeypatch.setattr(readahead, "_madvise", lambda: madvise)
    stream = gpufeed.open_dataset(tmp_path / "tar", map_style=False)
    want = [b.labels.tolist() for b in stream.iter_batches(8)]
    stream.reader.tell_cached_by(lambda *_: True)
    asked.clear()
    assert [b.labels.tolist() for b in stream.iter_batches(8)] == want
    assert asked == []
    stream.reader.tell_cached_by(lambda *_: False)
    assert [b.labels.tolist() for b in stream.iter_batches(8)] == want
    assert asked and all(n > 0 for n in asked)
    stream.reader.close()


def test_a_warm_epoch_gets_plain_batches_a_cold_one_its_blocks():
    order = np.random.default_rng(3).permutation(64).tolist()
    plain = list(SortedBatchSampler(order, 8))
    told = iter([True, False])
    asked = []
    plan = ReadAheadPlan(
        lookahead=2, range_block=4, looks_warm=lambda: asked.append(1) or next(told)
    )
    sampler = SortedBatchSampler(order, 8, read_ahead=plan)
    warm, cold = list(sampler), list(sampler)
    assert len(asked) == 2  # once an epoch, not once a batch
    assert warm == plain and not any(isinstance(b, LookaheadBatch) for b in warm)
    assert [list(b) for b in cold] == plain
    assert sum(len(b.ranges or ()) for b in cold) == 16  # every block announced


def read(reader, indices: np.ndarray) -> None:
    """Read samples and touch every byte (a tar run comes back as a view of its map)."""
    np.asarray(reader.read_batch(indices)).sum()


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """4096 samples of 12 KiB (the suite's raw case) in each format: 48 MiB, well past the
    kernel's read-around (8 MiB here), so a read of a quarter leaves most pages cold."""
    src = tmp_path_factory.mktemp("src")
    write_arrays(src, {"x": 2048, "y": 2048}, shape=(3, 64, 64), seed=7)
    out = tmp_path_factory.mktemp("packs")
    for fmt in FORMATS:
        gpufeed.pack(src, out / fmt, format=fmt, workers=1, quiet=True)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_reader_looks_warm_once_read_and_cold_once_evicted(packs, fmt, evict):
    dest = packs / fmt
    reader = open_reader(dest)
    everything = np.arange(reader.count, dtype=np.int64)
    read(reader, everything)
    assert reader.looks_warm()
    reader.close()
    evict(dest)
    reader = open_reader(dest)
    if fmt == "hdf5" and not isinstance(reader.handle, np.ndarray):
        assert not reader.looks_warm()  # read through h5py's cache: it cannot tell
        return
    if reader.looks_warm():
        pytest.skip(f"{dest}: cannot evict files here (tmpfs?)")
    read(reader, everything[: reader.count // 4])
    assert not reader.looks_warm()  # a quarter of it: the rest is still to be read
    read(reader, everything)
    assert reader.looks_warm()
    reader.close()


@pytest.mark.parametrize("fmt", ["mmap", "lmdb", "tar"])
def test_make_loader_announces_blocks_only_in_epochs_that_are_not_warm(packs, fmt, evict):
    dest = packs / fmt
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 32, shuffle=True, num_workers=0)
    assert loader.batch_sampler.range_block > 0
    for _ in loader:  # every sample read: the next epoch is warm
        pass
    assert not any(isinstance(b, LookaheadBatch) for b in loader.batch_sampler)
    loader.dataset.reader.close()
    evict(dest)
    if loader.dataset.reader.looks_warm():
        pytest.skip(f"{dest}: cannot evict files here (tmpfs?)")
    batches = list(loader.batch_sampler)
    assert all(isinstance(b, LookaheadBatch) for b in batches)
    assert any(b.ranges for b in batches)


def test_a_chunked_hdf5_pack_is_not_looked_at_nor_opened_to_ask(tmp_path):
    write_arrays(tmp_path / "src", {"x": 4, "y": 4}, shape=(3, 16, 16), seed=9)
    dest = tmp_path / "lzf.hdf5"
    gpufeed.pack(tmp_path / "src", dest, format="hdf5", compression="lzf", workers=1, quiet=True)
    reader = open_reader(dest)
    assert not reader.looks_warm()
    assert reader._h is None  # no HDF5 file opened in the process that forks the workers
    reader.close()
