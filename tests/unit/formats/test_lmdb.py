"""LMDB packs from elsewhere: a damaged environment is an error naming data.mdb (never
LMDB's own error without the path, never a crash), index keys must hold integer arrays, and
a value table edited since the pack was written (two rows swapped) is not used."""

from __future__ import annotations

import subprocess
import sys

import lmdb
import numpy as np
import pytest
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import DataError
from gpufeed.formats.lmdb.values import PlacedRecords
from gpufeed.formats.npy import npy_bytes
from gpufeed.formats.open import open_reader

PAGE = 4096


@pytest.fixture()
def pack(pack_factory, tmp_path):
    classes = {"a": 3, "b": 3}
    return pack_factory("lmdb", classes=classes, shape=(16,), seed=1, copy_to=tmp_path / "d")


def _open_and_read(dest) -> subprocess.CompletedProcess:
    """Open and read every sample in a child process (a damaged B-tree must not crash the
    test run)."""
    code = (
        "import sys, gpufeed\n"
        "ds = gpufeed.open_dataset(sys.argv[1], map_style=True)\n"
        "print([ds[i][1] for i in range(len(ds))])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(dest)],
        env=PYTHON_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "invalid":  # both meta pages gone: MDB_INVALID
        data[: 2 * PAGE] = bytes(2 * PAGE)
    else:  # the leaf pages' type wiped: MDB_CORRUPTED on the first lookup
        for p in range(2, len(data) // PAGE):
            page = data[p * PAGE : (p + 1) * PAGE]
            if b"0000000000" in page and page[10:12] == b"\x02\x00":  # P_LEAF
                data[p * PAGE + 10 : p * PAGE + 12] = b"\0\0"
    path.write_bytes(data)


@pytest.mark.slow
@pytest.mark.parametrize("how, says", [("invalid", "MDB_INVALID"), ("corrupted", "MDB_CORRUPTED")])
def test_a_damaged_environment_is_an_error_naming_data_mdb(pack, how, says):
    _damage(pack / "data.mdb", how)
    r = _open_and_read(pack)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert f"DataError: {pack / 'data.mdb'}: LMDB cannot read it" in r.stderr
    assert says in r.stderr and "gpufeed verify" in r.stderr


def _put(dest, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(dest), subdir=True, lock=False)
    with env.begin(write=True) as txn:
        txn.put(key, value)
    env.close()


@pytest.mark.parametrize(
    "value, says",
    [
        (b"not an npy", "not a readable .npy array"),
        (npy_bytes(np.zeros(6, np.float32)), r"holds float32\[6\], expected one dimension"),
    ],
    ids=["junk", "floats"],
)
def test_index_keys_must_hold_integer_arrays(pack, value, says):
    _put(pack, b"__labels__", value)
    with pytest.raises(DataError, match=rf"data\.mdb: key __labels__: {says}"):
        gpufeed.open_dataset(pack)


def test_a_value_table_with_two_rows_swapped_is_not_used(pack):
    reader = open_reader(pack)
    expected = reader.read_batch(np.arange(6))
    assert reader._placed is not None  # as written: read by the table
    reader.close()
    table = np.load(pack / "values.npy")
    table[[1, 2]] = table[[2, 1]]  # rows 0, 3 and 5 stay: LMDB's own answer for them holds
    np.save(pack / "values.npy", table)
    reader = open_reader(pack)
    assert np.array_equal(reader.read_batch(np.arange(6)), expected)
    assert reader._placed is None  # read by lookups
    reader.close()


def test_placed_records_outside_the_map_are_refused(tmp_path):
    """The check behind the table's own (a window built over a map is never indexed past
    it)."""
    table = np.array([[0, 16], [90, 16]], dtype=np.int64)
    with pytest.raises(DataError, match=r"values\.npy: sample 1 lies at bytes \[90, 106\)"):
        PlacedRecords(np.zeros(100, np.uint8), table, tmp_path / "values.npy")
