"""LMDB records read by their place in data.mdb (lmdb_values.PlacedRecords): only where the
value table describes the environment as it still is, reading what lookups read."""

from __future__ import annotations

import json
import pickle
import shutil

import lmdb
import numpy as np
import pytest
import torch
from unit_sources import write_arrays

import gpufeed
from gpufeed.formats.lmdb import reader as lmdb_format
from gpufeed.formats.lmdb import values as lmdb_values
from gpufeed.formats.open import open_reader

N = 48


@pytest.fixture(scope="module")
def raw_pack(tmp_path_factory):
    """48 samples of 12 KiB (as the suite's raw case)."""
    src = tmp_path_factory.mktemp("raw")
    write_arrays(src, None, count=N, shape=(3, 64, 64), seed=5)
    dest = tmp_path_factory.mktemp("packs") / "raw.lmdb"
    gpufeed.pack(src, dest, format="lmdb", workers=1, quiet=True)
    return dest


@pytest.fixture(scope="module")
def blob_pack(tmp_path_factory):
    """40 records of varying sizes, small and overflowing a page."""
    dest = tmp_path_factory.mktemp("packs") / "blobs.lmdb"
    rng = np.random.default_rng(6)
    with gpufeed.Writer(dest, format="lmdb", schema={"blob": "bytes"}) as w:
        for size in rng.integers(10, 9000, size=40):
            w.write({"blob": rng.bytes(int(size))})
    return dest


def looked_up(dest, indices):
    """What a reader that looks every record up reads (one made without the table)."""
    reader = open_reader(dest)
    reader.manifest = {**reader.manifest, "layout": {}}  # no snapshot: lookups
    assert reader._placed_records(reader.handle) is None
    reader._placed = None
    try:
        return reader.read_batch(indices)
    finally:
        reader.close()


def counted_lookups(monkeypatch) -> list[int]:
    """Records looked up from now on, a count a call."""
    counts: list[int] = []
    real = lmdb_format.keys

    def counted(indices):
        counts.append(len(indices))
        return real(indices)

    monkeypatch.setattr(lmdb_format, "keys", counted)
    return counts


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return [bytes(x) for x in a] == [bytes(x) for x in b]


@pytest.mark.parametrize("pack", ["raw_pack", "blob_pack"])
def test_a_pack_as_written_is_read_by_its_table_without_a_lookup(pack, request, monkeypatch):
    dest = request.getfixturevalue(pack)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert lmdb_values.VALUES_FILE in manifest["files"]
    assert manifest["layout"][lmdb_values.SNAPSHOT]["txnid"] >= 2  # records, then the index
    order = np.random.default_rng(1).permutation(len(open_reader(dest)))
    want = looked_up(dest, order)
    reader = open_reader(dest)
    lookups = counted_lookups(monkeypatch)
    got = reader.read_batch(order)
    assert reader._placed is not None and same(got, want)
    assert lookups == [3]  # the table checked once: three records where LMDB says
    reader.read_ahead(order[:8])  # by the table too
    reader.read_ahead_ranges([(0, 8)])
    assert reader.looks_warm()  # just read: every record cached
    assert lookups == [3]
    again = pickle.loads(pickle.dumps(reader))  # as a spawned worker gets it: checked anew
    assert same(again.read_batch(order), want) and lookups == [3, 3]


def test_the_tutorial_loader_reads_a_placed_pack_in_workers(raw_pack):
    ds = gpufeed.open_dataset(raw_pack)
    want = looked_up(raw_pack, np.arange(N))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False, num_workers=2)
    got = torch.cat([x for x, _ in loader]).numpy()
    np.testing.assert_array_equal(got, want)


def rewrite_record(dest, index: int, value: bytes) -> None:
    env = lmdb.open(str(dest), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"%010d" % index, value)
    env.close()


def test_a_pack_written_to_since_is_read_by_lookups(tmp_path, raw_pack):
    dest = tmp_path / "edited.lmdb"
    shutil.copytree(raw_pack, dest)
    new = bytes(range(256)) * 48  # 12 KiB, as every record: a new place, the same size
    rewrite_record(dest, 7, new)
    reader = open_reader(dest)
    got = reader.read_batch(np.array([6, 7, 8]))
    assert reader._placed is None  # a new transaction: the table is not the pack's now
    assert bytes(got[1]) == new
    assert same(got[[0, 2]], looked_up(raw_pack, np.array([6, 8])))


@pytest.mark.parametrize("compact", [True, False])
def test_a_copy_is_read_by_its_table_only_where_every_page_stayed(tmp_path, raw_pack, compact):
    dest = tmp_path / "copy.lmdb"
    dest.mkdir()
    for name in ("manifest.json", lmdb_values.VALUES_FILE):
        shutil.copy(raw_pack / name, dest / name)
    gpufeed.pagecache.maps.forget_maps()  # the pack's environment closed: LMDB opens it once
    env = lmdb.open(str(raw_pack), subdir=True, readonly=True, lock=False)
    env.copy(str(dest), compact=compact)  # mdb_copy [-c]
    env.close()
    manifest = json.loads((dest / "manifest.json").read_text())
    size = (dest / "data.mdb").stat().st_size
    manifest["files"]["data.mdb"]["bytes"] = size  # the copy's own size, checked at open
    (dest / "manifest.json").write_text(json.dumps(manifest))
    reader = open_reader(dest)
    got = reader.read_batch(np.arange(N))
    assert (reader._placed is None) == compact  # a compacting copy starts at transaction 1
    np.testing.assert_array_equal(got, looked_up(raw_pack, np.arange(N)))


def test_a_table_of_records_not_the_samples_size_is_not_used(tmp_path, raw_pack):
    dest = tmp_path / "short.lmdb"
    shutil.copytree(raw_pack, dest)
    table = np.load(dest / lmdb_values.VALUES_FILE)
    table[5, 1] -= 1
    np.save(dest / lmdb_values.VALUES_FILE, table)
    reader = open_reader(dest)
    got = reader.read_batch(np.arange(N))
    assert reader._placed is None
    np.testing.assert_array_equal(got, looked_up(raw_pack, np.arange(N)))


def test_encoded_records_by_their_place_are_views_of_the_readers_map(tmp_path):
    """Encoded samples (JPEGs) placed: views of the reader's own map, as the mmap reader's
    (a JPEG batch of 256: 0.11 ms against 0.42 ms copied to bytes), the bytes lookups read,
    and still readable once the reader is closed (each view keeps the map alive)."""
    from unit_sources import write_images

    write_images(tmp_path / "src", {"a": 5, "b": 4}, ext=".jpg")
    dest = tmp_path / "jpeg.lmdb"
    gpufeed.pack(tmp_path / "src", dest, format="lmdb", workers=1, quiet=True)
    reader = open_reader(dest)
    idx = np.array([8, 0, 4, 4, 2])
    views = reader.read_batch(idx)
    assert reader.spec.kind == "encoded" and reader._placed is not None
    assert all(isinstance(v, np.ndarray) and not v.flags.owndata for v in views)
    want = [bytes(v) for v in looked_up(dest, idx)]
    assert [v.tobytes() for v in views] == want
    reader.close()
    assert [v.tobytes() for v in views] == want
    ds = gpufeed.open_dataset(dest)
    assert ds[3][0].shape[0] == 3  # decoded as before
