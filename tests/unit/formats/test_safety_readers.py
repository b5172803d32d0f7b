"""Data safety when reading a pack: a pack replaced under an open reader, truncated files (an
error naming the file, never a SIGBUS), manifests that point outside the pack or at devices,
and manifests that claim more than is stored."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from faults import run_gpufeed
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import DataError

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]


@pytest.fixture()
def two_sources(tmp_path, make_arrays):
    """Two sources of 6 arrays each, same shape, different values and labels."""
    make_arrays(tmp_path / "old", {"a": 3, "b": 3}, shape=(16,), seed=1)
    make_arrays(tmp_path / "new", {"p": 2, "q": 4}, shape=(16,), seed=2)
    return tmp_path / "old", tmp_path / "new"


def rows(ds):
    return [(ds[i][0].numpy().tobytes(), ds[i][1]) for i in range(len(ds))]


# ------------------------------------------------------------------------ a replaced pack
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pack_replaced_in_the_same_process_is_never_mixed(two_sources, tmp_path, fmt):
    old, new = two_sources
    dest = tmp_path / "d"
    gpufeed.pack(old, dest, format=fmt, workers=1, quiet=True)
    reading = gpufeed.open_dataset(dest, map_style=True)
    before = rows(reading)  # its storage is open now
    waiting = gpufeed.open_dataset(dest, map_style=True)  # opened, nothing read yet
    gpufeed.pack(new, dest, format=fmt, workers=1, quiet=True, overwrite=True)
    fresh = gpufeed.open_dataset(dest, map_style=True)
    expected = [
        (np.load(p).tobytes(), int(p.parent.name == "q")) for p in sorted(new.rglob("*.npy"))
    ]
    assert rows(fresh) == expected
    assert rows(reading) == before  # what it opened stays whole: old index, old bytes
    with pytest.raises(DataError, match="replaced or changed since this dataset was opened"):
        waiting[0]
    report = gpufeed.verify(dest)
    assert report.ok and report.samples_checked == 6


# ------------------------------------------------------------------------ truncated files
def _verify_then_read(dest) -> subprocess.CompletedProcess:
    """verify, then open and read every sample, in a subprocess: a SIGBUS must not take the
    test run down with it."""
    code = (
        "import sys, gpufeed\n"
        "report = gpufeed.verify(sys.argv[1])\n"
        "print(*report.problems, report.summary(), sep='\\n', flush=True)\n"
        "ds = gpufeed.open_dataset(sys.argv[1], map_style=True)\n"
        "print(sum(len(ds[i][0]) for i in range(len(ds))))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(dest)], env=PYTHON_ENV, capture_output=True, text=True
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, name", [("lmdb", "data.mdb"), ("mmap", "samples.npy"), ("hdf5", "data.h5")]
)
def test_a_truncated_data_file_is_an_error_naming_it_not_a_bus_error(
    two_sources, tmp_path, fmt, name
):
    dest = tmp_path / "d"
    gpufeed.pack(two_sources[0], dest, format=fmt, workers=1, quiet=True, encode="raw")
    data = dest / name
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    r = _verify_then_read(dest)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)  # -7 was SIGBUS
    assert f"{data}: size" in r.stdout and "FAILED" in r.stdout
    assert f"{data}: " in r.stderr and "truncated" in r.stderr


def test_hdf5_that_is_not_readable_names_its_file(two_sources, tmp_path):
    dest = tmp_path / "d"
    gpufeed.pack(two_sources[0], dest, format="hdf5", workers=1, quiet=True)
    (dest / "data.h5").write_bytes(b"\0" * (dest / "data.h5").stat().st_size)
    with pytest.raises(DataError, match=rf"{dest / 'data.h5'}: cannot read the HDF5 index"):
        gpufeed.open_dataset(dest)


# ------------------------------------------------------------------------ the manifest's paths
def _edit_manifest(dest, edit) -> None:
    path = dest / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _entry(path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_manifest_pointing_outside_the_pack_is_refused(two_sources, tmp_path):
    dest = tmp_path / "d"
    gpufeed.pack(two_sources[0], dest, format="tar", workers=1, quiet=True)
    secret = tmp_path / "secret.txt"
    secret.write_bytes((dest / "shard-000000.tar").read_bytes())  # a valid shard's bytes

    def point_outside(m):
        m["files"].pop("shard-000000.tar")
        m["files"]["../secret.txt"] = _entry(secret)
        m["layout"]["shards"] = ["../secret.txt"]

    _edit_manifest(dest, point_outside)
    report = gpufeed.verify(dest)
    assert not report.ok and report.samples_checked == 0
    assert any("leads outside the pack" in p.message for p in report.problems), report.problems
    with pytest.raises(DataError, match="leads outside the pack"):
        gpufeed.open_dataset(dest)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["../" * 40 + "dev/zero", "fifo", "link"])
def test_verify_never_reads_a_device_a_fifo_or_a_link_out(two_sources, tmp_path, target):
    dest = tmp_path / "d"
    gpufeed.pack(two_sources[0], dest, format="mmap", workers=1, quiet=True)
    if target == "fifo":
        os.mkfifo(dest / "fifo")
    if target == "link":
        (dest / "link").symlink_to("/dev/zero")
    # 0 bytes: what stat says of each, so a size check alone does not stop the reading
    _edit_manifest(dest, lambda m: m["files"].update({target: {"bytes": 0, "sha256": "0"}}))
    r = run_gpufeed("verify", dest, timeout=30)  # reading /dev/zero or a FIFO never ends
    assert r.returncode == 1 and "FAILED" in r.stdout
    assert "not a regular file" in r.stdout or "leads outside the pack" in r.stdout


# ------------------------------------------------------------------------ claimed counts
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_manifest_claiming_more_samples_than_stored_is_an_error(two_sources, tmp_path, fmt):
    dest = tmp_path / "d"
    gpufeed.pack(two_sources[0], dest, format=fmt, workers=1, quiet=True)

    def claim_more(m):
        m["count"] += 3
        if fmt == "tar":
            m["layout"]["shard_counts"][-1] += 3

    _edit_manifest(dest, claim_more)
    with pytest.raises(DataError, match="the manifest says 9"):
        gpufeed.open_dataset(dest, map_style=True)
    report = gpufeed.verify(dest)
    assert not report.ok and "the manifest says 9" in str(report.problems)
