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


def test_a_scalar_keeps_its_shape_not_1(tmp_path):
    for i, value in enumerate((np.float32(2.5), np.array(7, dtype=np.int64), np.array(5.0))):
        path = tmp_path / f"s{i}.npy"
        np.save(path, value)
        res = load_item(str(path), LoadOptions())
        assert res[0] == "ok" and res[3]["shape"] == list(np.load(path).shape) == []


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_scalars_come_back_as_0_d_tensors_and_batch_to_1_d(tmp_path, fmt):
    import torch

    import gpufeed

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(5):
        np.save(src / f"{i}.npy", np.float32(i) / 4)
    gpufeed.pack(src.parent, tmp_path / "p", format=fmt, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p")
    x, label = ds[3]
    assert x.shape == () and x.dtype == torch.float32 and x.item() == 0.75 and label == 0
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert batch[0].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_a_scalar_tar_member_is_a_0_d_npy_for_plain_readers(tmp_path):
    import io
    import tarfile

    import gpufeed

    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "a.npy", np.float32(1.5))
    gpufeed.pack(src, tmp_path / "p", format="tar", quiet=True)
    (shard,) = (tmp_path / "p").glob("*.tar")
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".npy"))
        value = np.load(io.BytesIO(tar.extractfile(member).read()))
    assert value.shape == () and value == np.float32(1.5)
