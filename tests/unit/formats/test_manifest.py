"""gpufeed.formats.manifest: the manifest written and read back, every way read_manifest refuses
a folder (each message says what to do), and the path rules for the files a manifest names."""

from __future__ import annotations

import json
import os
import re

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
    unsafe_name,
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
    layout = {"x": [1, 2], "shards": [], "shard_counts": []}  # what a tar reader needs
    m = manifest(fmt, classes=["a", "b"], layout=layout, skipped=[])
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


def tar_manifest(**extra) -> dict:
    layout = {"shards": ["shard-00000.tar"], "shard_counts": [0], "pattern": "shard-%05d.tar"}
    return manifest("tar", layout=layout, **extra)


def with_field(m: dict, field: str, value) -> dict:
    """m with `field` (a dotted path: "layout.shards") set to value."""
    *path, last = field.split(".")
    m = json.loads(json.dumps(m))
    obj = m
    for key in path:
        obj = obj[key]
    obj[last] = value
    return m


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("count", "abc", "a non-negative int"),
        ("count", -1, "a non-negative int"),
        ("count", 1.5, "a non-negative int"),
        ("count", True, "a non-negative int"),
        ("count", None, "a non-negative int"),
        ("format_version", "x", "a non-negative int"),
        ("format_version", [2], "a non-negative int"),
        ("gpufeed_manifest", "1", "a non-negative int"),
        ("format", 7, "expected one of hdf5"),
        ("format", ["tar"], "expected one of hdf5"),
        ("classes", "ab", "a list of distinct strings"),
        ("classes", [1, 2], "a list of distinct strings"),
        ("classes", ["a", "a"], "a list of distinct strings"),
        ("layout", [1], "an object"),
        ("layout.shards", 42, "a list of strings"),
        ("layout.shards", [1], "a list of strings"),
        ("layout.shard_counts", "3", "a list of non-negative ints"),
        ("layout.shard_counts", [-1], "a list of non-negative ints"),
        ("files", {"a": 5}, "an object with bytes and sha256"),
        ("files", {"a": {"bytes": "5", "sha256": "0"}}, "a non-negative int"),
        ("files", {"a": {"bytes": -5, "sha256": "0"}}, "a non-negative int"),
        ("files", {"a": {"bytes": 5, "sha256": 0}}, "a string"),
        ("files", {"": {"bytes": 5, "sha256": "0"}}, "non-empty name"),
        ("source", "folder", "an object"),
        ("options", [1], "an object"),
        ("skipped", 3, "a list"),
        ("created_by", 3, "a string"),
        ("sample", None, "unknown sample kind"),
        ("sample", {"kind": 3}, "unknown sample kind"),
        ("sample", {"kind": "array", "dtype": "nope", "shape": [3]}, "sample.dtype is 'nope'"),
        ("sample", {"kind": "array", "dtype": "O", "shape": [3]}, "sample.dtype is 'O'"),
        ("sample", {"kind": "array", "dtype": 5, "shape": [3]}, "sample.dtype is 5"),
        ("sample", {"kind": "array", "dtype": "u1", "shape": 3}, "sample.shape is 3"),
        ("sample", {"kind": "array", "dtype": "u1", "shape": ["a"]}, "sample.shape is"),
        ("sample", {"kind": "array", "dtype": "u1", "shape": [-3]}, "sample.shape is"),
        ("sample", {"kind": "array", "dtype": "u1", "shape": [1 << 40, 1 << 40]}, "sample.shape"),
        ("sample", {"kind": "array", "dtype": "u1"}, "sample.shape is None"),
        ("sample", {"kind": "fields", "fields": [1, 2]}, "sample schema is invalid"),
        ("sample", {"kind": "fields", "fields": "abc"}, "sample schema is invalid"),
    ],
)
def test_fields_of_the_wrong_type_are_data_errors_naming_the_field(
    tmp_path, field, value, expected
):
    """Every field a reader reads is checked once, in read_manifest: a crafted manifest is a
    DataError naming manifest.json and the field, never a raw ValueError or TypeError."""
    write_manifest(tmp_path, with_field(tar_manifest(), field, value))
    with pytest.raises(DataError, match=re.escape(expected)) as e:
        read_manifest(tmp_path)
    message = str(e.value)
    assert str(tmp_path / MANIFEST_NAME) in message
    name = field.split(".")[-1] if field != "files" else "files"
    assert name in message or field in ("format", "sample")


@pytest.mark.parametrize("field", ["count", "sample", "layout.shards", "layout.shard_counts"])
def test_required_fields_missing(tmp_path, field):
    m = tar_manifest()
    *path, last = field.split(".")
    (m[path[0]] if path else m).pop(last)
    write_manifest(tmp_path, m)
    with pytest.raises(DataError) as e:
        read_manifest(tmp_path)
    assert str(tmp_path / MANIFEST_NAME) in str(e.value)


def test_a_well_formed_manifest_of_every_field_reads(tmp_path):
    m = tar_manifest(
        classes=["a"],
        source={"path": None, "kind": "python", "items": 0, "digest": "x"},
        options={"encode": "keep"},
        skipped=[{"item": None, "path": "x", "error": "y"}],
        created_by="gpufeed 0",
        sample={"kind": "array", "dtype": "float32", "shape": [3, 0, 2]},
        files={"shard-00000.tar": {"bytes": 0, "sha256": "0" * 64}},
    )
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    write_manifest(tmp_path, manifest("hdf5", classes=None, format_version=None))
    assert read_manifest(tmp_path)["classes"] is None  # null where optional


def test_an_opened_pack_with_a_bad_count_names_the_manifest(tmp_path, array_folder):
    """What a user sees: open_dataset of a pack whose manifest was damaged."""
    import gpufeed

    dest = tmp_path / "p"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    m = read_manifest(dest)
    write_manifest(dest, {**m, "count": "abc"})
    with pytest.raises(DataError, match="field count is str 'abc', expected a non-negative int"):
        gpufeed.open_dataset(dest)


def hugging_face_dataset(folder):
    """What datasets' Dataset.save_to_disk writes (pyarrow is not needed to write it)."""
    folder.mkdir(parents=True)
    (folder / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff" + b"\0" * 60)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"label": {}}}))
    state = {
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "0123456789abcdef",
        "_format_type": None,
        "_split": "train",
    }
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def test_a_hugging_face_folder_is_not_called_an_unfinished_pack(tmp_path):
    folder = hugging_face_dataset(tmp_path / "hf")
    with pytest.raises(NotPackedError) as e:
        read_manifest(folder)
    message = str(e.value)
    assert message.startswith(f"{folder}: a Hugging Face datasets folder")
    assert "reads it in place" in message and "gpufeed pack PATH DEST" in message
    assert "unfinished" not in message and "--resume" not in message


def test_a_hugging_face_dataset_dict_is_named_too(tmp_path):
    root = tmp_path / "dd"
    hugging_face_dataset(root / "train")
    hugging_face_dataset(root / "test")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    for folder in (root, root / "train"):
        with pytest.raises(NotPackedError, match="a Hugging Face datasets folder"):
            read_manifest(folder)


def test_a_hugging_face_folder_through_open_dataset(tmp_path):
    """It is read in place (formats/inplace/parquet.py): this one's Arrow file is no Arrow
    stream, an error naming it."""
    import gpufeed

    pytest.importorskip("pyarrow")
    folder = hugging_face_dataset(tmp_path / "hf")
    with pytest.raises(DataError, match="not a readable Parquet or Arrow file") as e:
        gpufeed.open_dataset(folder)
    assert str(folder / "data-00000-of-00001.arrow") in str(e.value)


def test_unsafe_name_rules():
    for name in ("/etc/passwd", "../x", "a/../../x", ".."):
        assert unsafe_name(name) == "leads outside the pack"
    for name in ("", "a//b", "./a", "a/", "a\\..\\b", "a\0b"):
        assert unsafe_name(name) == "is not a plain file name inside the pack"
    for name in ("data.h5", "shards/shard-00000.tar", "..a", "a..b"):
        assert unsafe_name(name) is None


def test_pack_file_refuses_a_nul_or_backslash_with_the_pack_error(tmp_path):
    for name in ("a\0b", "..\\x"):
        with pytest.raises(UnsafePathError, match="not a plain file name"):
            pack_file(tmp_path, name)
