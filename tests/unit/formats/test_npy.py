"""formats/npy.py: read_npz_vectors checks what a .npz and its .npy headers declare before
anything that size is allocated, and never loads a pickle."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from gpufeed.errors import DataError
from gpufeed.formats.npy import npy_bytes, read_npy_vector, read_npz_vectors
from gpufeed.formats.record import npy_header_for


def test_integer_vectors_read_back(tmp_path):
    path = tmp_path / "i.npz"
    np.savez(path, a=np.arange(5, dtype=np.int32), b=np.arange(5, dtype=">u8"))
    a, b = read_npz_vectors(path, ("a", "b"), 5)
    assert a.tolist() == b.tolist() == [0, 1, 2, 3, 4] and a.flags.writeable


def _npz(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize(
    "data, message",
    [
        # a header asking for 2**40 entries over a few bytes: np.load allocated them first
        (npy_header_for("<i8", (1 << 40,)) + bytes(80), "declares|holds int64 \\[1099511627776\\]"),
        (npy_bytes(np.arange(4)), "holds int64 \\[4\\], the manifest says 10"),
        (npy_bytes(np.arange(10.0)), "holds float64"),
        (npy_header_for("<i8", (10,)) + bytes(40), "ends after 40 of its 80 bytes"),
        (b"not an npy file at all", "not a readable .npy"),
    ],
)
def test_a_crafted_member_is_an_error_naming_the_file(tmp_path, data, message):
    path = _npz(tmp_path / "x.npz", {"a.npy": data})
    with pytest.raises(DataError, match=message) as e:
        read_npz_vectors(path, ("a",), 10)
    assert str(path) in str(e.value) and "a.npy" in str(e.value)


def test_an_object_array_is_refused_unread(tmp_path):
    path = tmp_path / "o.npz"
    np.savez(path, a=np.array([object()] * 3))  # a pickle inside
    with pytest.raises(DataError, match="a.npy holds object"):
        read_npz_vectors(path, ("a",), 3)


def test_a_member_larger_than_the_count_allows_is_refused_by_its_zip_entry(tmp_path):
    path = _npz(tmp_path / "big.npz", {"a.npy": npy_header_for("<i8", (10,)) + bytes(1 << 20)})
    with pytest.raises(DataError, match="a.npy declares 1,048,704 bytes, more than 10 entries"):
        read_npz_vectors(path, ("a",), 10)


def test_not_a_zip_and_a_missing_member(tmp_path):
    (tmp_path / "t.npz").write_bytes(b"text")
    with pytest.raises(DataError, match="t.npz: not a readable .npz"):
        read_npz_vectors(tmp_path / "t.npz", ("a",), 1)
    path = _npz(tmp_path / "m.npz", {"a.npy": npy_bytes(np.arange(1))})
    with pytest.raises(DataError, match="m.npz: has no b.npy"):
        read_npz_vectors(path, ("a", "b"), 1)


def test_a_plain_npy_file_is_checked_the_same_way(tmp_path):
    path = tmp_path / "crc32.npy"
    np.save(path, np.arange(3, dtype=np.uint32))
    assert read_npy_vector(path, 3).tolist() == [0, 1, 2]
    path.write_bytes(npy_header_for("<u4", (1 << 40,)) + bytes(12))  # 4 TiB declared
    with pytest.raises(DataError, match="crc32.npy holds uint32 \\[1099511627776\\]"):
        read_npy_vector(path, 3)
    with pytest.raises(DataError, match="missing.npy: cannot be read"):
        read_npy_vector(tmp_path / "missing.npy", 3)
