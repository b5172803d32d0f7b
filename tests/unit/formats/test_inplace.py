"""Someone else's HDF5 file read in place (datasets=): a named dataset whose bytes are in
another file (external raw storage, a virtual dataset, an external link), or a soft link
to another name, is refused by name; plain datasets read as before."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

import gpufeed
from gpufeed.errors import UnsafePathError


@pytest.fixture()
def files(tmp_path):
    """(the file to read in place, another file holding /d: 4 rows of uint8[8])."""
    rows = np.arange(32, dtype=np.uint8).reshape(4, 8)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["d"] = rows
    theirs = tmp_path / "theirs.h5"
    with h5py.File(theirs, "w") as f:
        f["images"] = rows
        f["labels"] = np.arange(4)
    return theirs, other


def _images_as(path, other, how) -> None:
    with h5py.File(path, "r+") as f:
        del f["images"]
        if how == "external storage":
            raw = path.parent / "raw.bin"
            raw.write_bytes(np.arange(32, dtype=np.uint8).tobytes())
            f.create_dataset("images", shape=(4, 8), dtype=np.uint8, external=[(str(raw), 0, 32)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=(4, 8), dtype=np.uint8)
            layout[:] = h5py.VirtualSource(str(other), "d", shape=(4, 8))
            f.create_virtual_dataset("images", layout)
        elif how == "external link":
            f["images"] = h5py.ExternalLink(str(other), "/d")
        else:
            f["data/images"] = np.arange(32, dtype=np.uint8).reshape(4, 8)
            f["images"] = h5py.SoftLink("/data/images")


def test_plain_datasets_read_in_place(files):
    ds = gpufeed.open_dataset(files[0], datasets={"image": "/images", "label": "/labels"})
    assert np.array_equal(np.asarray(ds[3]["image"]), np.arange(24, 32))


@pytest.mark.parametrize(
    "how, says",
    [
        ("external storage", "dataset /images keeps its bytes in other files"),
        ("virtual", "dataset /images is a virtual dataset"),
        ("external link", "/images is an external link"),
        ("soft link", "/images is a soft link"),
    ],
)
def test_a_dataset_read_from_elsewhere_is_refused_by_name(files, how, says):
    theirs, other = files
    _images_as(theirs, other, how)
    with pytest.raises(UnsafePathError, match=f"{theirs}: {says}"):
        gpufeed.open_dataset(theirs, datasets={"image": "/images", "label": "/labels"})
