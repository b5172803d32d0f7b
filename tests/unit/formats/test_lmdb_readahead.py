"""LMDB blocks read ahead: a block's bytes found on the line the records lie on (no B-tree
lookup a block), populated on background threads, none for cached or stray packs."""

from __future__ import annotations

import os

import numpy as np
import pytest
from unit_sources import write_arrays

import gpufeed
from gpufeed.formats import lmdb as lmdb_format
from gpufeed.formats import open_reader
from gpufeed.formats.readahead import Background, address, looks_cached, populate

N = 64


@pytest.fixture(scope="module")
def raw_pack(tmp_path_factory):
    """64 samples of 12 KiB (as the suite's raw case): LMDB overflow values."""
    src = tmp_path_factory.mktemp("raw")
    write_arrays(src, None, count=N, shape=(3, 64, 64), seed=2)
    dest = tmp_path_factory.mktemp("packs") / "raw.lmdb"
    gpufeed.pack(src, dest, format="lmdb", workers=1, quiet=True)
    return dest


def value_spans(reader) -> list[tuple[int, int]]:
    """(address, length) of every record in this process's map."""
    with reader.handle.begin(buffers=True) as txn:
        return [(address(v), len(v)) for v in map(txn.get, lmdb_format.keys(np.arange(N)))]


def asked_spans(reader, monkeypatch, ranges) -> list[tuple[int, int]]:
    spans: list = []
    monkeypatch.setattr(
        lmdb_format, "populate_ahead", lambda bg, regions, *_: spans.extend(regions)
    )
    reader.prefetch_ranges(ranges)
    return spans


def test_spans_are_the_announced_blocks_records(raw_pack, monkeypatch):
    reader = open_reader(raw_pack)
    ranges = [(0, 16), (32, 48), (56, 72)]  # the last one past the end: clipped
    spans = asked_spans(reader, monkeypatch, ranges)
    assert reader._line is not None and reader._line[1] is not None
    values = value_spans(reader)
    assert len(spans) == 3
    stride = reader._line[1][1]
    for (a, b), (lo, length) in zip(ranges, spans, strict=True):
        b = min(b, N)
        # every record of the block inside its span...
        assert all(
            lo <= values[i][0] <= values[i][0] + values[i][1] <= lo + length for i in range(a, b)
        )
        # ... and not much more: LINE_SLACK records' bytes either side
        assert length <= (b - a + 2 * lmdb_format.LINE_SLACK) * stride
    # records of blocks not announced are in no span
    for i in (23, 24, 25):
        addr, n = values[i]
        assert not any(lo < addr + n and addr < lo + length for lo, length in spans)


def test_records_off_the_line_give_no_line_and_varying_records_no_read_ahead(tmp_path, monkeypatch):
    # small records, then large ones: the anchor in between is far off the line
    dest = tmp_path / "mixed.lmdb"
    with gpufeed.Writer(dest, format="lmdb", schema={"blob": "bytes"}) as w:
        for i in range(40):
            w.write({"blob": bytes(100 if i < 20 else 256 << 10)})
    reader = open_reader(dest)
    with reader.handle.begin(buffers=True) as txn:
        assert lmdb_format.value_line(txn, np.array([0, 20, 36])) is None
        assert lmdb_format.value_line(txn, np.array([20, 28, 36])) is not None  # all large
    assert not reader.reads_ranges_ahead  # records of varying sizes: never read ahead
    assert asked_spans(reader, monkeypatch, [(0, 4), (20, 24), (36, 40)]) == []
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, shuffle=True, num_workers=0)
    assert loader.batch_sampler.range_block == 0


def test_nothing_is_read_ahead_for_a_cached_pack(raw_pack, monkeypatch):
    reader = open_reader(raw_pack)
    submitted = []
    monkeypatch.setattr(Background, "submit", lambda self, fn, *a: submitted.append(a))
    reader.read_batch(np.arange(N, dtype=np.int64))  # every page now cached
    reader.prefetch_ranges([(0, 16), (16, 32), (32, 48), (48, 64)])
    assert submitted == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise (Linux)")
def test_an_evicted_block_is_read_in_by_the_threads_and_reads_the_same(raw_pack, monkeypatch):
    want = open_reader(raw_pack).read_batch(np.arange(N, dtype=np.int64))
    gpufeed.formats.maps.forget_maps()
    fd = os.open(raw_pack / "data.mdb", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    # readahead=False: a lookup reads its own pages only, not the (small) file around them
    reader = open_reader(raw_pack, readahead=False)
    asked: list = []
    real = lmdb_format.populate_ahead
    monkeypatch.setattr(
        lmdb_format,
        "populate_ahead",
        lambda bg, spans, *rest: (asked.extend(spans), real(bg, spans, *rest)),
    )
    reader.prefetch_ranges([(32, 48)])  # the line's anchors: records 0, 32 and 63
    reader.ahead.drain()  # waits for the threads' reads
    (left_alone,) = lmdb_format.line_spans(reader._line[1], [(12, 20)], N)
    if looks_cached(*left_alone):
        pytest.skip("this filesystem keeps files in memory (tmpfs?)")
    assert len(asked) == 1 and looks_cached(*asked[0])
    np.testing.assert_array_equal(reader.read_batch(np.arange(N, dtype=np.int64)), want)
    reader.close()
    assert reader.ahead._pool is None  # drained before the map could close


def test_populate_past_the_end_of_a_file_is_harmless(tmp_path):
    path = tmp_path / "f.bin"
    np.ones(4096 * 3, np.uint8).tofile(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    populate(data.ctypes.data, 4096 * 3)
    populate(data.ctypes.data + 4096, 4096 * 8)  # past the end: an error, no SIGBUS
    assert int(data.sum()) == 4096 * 3


def test_background_works_in_a_forked_child_and_pickles_without_its_pool():
    bg = Background(2)
    done: list = []
    bg.submit(done.append, 1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool was drained before the fork; a new one
        try:
            bg.submit(os.write, w, b"ok")
            bg.drain()
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 2) == b"ok"
    os.close(r)
    bg.drain()
    assert done == [1]
    import pickle

    back = pickle.loads(pickle.dumps(bg))
    assert back.threads == 2 and back._pool is None
