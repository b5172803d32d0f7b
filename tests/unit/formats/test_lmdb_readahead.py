"""LMDB blocks read ahead: a block's bytes found by the pack's value table where it is exact,
else on the line the records lie on (no B-tree lookup a block), populated on background
threads, none for cached or stray packs. Records read by their place: tests/unit/formats/
test_values.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import unit_sources
from unit_sources import write_arrays

import gpufeed
from gpufeed.formats.lmdb import reader as lmdb_format
from gpufeed.formats.lmdb import values as lmdb_values
from gpufeed.formats.open import open_reader
from gpufeed.pagecache.advise import Background, address, looks_cached, populate

N = 64


@pytest.fixture(scope="module")
def raw_pack(tmp_path_factory):
    """64 samples of 12 KiB (as the suite's raw case): LMDB overflow values. Its value
    table's snapshot left out, as in a pack from before it: read by lookups, read ahead by
    the line."""
    src = tmp_path_factory.mktemp("raw")
    write_arrays(src, None, count=N, shape=(3, 64, 64), seed=2)
    dest = tmp_path_factory.mktemp("packs") / "raw.lmdb"
    gpufeed.pack(src, dest, format="lmdb", workers=1, quiet=True)
    return without_snapshot(dest)


def without_snapshot(dest: Path) -> Path:
    """``dest`` as gpufeed wrote it before value tables recorded their snapshot."""
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["layout"][lmdb_values.SNAPSHOT]
    (dest / "manifest.json").write_text(json.dumps(manifest))
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
    reader.read_ahead_ranges(ranges)
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


def mixed_pack(tmp_path) -> Path:
    """40 records of varying sizes: 20 of 100 bytes, then 20 of 8 KiB (small samples: read
    ahead by block)."""
    dest = tmp_path / "mixed.lmdb"
    with gpufeed.Writer(dest, format="lmdb", schema={"blob": "bytes"}) as w:
        for i in range(40):
            w.write({"blob": bytes(100 if i < 20 else 8 << 10)})
    return dest


def test_records_of_varying_sizes_lie_on_no_line_and_are_read_ahead_by_their_table(
    tmp_path, monkeypatch
):
    dest = without_snapshot(mixed_pack(tmp_path))  # the table a hint: read by lookups
    reader = open_reader(dest)
    with reader.handle.begin(buffers=True) as txn:
        # small records, then large ones: the anchor in between is far off the line
        assert lmdb_format.value_line(txn, np.array([0, 20, 36])) is None
        assert lmdb_format.value_line(txn, np.array([20, 28, 36])) is not None  # all large
        values = [(address(v), len(v)) for v in map(txn.get, lmdb_format.keys(np.arange(40)))]
    assert reader.has_value_table and reader.reads_ranges_ahead  # by the pack's value table
    ranges = [(0, 4), (20, 24), (36, 44)]  # the last one past the end: clipped
    spans = asked_spans(reader, monkeypatch, ranges)
    _, lead, _ = reader._fitted_table()  # records a leaf holds: each block from that earlier
    for a, b in ranges:  # every record of an announced block inside a span
        for addr, n in values[max(0, a - lead) : min(b, 40)]:
            assert any(lo <= addr and addr + n <= lo + length for lo, length in spans)
    far = asked_spans(reader, monkeypatch, [(0, 4)])
    addr, n = values[30]
    assert not any(lo < addr + n and addr < lo + length for lo, length in far)
    shuffled = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, True, num_workers=0)
    in_order = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, False, num_workers=0)
    assert shuffled.batch_sampler.range_block > 0  # shuffled epochs only: in storage order
    assert in_order.batch_sampler.range_block == 0  # the kernel's readahead was not measured


def test_a_value_table_that_does_not_fit_the_pack_is_not_used(tmp_path, monkeypatch):
    dest = mixed_pack(tmp_path)
    table = np.load(dest / lmdb_values.VALUES_FILE)
    want = [bytes(v) for v in open_reader(dest).read_batch(np.arange(40))]
    for wrong in (table[:-1], table + [4096, 0], table + [1 << 40, 0]):  # short, moved, past EOF
        np.save(dest / lmdb_values.VALUES_FILE, wrong)
        reader = open_reader(dest)
        assert reader.reads_ranges_ahead and reader._fitted_table() is None
        assert reader._placed is None  # read by lookups
        assert asked_spans(reader, monkeypatch, [(0, 4)]) == []
        assert not reader.looks_warm()
        assert [bytes(v) for v in reader.read_batch(np.arange(40))] == want
        reader.close()


def test_a_pack_without_a_value_table_reads_as_before(tmp_path):
    dest = mixed_pack(tmp_path)
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["files"][lmdb_values.VALUES_FILE]  # a pack from before the table
    (dest / "manifest.json").write_text(json.dumps(manifest))
    (dest / lmdb_values.VALUES_FILE).unlink()
    reader = open_reader(dest)
    assert not reader.has_value_table and not reader.reads_ranges_ahead
    assert len(reader.read_batch(np.arange(40))) == 40
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), 4, True, num_workers=0)
    assert loader.batch_sampler.range_block == 0


def test_the_value_table_says_where_each_record_lies_in_the_file(tmp_path):
    dest = mixed_pack(tmp_path)
    table = np.load(dest / lmdb_values.VALUES_FILE)
    assert table.shape == (40, 2) and table.dtype == np.int64
    data = (dest / "data.mdb").read_bytes()
    reader = open_reader(dest)
    for i, record in enumerate(reader.read_batch(np.arange(40))):
        offset, size = table[i]
        assert data[offset : offset + size] == bytes(record)


def test_lmdb_reads_blocks_ahead_in_storage_order_too(raw_pack):
    # the kernel's readahead streams mmap and HDF5 packs in order (test_readahead), not LMDB's
    loader = gpufeed.make_loader(gpufeed.open_dataset(raw_pack), 4, shuffle=False, num_workers=0)
    assert loader.batch_sampler.range_block == 256 and loader.plan.lookahead >= 1


def record_offsets(dest, count: int) -> list[tuple[int, int]]:
    """Where each of a pack's ``count`` records lies, from the labels' value (any map of
    the file places them alike), and its length. Taken before an eviction: a lookup
    touches the value's pages (py-lmdb), so looking records up after it would read them in."""
    reader = open_reader(dest)
    try:
        with reader.handle.begin(buffers=True) as txn:
            anchor = address(txn.get(lmdb_format.LABELS_KEY))
            values = map(txn.get, lmdb_format.keys(np.arange(count)))
            return [(address(v) - anchor, len(v)) for v in values]
    finally:
        reader.close()


@pytest.mark.parametrize("in_order", [True, False])
def test_storage_order_reads_blocks_ahead_where_the_reader_says_so(tmp_path, monkeypatch, in_order):
    # a pack of its own: pages a live reader of the shared one touched stay mapped, and
    # mapped pages are not evicted
    write_arrays(tmp_path / "src", None, count=N, shape=(3, 64, 64), seed=4)
    raw_pack = tmp_path / "raw.lmdb"
    gpufeed.pack(tmp_path / "src", raw_pack, format="lmdb", workers=1, quiet=True)
    monkeypatch.setattr(lmdb_format.LMDBReader, "reads_ranges_ahead_in_order", in_order)
    first = gpufeed.open_dataset(raw_pack)
    want = [y.clone() for _, y in gpufeed.make_loader(first, 4, num_workers=0)]
    first.close()
    where = record_offsets(raw_pack, N)
    gpufeed.pagecache.maps.forget_maps()
    unit_sources.evict(raw_pack / "data.mdb")
    # readahead=False: a lookup reads its own pages only, not the file around them
    ds = gpufeed.open_dataset(raw_pack, readahead=False)
    loader = gpufeed.make_loader(ds, 4, shuffle=False, block_size=16, num_workers=0)
    assert loader.batch_sampler.range_block == (16 if in_order else 0)
    batches = iter(loader)
    got = [next(batches)[1].clone()]  # records 0-3; every block is within the window
    with ds.reader.handle.begin(buffers=True) as txn:  # the labels' pages only
        anchor = address(txn.get(lmdb_format.LABELS_KEY))

    def later() -> list[bool]:  # records 32-47: a block batches 8-11 read
        return [looks_cached(anchor + offset, n) for offset, n in where[32:48]]

    deadline = time.monotonic() + (10 if in_order else 0.5)
    while not all(later()) and time.monotonic() < deadline:
        time.sleep(0.02)  # the threads' reads (drain would cancel the jobs not started)
    if not in_order and any(later()):
        pytest.skip("this filesystem keeps files in memory (tmpfs?)")
    assert all(later()) if in_order else not any(later())
    got += [y.clone() for _, y in batches]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_nothing_is_read_ahead_for_a_cached_pack(raw_pack, monkeypatch):
    reader = open_reader(raw_pack)
    submitted = []
    monkeypatch.setattr(Background, "submit", lambda self, fn, *a: submitted.append(a))
    reader.read_batch(np.arange(N, dtype=np.int64))  # every page now cached
    reader.read_ahead_ranges([(0, 16), (16, 32), (32, 48), (48, 64)])
    assert submitted == []


def test_an_evicted_block_is_read_in_by_the_threads_and_reads_the_same(raw_pack, monkeypatch):
    want = open_reader(raw_pack).read_batch(np.arange(N, dtype=np.int64))
    gpufeed.pagecache.maps.forget_maps()
    unit_sources.evict(raw_pack / "data.mdb")
    # readahead=False: a lookup reads its own pages only, not the (small) file around them
    reader = open_reader(raw_pack, readahead=False)
    asked: list = []
    real = lmdb_format.populate_ahead
    monkeypatch.setattr(
        lmdb_format,
        "populate_ahead",
        lambda bg, spans, *rest: (asked.extend(spans), real(bg, spans, *rest)),
    )
    reader.read_ahead_ranges([(32, 48)])  # the line's anchors: records 0, 32 and 63
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


def test_a_cold_block_of_varying_records_is_read_in_by_the_value_table(tmp_path):
    dest = tmp_path / "varying.lmdb"
    rng = np.random.default_rng(3)
    with gpufeed.Writer(dest, format="lmdb", schema={"blob": "bytes"}) as w:
        for size in rng.integers(1000, 6000, size=512):  # JPEG-like records, 1.7 MiB
            w.write({"blob": rng.bytes(int(size))})
    table = np.load(dest / lmdb_values.VALUES_FILE)
    data = dest / "data.mdb"
    gpufeed.pagecache.maps.forget_maps()
    unit_sources.evict(data)
    # readahead=False: the reader's own lookups read their pages only, not the file around
    reader = open_reader(dest, readahead=False)

    def cached(first: int, stop: int) -> float:
        return min(unit_sources.resident_share(data, int(o), int(n)) for o, n in table[first:stop])

    if cached(400, 464) > 0:
        pytest.skip("this filesystem keeps files in memory (tmpfs?)")
    reader.read_ahead_ranges([(400, 464)])
    deadline = time.monotonic() + 10
    while cached(400, 464) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # the read-ahead threads' reads
    assert cached(400, 464) == 1  # every record of the block, from the table alone
    assert cached(100, 164) == 0  # a block nobody announced
    reader.close()
