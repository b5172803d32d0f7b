"""gpufeed.formats.manifest: the manifest written and read back, every way read_manifest refuses
a folder (each message says what to do), and the path rules for the files a manifest names."""

from __future__ import annotations

import json
import os

import pytest

from gpufeed.errors import DataError, NotPackedError, UnsafePathError
from gpufeed.formats import FORMATS
from gpufeed.formats.checksums import sha256_file
from gpufeed.formats.lock import PackLock
from gpufeed.formats.manifest import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    file_entry,
    pack_file,
    read_manifest,
    read_sources,
    write_manifest,
    write_sources,
)
from gpufeed.formats.spec import FORMAT_VERSION


def manifest(fmt: str = "mmap", **extra) -> dict:
    return {
        "gpufeed_manifest": 1,
        "format": fmt,
        "format_version": FORMAT_VERSION,
        "count": 0,
        "sample": {"kind": "encoded"},
        "files": {},
        **extra,
    }


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip_atomic(tmp_path, fmt):
    m = manifest(fmt, classes=["a", "b"], layout={"x": [1, 2]}, skipped=[])
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    assert read_manifest(tmp_path / MANIFEST_NAME) == m  # the file itself names its pack
    assert sorted(os.listdir(tmp_path)) == [MANIFEST_NAME]  # no temporary left behind
    write_manifest(tmp_path, {**m, "count": 5})  # replaced whole
    assert read_manifest(tmp_path)["count"] == 5


def test_missing_folder(tmp_path):
    with pytest.raises(NotPackedError, match="does not exist"):
        read_manifest(tmp_path / "nope")


def test_folder_without_manifest(tmp_path):
    with pytest.raises(NotPackedError, match="not a gpufeed dataset.*gpufeed pack"):
        read_manifest(tmp_path)


def test_the_partial_folder_itself(tmp_path):
    partial = tmp_path / ("d" + PARTIAL_SUFFIX)
    partial.mkdir()
    with pytest.raises(NotPackedError, match=r"unfinished pack.*gpufeed pack SOURCE .*d --resume"):
        read_manifest(partial)
    other = tmp_path / "o"
    other.mkdir()
    (other / "state.json").write_text("{}")
    with pytest.raises(NotPackedError, match="unfinished pack"):
        read_manifest(other)


def test_a_destination_whose_pack_is_unfinished(tmp_path):
    dest = tmp_path / "d"
    (tmp_path / ("d" + PARTIAL_SUFFIX)).mkdir()
    with pytest.raises(NotPackedError, match=r"a pack into it is unfinished .*--resume"):
        read_manifest(dest)


def test_a_destination_being_written_names_the_writer(tmp_path):
    dest = tmp_path / "d"
    with PackLock(dest, tmp_path / ("d" + PARTIAL_SUFFIX)):
        with pytest.raises(NotPackedError, match=rf"pid {os.getpid()}\) is writing it now"):
            read_manifest(dest)
        with pytest.raises(NotPackedError, match="is writing it now"):
            read_manifest(tmp_path / ("d" + PARTIAL_SUFFIX))


@pytest.mark.parametrize(
    "text,error",
    [
        ("{not json", "unreadable manifest"),
        (b"\xff\xfe", "unreadable manifest"),
        ("[1, 2]", "not a gpufeed manifest"),
        ('{"files": []}', "not a gpufeed manifest"),
        (json.dumps(manifest("zip")), "unknown format 'zip'; expected one of hdf5, lmdb, tar"),
        (json.dumps(manifest(format_version=FORMAT_VERSION + 1)), "newer than this gpufeed"),
    ],
)
def test_bad_manifests_are_data_errors(tmp_path, text, error):
    path = tmp_path / MANIFEST_NAME
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError, match=error) as e:
        read_manifest(tmp_path)
    assert str(path) in str(e.value)


def test_manifest_that_leads_out_of_the_pack_is_not_read(tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(manifest()))
    pack = tmp_path / "p"
    pack.mkdir()
    (pack / MANIFEST_NAME).symlink_to(outside)
    with pytest.raises(UnsafePathError, match="leads outside the pack"):
        read_manifest(pack)


def test_pack_file_rules(tmp_path):
    (tmp_path / "data.h5").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "part.bin").write_bytes(b"x")
    (tmp_path / "inner").symlink_to(tmp_path / "data.h5")
    assert pack_file(tmp_path, "data.h5") == tmp_path / "data.h5"
    assert pack_file(tmp_path, "sub/part.bin") == tmp_path / "sub" / "part.bin"
    assert pack_file(tmp_path, "inner") == tmp_path / "inner"  # a link that stays inside
    assert pack_file(tmp_path, "missing.bin") == tmp_path / "missing.bin"  # reported on open
    for name in ("/etc/passwd", "../x", "sub/../../x"):
        with pytest.raises(UnsafePathError, match="leads outside the pack"):
            pack_file(tmp_path, name)
    for name in ("sub//part.bin", "./data.h5", "sub/"):
        with pytest.raises(UnsafePathError, match="not a plain file name"):
            pack_file(tmp_path, name)
    (tmp_path / "out").symlink_to("/etc/hostname")
    with pytest.raises(UnsafePathError, match="leads outside the pack"):
        pack_file(tmp_path, "out")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        pack_file(tmp_path, "fifo")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        pack_file(tmp_path, "sub")


def test_sources_round_trip_any_bytes(tmp_path):
    names = ["a/1.jpg", "b/caf\xe9.png", "b/" + b"\xff\xfe.jpg".decode("utf-8", "surrogateescape")]
    write_sources(tmp_path / "sources.txt", names)
    assert read_sources(tmp_path / "sources.txt") == names
    write_sources(tmp_path / "empty.txt", [])
    assert read_sources(tmp_path / "empty.txt") == []


def test_file_entry(tmp_path):
    (tmp_path / "f").write_bytes(b"hello")
    entry = file_entry(tmp_path, "f")
    assert entry == {"bytes": 5, "sha256": sha256_file(tmp_path / "f")}
    assert entry["sha256"].startswith("2cf24dba")  # sha256("hello")
