"""HDF5 packs from elsewhere: a data.h5 whose datasets keep their bytes in other files
(external raw storage, a virtual dataset, external or soft links) is refused by name, and
its datasets must be what the manifest says (dtype, shape, offsets inside /encoded, a mapped
dataset inside the file)."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import DataError, UnsafePathError


@pytest.fixture()
def encoded_pack(pack_factory, tmp_path):
    return pack_factory("hdf5", "jpegs", copy_to=tmp_path / "d")


@pytest.fixture()
def array_pack(pack_factory, tmp_path):
    classes = {"a": 3, "b": 3}
    return pack_factory("hdf5", classes=classes, shape=(16,), seed=1, copy_to=tmp_path / "d")


def _replace(dest, name: str, make) -> None:
    """Dataset /name of dest's data.h5 replaced by make(file, name, old values) (the file
    keeps its size: HDF5 does not shrink it, so the manifest's size still holds)."""
    with h5py.File(dest / "data.h5", "r+") as f:
        old = f[name][...]
        del f[name]
        make(f, name, old)


def _other_file(tmp_path, data: np.ndarray):
    """Another HDF5 file holding `data` as /d (what a crafted pack points at)."""
    other = tmp_path / "elsewhere.h5"
    with h5py.File(other, "w") as f:
        f["d"] = data
    return other


def test_encoded_bytes_in_an_external_file_are_refused(encoded_pack, tmp_path):
    secret = tmp_path / "id_rsa"

    def external(f, name, old):
        secret.write_bytes(old.tobytes())  # the samples' own bytes: crc32 would not notice
        f.create_dataset(
            name, shape=old.shape, dtype=old.dtype, external=[(str(secret), 0, old.nbytes)]
        )

    _replace(encoded_pack, "encoded", external)
    with pytest.raises(
        UnsafePathError, match=r"data\.h5: dataset /encoded keeps its bytes in other files"
    ) as e:
        gpufeed.open_dataset(encoded_pack, decode=False)
    assert str(secret) in str(e.value)


def test_a_virtual_dataset_over_another_file_is_refused(encoded_pack, tmp_path):
    def virtual(f, name, old):
        other = _other_file(tmp_path, old)
        layout = h5py.VirtualLayout(shape=old.shape, dtype=old.dtype)
        layout[:] = h5py.VirtualSource(str(other), "d", shape=old.shape)
        f.create_virtual_dataset(name, layout)

    _replace(encoded_pack, "encoded", virtual)
    with pytest.raises(UnsafePathError, match=r"data\.h5: dataset /encoded is a virtual dataset"):
        gpufeed.open_dataset(encoded_pack, decode=False)


@pytest.mark.parametrize("link", ["external", "soft"])
def test_labels_as_a_link_are_refused(encoded_pack, tmp_path, link):
    def linked(f, name, old):
        if link == "external":
            f[name] = h5py.ExternalLink(str(_other_file(tmp_path, old)), "/d")
        else:
            f["elsewhere"] = old
            f[name] = h5py.SoftLink("/elsewhere")

    _replace(encoded_pack, "labels", linked)
    with pytest.raises(UnsafePathError, match=rf"data\.h5: /labels is an? {link} link"):
        gpufeed.open_dataset(encoded_pack, decode=False)


def test_samples_of_another_shape_than_the_manifest_says_are_refused(array_pack):
    _replace(
        array_pack,
        "samples",
        lambda f, name, old: f.create_dataset(name, data=old.reshape(6, 4, 4)),
    )
    with pytest.raises(
        DataError,
        match=r"data\.h5: /samples holds uint8\[6, 4, 4\], the manifest says uint8\[6, 16\]",
    ):
        gpufeed.open_dataset(array_pack)


def test_a_manifest_claiming_another_sample_shape_is_refused(array_pack):
    path = array_pack / "manifest.json"
    m = json.loads(path.read_text())
    m["sample"]["shape"] = [3, 16, 17]  # mapped, this reads past /samples: other bytes
    path.write_text(json.dumps(m))
    with pytest.raises(
        DataError, match=r"data\.h5: /samples holds uint8\[6, 16\], the manifest says"
    ):
        gpufeed.open_dataset(array_pack)


def test_offsets_out_of_order_are_refused_naming_the_first_bad_sample(encoded_pack):
    def swapped(f, name, old):
        old[2] = old[4]  # sample 1 ends after sample 2 begins; the total stays
        f[name] = old

    _replace(encoded_pack, "offsets", swapped)
    with pytest.raises(DataError, match=r"data\.h5: /offsets: sample 2 lies at bytes"):
        gpufeed.open_dataset(encoded_pack, decode=False)


def test_labels_of_strings_are_refused_naming_the_dataset(array_pack):
    _replace(
        array_pack, "labels", lambda f, name, old: f.create_dataset(name, data=[b"x"] * len(old))
    )
    with pytest.raises(
        DataError, match=r"data\.h5: /labels: holds object\[6\], expected one dimension of integers"
    ):
        gpufeed.open_dataset(array_pack)


@pytest.mark.slow
def test_a_file_cut_short_with_its_manifest_entry_is_an_error_not_a_bus_error(array_pack):
    """The manifest's size lowered with the file (what a crafted pack can do): the mapped
    /samples would lie past the end of the file (HDF5's own end-of-file check holds, and
    the reader's check of the mapped dataset against the file's size is behind it)."""
    data = array_pack / "data.h5"
    with h5py.File(data, "r") as f:
        end = f["samples"].id.get_offset() + 40
    with open(data, "r+b") as f:
        f.truncate(end)
    path = array_pack / "manifest.json"
    m = json.loads(path.read_text())
    m["files"]["data.h5"]["bytes"] = end
    path.write_text(json.dumps(m))
    code = (
        "import sys, gpufeed\n"
        "ds = gpufeed.open_dataset(sys.argv[1], map_style=True)\n"
        "print([ds[i][1] for i in range(len(ds))])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(array_pack)],
        env=PYTHON_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, (r.returncode, r.stderr)  # -7 would be SIGBUS
    assert "DataError" in r.stderr and f"{data}: " in r.stderr
