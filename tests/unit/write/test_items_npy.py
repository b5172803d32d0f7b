"""A source .npy read through the header cache (gpufeed.write.items._load_npy) gives what
np.load gave: the same payload and spec for every kind of array, the same error for a file
cut short."""

from __future__ import annotations

import numpy as np
import pytest

from gpufeed.write.items import LoadOptions, _array_payload, load_item

ARRAYS = {
    "float32": np.arange(3 * 32 * 32, dtype=np.float32).reshape(3, 32, 32),
    "big_endian": np.arange(10, dtype=">i4"),
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "scalar": np.array(5.0),
    "empty": np.zeros((0, 3), np.uint8),
    "structured": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
    "bool": np.array([True, False]),
    "unicode": np.array(["ab", "c"]),
}


def _expected(path) -> tuple:
    payload, spec = _array_payload(np.load(path, allow_pickle=False))
    return payload, spec


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_an_array_reads_as_np_load_gives_it(tmp_path, name):
    for i in range(3):  # the first file parses its header, the next ones reuse it
        path = tmp_path / f"{name}{i}.npy"
        np.save(path, ARRAYS[name])
        res = load_item(str(path), LoadOptions())
        assert res[0] == "ok"
        assert (res[2], res[3]) == _expected(path)


def test_a_version_2_header_and_trailing_bytes(tmp_path):
    v2 = tmp_path / "v2.npy"
    with open(v2, "wb") as f:
        np.lib.format.write_array(f, ARRAYS["float32"], version=(2, 0))
    assert load_item(str(v2), LoadOptions())[2:4] == _expected(v2)
    longer = tmp_path / "longer.npy"
    longer.write_bytes(v2.read_bytes() + b"xx")
    assert load_item(str(longer), LoadOptions())[2:4] == _expected(longer)


def test_a_file_cut_short_is_the_error_np_load_gives(tmp_path):
    whole, cut = tmp_path / "whole.npy", tmp_path / "cut.npy"
    np.save(whole, ARRAYS["float32"])
    load_item(str(whole), LoadOptions())  # its header known
    cut.write_bytes(whole.read_bytes()[:-10])
    res = load_item(str(cut), LoadOptions())
    with pytest.raises(ValueError) as e:
        np.load(cut, allow_pickle=False)
    assert res[0] == "error" and str(e.value).splitlines()[0] in res[2]
