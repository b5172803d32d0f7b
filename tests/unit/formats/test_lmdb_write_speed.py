"""The LMDB writer's close without a lookup per record: the value table found from data.mdb's
B-tree pages in numpy (lmdb.pages, lmdb.values.paged_table) is the one LMDB's own lookups
give, on packs of tiny, page-sized, overflow and mixed records and of several tree levels;
a file that is not as LMDB writes it, or records that are not the writer's, give no table
(the writer then looks them up); and data.mdb's sha256 is hashed once, from that map, as
the manifest records it."""

from __future__ import annotations

import json

import lmdb
import numpy as np
import pytest
from encoded_parts import encoded_part

import gpufeed
from gpufeed.formats.checksums import sha256_file
from gpufeed.formats.lmdb import pages as lmdb_pages
from gpufeed.formats.lmdb import values as lmdb_values
from gpufeed.formats.lmdb import writer as lmdb_writer
from gpufeed.formats.lmdb.keys import keys
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec

PAGE = 4096


def part(sizes, seed: int = 0) -> Part:
    """Records of these sizes, of random bytes."""
    total = int(np.sum(sizes))
    return encoded_part(np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8), sizes)


def written(tmp_path, sizes, per_part: int = 1000):
    """An LMDB writer fed records of ``sizes`` in parts, its last transaction committed and
    its environment still open (as finish finds it before the table)."""
    w = lmdb_writer.LMDBWriter(tmp_path, SampleSpec("encoded"), None, 0, {})
    for lo in range(0, len(sizes), per_part):
        w.add(part(sizes[lo : lo + per_part], seed=lo))
    w._flush()
    w.env.sync(True)
    return w


def both_tables(w):
    """(the table from the pages, the table from LMDB's lookups) of writer ``w``'s file."""
    m, data = lmdb_pages.mapped(w.current_file)
    try:
        txnid, psize = w.env.info()["last_txnid"], w.env.stat()["psize"]
        paged = lmdb_values.paged_table(data, psize, txnid, w.sizes[: w.n])
        with w.env.begin(buffers=True) as txn:
            looked_up = lmdb_values.value_table(txn, w.n, keys)
        return paged, looked_up
    finally:
        del data
        m.close()


SIZES = {
    "tiny": [1] * 3000,  # ~170 a leaf
    "empty and one byte": [0, 1] * 500,
    "page sized": [PAGE - 200] * 50,  # over a node's most: each on an overflow page
    "node sized": [1800, 2000, 2030, 2040, 2050] * 20,  # either side of the overflow limit
    "overflow": [3 * PAGE + 7, 5 * PAGE] * 30,
    "mixed": np.random.default_rng(0).choice([0, 3, 100, 1000, 2100, 9000, 70_000], 2000),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_table_from_the_pages_is_the_one_lmdb_lookups_give(tmp_path, name):
    sizes = np.asarray(SIZES[name], dtype=np.int64)
    w = written(tmp_path, sizes)
    paged, looked_up = both_tables(w)
    w.env.close()
    assert looked_up is not None and paged is not None
    assert paged.dtype == np.int64 and paged.shape == (len(sizes), 2)
    np.testing.assert_array_equal(paged, looked_up)
    np.testing.assert_array_equal(paged[:, 1], sizes)
    data = (tmp_path / "data.mdb").read_bytes()
    with lmdb.open(str(tmp_path), readonly=True, lock=False) as env, env.begin() as txn:
        for i in np.linspace(0, len(sizes) - 1, 7).astype(int):
            offset, size = paged[i]
            assert data[offset : offset + size] == txn.get(keys(np.array([i]))[0])


def test_a_tree_of_three_levels_read_a_few_pages_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_pages, "LEAF_CHUNK", 3)
    monkeypatch.setattr(lmdb_pages, "BRANCH_CHUNK", 2)
    w = written(tmp_path, np.full(60_000, 4), per_part=7000)
    assert w.env.stat()["depth"] == 3  # root, branches, leaves
    paged, looked_up = both_tables(w)
    w.env.close()
    np.testing.assert_array_equal(paged, looked_up)


def test_records_not_the_writers_give_no_table(tmp_path):
    sizes = np.full(500, 100)
    w = written(tmp_path, sizes)
    m, data = lmdb_pages.mapped(w.current_file)
    txnid = w.env.info()["last_txnid"]
    other = sizes.copy()
    other[250] = 99
    assert lmdb_values.paged_table(data, PAGE, txnid, sizes) is not None
    assert lmdb_values.paged_table(data, PAGE, txnid, other) is None  # a size not written
    assert lmdb_values.paged_table(data, PAGE, txnid, sizes[:-1]) is not None  # a prefix
    assert lmdb_values.paged_table(data, PAGE, txnid, np.full(501, 100)) is None  # one more
    assert lmdb_values.paged_table(data, PAGE, txnid - 1, sizes) is None  # another snapshot
    del data
    m.close()
    w.env.close()


def test_keys_not_the_writers_give_no_table(tmp_path):
    with lmdb.open(str(tmp_path), subdir=True) as env, env.begin(write=True) as txn:
        for i in range(100):
            txn.put(b"%010d" % (i if i != 40 else 1000), bytes(10))
        txnid = env.info()["last_txnid"] + 1
    m, data = lmdb_pages.mapped(tmp_path / "data.mdb")
    assert lmdb_values.paged_table(data, PAGE, txnid, np.full(40, 10)) is not None
    assert lmdb_values.paged_table(data, PAGE, txnid, np.full(41, 10)) is None
    del data
    m.close()


def damaged(path, seed: int) -> bytes:
    """data.mdb's bytes with bytes of its page headers and nodes changed at random."""
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    for _ in range(3):
        page = int(rng.integers(0, len(data) // PAGE))
        at = page * PAGE + int(rng.choice([rng.integers(0, 64), rng.integers(PAGE - 64, PAGE)]))
        data[at] = int(rng.integers(0, 256))
    return bytes(data)


def test_damaged_pages_give_no_table_or_one_inside_the_file(tmp_path):
    """Never an exception nor a read outside the file, whatever the header bytes say."""
    sizes = np.random.default_rng(1).choice([5, 700, 5000], 400)
    w = written(tmp_path / "w", sizes)
    txnid = w.env.info()["last_txnid"]
    w.env.close()
    path = tmp_path / "w" / "data.mdb"
    refused = 0
    for seed in range(150):
        raw = damaged(path, seed)
        data = np.frombuffer(raw, dtype=np.uint8)
        table = lmdb_values.paged_table(data, PAGE, txnid, sizes)
        if table is None:
            refused += 1
            continue
        assert table.shape == (len(sizes), 2)
        assert table[:, 0].min() >= 0 and (table[:, 0] + table[:, 1]).max() <= len(raw)
    assert refused > 0


def test_a_file_of_another_lmdb_version_gives_no_table(tmp_path):
    w = written(tmp_path / "w", np.full(10, 10))
    txnid = w.env.info()["last_txnid"]
    w.env.close()
    raw = bytearray((tmp_path / "w" / "data.mdb").read_bytes())
    for page in (0, 1):
        raw[page * PAGE + 20] = 2  # MDB_DATA_VERSION
    table = lmdb_values.paged_table(np.frombuffer(bytes(raw), np.uint8), PAGE, txnid, w.sizes[:10])
    assert table is None


def test_the_writer_looks_the_records_up_where_the_pages_give_no_table(tmp_path, monkeypatch):
    def pack(dest):
        with gpufeed.Writer(dest, format="lmdb", schema={"blob": "bytes"}) as w:
            for i in range(300):
                w.write({"blob": bytes([i % 256]) * (i * 37 % 5000)})
        return (dest / "values.npy").read_bytes(), json.loads((dest / "manifest.json").read_text())

    paged = pack(tmp_path / "paged")
    monkeypatch.setattr(lmdb_writer, "paged_table", lambda *a: None)
    looked_up = pack(tmp_path / "looked_up")
    assert paged[0] == looked_up[0]
    assert paged[1]["layout"] == looked_up[1]["layout"]
    assert paged[1]["files"]["data.mdb"] == looked_up[1]["files"]["data.mdb"]


def test_the_manifest_records_the_files_sha256_hashed_once(tmp_path, monkeypatch):
    hashed: list = []
    real = lmdb_writer._sha256
    monkeypatch.setattr(lmdb_writer, "_sha256", lambda m: hashed.append(len(m)) or real(m))
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, format="lmdb", schema={"x": "uint8[1024]", "label": "int"}) as w:
        for i in range(2000):
            w.write({"x": np.full(1024, i % 256, np.uint8), "label": i})
    files = json.loads((dest / "manifest.json").read_text())["files"]
    assert hashed == [(dest / "data.mdb").stat().st_size]
    for name in ("data.mdb", "values.npy"):
        assert files[name] == {
            "bytes": (dest / name).stat().st_size,
            "sha256": sha256_file(dest / name),
        }
    report = gpufeed.verify(dest)
    assert report.ok and report.samples_checked == 2000


def test_an_error_while_the_file_is_mapped_is_the_one_raised(tmp_path, monkeypatch):
    """Not BufferError from closing the map its traceback still holds a view of."""

    def fails(data, *_):
        view = data[:10]  # noqa: F841 - held by this frame, in the traceback
        raise OSError("disk gone")

    monkeypatch.setattr(lmdb_writer, "paged_table", fails)
    w = written(tmp_path, [10] * 20)
    with pytest.raises(OSError, match="disk gone"):
        w.finish()
    w.abort()
