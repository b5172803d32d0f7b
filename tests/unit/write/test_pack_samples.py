"""gpufeed.pack(samples, DEST): samples given as Python objects (a list, a generator, an
array of rows) are packed as they are, in order, in every format."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.errors import SourceError

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_list_of_arrays_comes_back_exact_as_field_x(tmp_path, fmt):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 4)).astype(np.float16) for _ in range(7)]
    manifest = gpufeed.pack(arrays, tmp_path / "p", format=fmt, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert manifest["count"] == len(ds) == 7
    for i in (0, 6, -1):
        x = ds[i]["x"]
        assert x.dtype == torch.float16 and np.array_equal(x.numpy(), arrays[i])


def test_pairs_from_a_generator_give_x_and_label_with_a_ragged_schema(tmp_path):
    pairs = ((torch.arange(i, dtype=torch.int32), i % 3) for i in range(6))
    gpufeed.pack(pairs, tmp_path / "p", format="tar", schema={"x": "int32[-1]", "label": "int"})
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert [ds[i]["x"].tolist() for i in range(6)] == [list(range(i)) for i in range(6)]
    np.testing.assert_array_equal(ds.labels, np.arange(6) % 3)


def test_jpeg_bytes_with_a_label_are_an_image_field_kept_encoded(tmp_path):
    b = io.BytesIO()
    Image.fromarray(np.full((8, 6, 3), 200, np.uint8)).save(b, "JPEG")
    gpufeed.pack([(b.getvalue(), 4)] * 3, tmp_path / "p", format="lmdb", quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p", decode=False)
    assert bytes(ds[1]["image"]) == b.getvalue() and ds[1]["label"] == 4


def test_an_array_of_rows_and_a_list_of_dicts(tmp_path):
    rows = np.arange(24, dtype=np.uint8).reshape(4, 2, 3)
    gpufeed.pack(rows, tmp_path / "rows", format="mmap", quiet=True)
    assert gpufeed.open_dataset(tmp_path / "rows")[3]["x"].tolist() == rows[3].tolist()
    dicts = [{"caption": f"c{i}", "score": i / 2} for i in range(3)]
    gpufeed.pack(dicts, tmp_path / "dicts", format="hdf5", quiet=True)
    assert gpufeed.open_dataset(tmp_path / "dicts")[2] == {"caption": "c2", "score": 1.0}


def test_the_tutorial_loader_runs_over_packed_arrays(tmp_path):
    arrays = [np.full((2, 2), i, np.int64) for i in range(40)]
    gpufeed.pack(arrays, tmp_path / "p", format="lmdb", quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    seen = sorted(int(v) for batch in loader for v in batch["x"][:, 0, 0])
    assert seen == list(range(40))


def test_a_sample_that_is_none_of_these_says_how_to_name_fields(tmp_path):
    with pytest.raises(SourceError, match=r"a sample is a dict of named fields.*got int"):
        gpufeed.pack([1, 2], tmp_path / "p", quiet=True)
    assert not (tmp_path / "p").exists()
