"""mmap packs from elsewhere: index arrays and the data file's .npy header are checked at
open against the manifest and the file's size (an error naming the file and the first bad
sample), and a .pt container is never unpickled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import DataError


@pytest.fixture()
def encoded_pack(pack_factory, tmp_path):
    return pack_factory("mmap", "jpegs", copy_to=tmp_path / "d")


@pytest.fixture()
def array_pack(pack_factory, tmp_path):
    classes = {"a": 3, "b": 3}
    return pack_factory("mmap", classes=classes, shape=(16,), seed=1, copy_to=tmp_path / "d")


def _edit_manifest(dest, edit) -> None:
    path = dest / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _read_all(dest) -> subprocess.CompletedProcess:
    """Open and read every sample in a child process: a crash must fail the test, not end
    the run."""
    code = (
        "import sys, gpufeed\n"
        "ds = gpufeed.open_dataset(sys.argv[1], map_style=True, decode=False)\n"
        "print(sum(len(ds[i][0]) for i in range(len(ds))))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(dest)],
        env=PYTHON_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("crafted", ["negative", "backwards", "past_the_end"])
def test_offsets_outside_the_data_are_refused_naming_the_first_bad_sample(encoded_pack, crafted):
    offsets = np.load(encoded_pack / "offsets.npy")
    if crafted == "negative":  # a constant stride from far before the map: other memory
        offsets[:-1] = -(10**9) + 10**8 * np.arange(len(offsets) - 1)
    elif crafted == "backwards":
        offsets[2] = offsets[1] - 1
    else:
        offsets[1] = offsets[-1] + 10**6
    np.save(encoded_pack / "offsets.npy", offsets)
    r = _read_all(encoded_pack)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    first = {"negative": 0, "backwards": 1, "past_the_end": 0}[crafted]
    assert f"DataError: {encoded_pack / 'offsets.npy'}: sample {first} lies at bytes" in r.stderr


def test_offsets_of_floats_are_refused_naming_the_file(encoded_pack):
    offsets = np.load(encoded_pack / "offsets.npy")
    np.save(encoded_pack / "offsets.npy", offsets.astype(np.float64))
    with pytest.raises(
        DataError, match=r"offsets\.npy holds float64 \[\d+\], the manifest says \d+ integers"
    ):
        gpufeed.open_dataset(encoded_pack, decode=False)


def test_labels_of_another_shape_are_refused_naming_the_file(array_pack):
    np.save(array_pack / "labels.npy", np.zeros((3, 2), np.int64))
    with pytest.raises(DataError, match=r"labels\.npy holds int64 \[3, 2\]"):
        gpufeed.open_dataset(array_pack)


@pytest.mark.parametrize("stored", ["int16[6, 8]", "uint8[6, 4, 4]", "fortran"])
def test_samples_npy_must_be_what_the_manifest_says(array_pack, stored):
    """The same bytes under another header: the rows would be read as other samples."""
    path = array_pack / "samples.npy"
    arr = np.load(path)
    if stored == "int16[6, 8]":
        arr = arr.view(np.int16)
    elif stored == "uint8[6, 4, 4]":
        arr = arr.reshape(6, 4, 4)
    else:
        arr = np.asfortranarray(arr)
    np.save(path, arr)
    found = "uint8[6, 16] in Fortran order" if stored == "fortran" else stored
    with pytest.raises(DataError, match=rf"samples\.npy: holds {found}".replace("[", r"\[")):
        gpufeed.open_dataset(array_pack)


@pytest.mark.slow
def test_a_data_file_cut_short_with_its_manifest_entry_is_an_error(array_pack):
    path = array_pack / "samples.npy"
    size = path.stat().st_size - 40
    with open(path, "r+b") as f:
        f.truncate(size)
    _edit_manifest(array_pack, lambda m: m["files"]["samples.npy"].update(bytes=size))
    r = _read_all(array_pack)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)  # -7: SIGBUS
    assert f"DataError: {path}: not a readable .npy file, or shorter than its header" in r.stderr


class Payload:
    """Pickled, this runs `touch MARK` when unpickled."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


@pytest.mark.parametrize("content", ["code", "dict", "shape"])
def test_a_pt_container_is_never_unpickled_and_must_hold_the_samples(
    tmp_path, make_arrays, content
):
    make_arrays(tmp_path / "s", {"a": 3, "b": 3}, shape=(16,), seed=1)
    dest = tmp_path / "d"
    gpufeed.pack(tmp_path / "s", dest, format="mmap", container="pt", workers=1, quiet=True)
    mark = tmp_path / "ran"
    good = torch.load(dest / "samples.pt", weights_only=True)
    obj = {
        "code": Payload(mark),
        "dict": {"samples": good},
        "shape": good.reshape(6, 4, 4).clone(),
    }[content]
    torch.save(obj, dest / "samples.pt")
    size = (dest / "samples.pt").stat().st_size
    _edit_manifest(dest, lambda m: m["files"]["samples.pt"].update(bytes=size))
    expected = r"samples\.pt: holds uint8\[6, 4, 4\]" if content == "shape" else r"samples\.pt: not"
    with pytest.raises(DataError, match=expected):
        gpufeed.open_dataset(dest)
    assert not mark.exists()
