"""gpufeed.verify and gpufeed.inspect: a clean pack of every format verifies, and each kind of
damage is a problem naming the file (and the sample and its source); inspect describes each
format's layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from unit_sources import pack_with_broken_jpeg

import gpufeed
from gpufeed.errors import NotPackedError
from gpufeed.formats.checksums import crc32
from gpufeed.formats.manifest import MANIFEST_NAME, file_entry, read_manifest, write_manifest
from gpufeed.tools import verify as verify_mod
from gpufeed.tools.verify import inspect, verify

FORMATS = ("hdf5", "lmdb", "tar", "mmap")


@pytest.fixture(scope="module")
def packs(tmp_path_factory, array_folder):
    root = tmp_path_factory.mktemp("verify")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        gpufeed.pack(array_folder, out[fmt], format=fmt, workers=1, quiet=True)
    return out


def fresh(tmp_path, array_folder, fmt="mmap"):
    dest = tmp_path / fmt
    gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True)
    return dest


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_clean_pack_verifies(packs, fmt):
    report = verify(packs[fmt])
    manifest = read_manifest(packs[fmt])
    assert report.ok and report.problems == [] and report.bad_samples == []
    assert report.samples_checked == report.count == 17
    assert report.files_checked == len(manifest["files"])
    assert report.summary().startswith(f"{packs[fmt]}: OK ({fmt}, 17 samples")
    as_json = report.to_json()
    assert as_json["ok"] is True and as_json["problems_total"] == 0 and as_json["format"] == fmt


def test_a_flipped_byte_names_sample_and_source(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    data = np.load(dest / "samples.npy", mmap_mode="r+")
    data[6, 0, 0, 0] ^= 0xFF
    data.flush()
    report = verify(dest)
    assert not report.ok and report.bad_samples == [6]
    crc = [p for p in report.problems if p.index == 6]
    assert crc and "crc32 mismatch" in crc[0].message and crc[0].source.endswith(".npy")
    assert "samples.npy" in crc[0].file and "sample 6 (source" in str(crc[0])
    files = [p for p in report.problems if p.index is None]
    assert files and "sha256" in files[0].message  # the file's checksum caught it too
    assert report.summary().startswith(f"{dest}: FAILED: 2 problem(s)")


def test_missing_and_resized_files(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    (dest / "labels.npy").unlink()
    with open(dest / "crc32.npy", "ab") as f:
        f.write(b"x")
    messages = {p.file.rsplit("/", 1)[-1]: p.message for p in verify(dest).problems}
    assert messages["labels.npy"] == "missing"
    assert "bytes, manifest says" in messages["crc32.npy"]
    assert "cannot open" in messages[dest.name]  # the reader needs labels.npy


def test_manifest_entries_without_checksums(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    m = read_manifest(dest)
    m["files"]["labels.npy"] = {"bytes": 1}
    write_manifest(dest, m)
    problems = verify(dest).problems
    assert any("lacks bytes or sha256" in p.message for p in problems)


def test_unsafe_names_are_reported_and_samples_not_read(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    m = read_manifest(dest)
    m["files"]["../outside"] = {"bytes": 1, "sha256": "0" * 64}
    write_manifest(dest, m)
    report = verify(dest)
    assert not report.ok and report.samples_checked == 0
    assert any("leads outside the pack" in p.message for p in report.problems)
    assert report.problems[-1].message == "samples not read: the manifest names unsafe files"


def test_labels_outside_the_classes(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    labels = np.load(dest / "labels.npy")
    labels[3] = 5  # two classes in the source
    np.save(dest / "labels.npy", labels)
    m = read_manifest(dest)
    m["files"]["labels.npy"] = file_entry(dest, "labels.npy")
    write_manifest(dest, m)
    report = verify(dest)
    assert report.bad_samples == [3]
    assert report.problems[0].message == "label 5 outside the 2 classes"


def test_decode_finds_an_image_with_a_good_checksum(tmp_path):
    dest = pack_with_broken_jpeg(tmp_path)
    # make the broken JPEG's stored checksums agree with its bytes: only decoding can tell
    encoded, offsets = np.load(dest / "encoded.npy"), np.load(dest / "offsets.npy")
    crcs = np.load(dest / "crc32.npy")
    crcs[1] = crc32(encoded[offsets[1] : offsets[2]])
    np.save(dest / "crc32.npy", crcs)
    m = read_manifest(dest)
    for name in ("encoded.npy", "crc32.npy"):
        m["files"][name] = file_entry(dest, name)
    write_manifest(dest, m)
    assert verify(dest).ok
    report = verify(dest, decode=True)
    assert report.bad_samples == [1] and "cannot decode" in report.problems[0].message


def test_problems_are_capped_but_counted(tmp_path, array_folder, monkeypatch):
    monkeypatch.setattr(verify_mod, "MAX_PROBLEMS", 2)
    dest = fresh(tmp_path, array_folder)
    data = np.load(dest / "samples.npy", mmap_mode="r+")
    data[:5] ^= 0xFF
    data.flush()
    report = verify(dest)
    assert len(report.problems) == 2 and report.problems_total == 6  # 5 samples + the file
    assert report.to_json()["problems_total"] == 6


def test_not_a_pack(tmp_path):
    with pytest.raises(NotPackedError):
        verify(tmp_path)
    with pytest.raises(NotPackedError):
        inspect(tmp_path)


def test_inspect_each_format(packs):
    for fmt in FORMATS:
        info = inspect(packs[fmt])
        manifest = read_manifest(packs[fmt])
        assert (info["format"], info["count"], info["num_classes"]) == (fmt, 17, 2)
        assert info["sample"]["dtype_name"] == "uint8" and info["sample"]["shape"] == [3, 4, 5]
        assert info["files"] == len(manifest["files"]) and info["skipped"] == 0
        assert info["size_bytes"] >= sum(f["bytes"] for f in manifest["files"].values())
        assert info["bytes_per_sample"] == round(info["size_bytes"] / 17, 1)
        assert info["created_by"].startswith("gpufeed ")
        json.dumps(info)  # what `gpufeed inspect --json` prints
    assert inspect(packs["tar"])["shards"] == len(read_manifest(packs["tar"])["layout"]["shards"])
    assert inspect(packs["hdf5"])["datasets"]["samples"] == "/samples"
    assert inspect(packs["hdf5"])["compression"] is None
    assert inspect(packs["mmap"])["container"] == "npy"
    assert (packs["mmap"] / MANIFEST_NAME).is_file()
