"""gpufeed.verify and gpufeed.inspect: a clean pack of every format verifies, and each kind of
damage is a problem naming the file (and the sample and its source); inspect describes each
format's layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from unit_sources import pack_with_broken_jpeg

import gpufeed
from gpufeed.errors import NotPackedError, UsageError
from gpufeed.formats.checksums import crc32
from gpufeed.formats.manifest import MANIFEST_NAME, file_entry, read_manifest, write_manifest
from gpufeed.tools import verify as verify_mod
from gpufeed.tools.verify import inspect, verify

FORMATS = ("hdf5", "lmdb", "tar", "mmap")


@pytest.fixture(scope="module")
def packs(pack_factory):
    return {fmt: pack_factory(fmt) for fmt in FORMATS}


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


def _replace_labels(dest, fmt, labels) -> tuple[str, str]:
    """Write `labels` where `fmt` keeps its labels, update the manifest's entry; (the file,
    the dataset in it) as a message should name them."""
    if fmt == "hdf5":
        import h5py

        with h5py.File(dest / "data.h5", "a") as f:
            del f["labels"]
            if labels.dtype.kind == "U":  # HDF5's own strings, read back as objects
                f.create_dataset("labels", data=labels.astype(object), dtype=h5py.string_dtype())
            else:
                f["labels"] = labels
        name, dataset = "data.h5", "/labels"
    elif fmt == "mmap":
        np.save(dest / "labels.npy", labels)
        name, dataset = "labels.npy", "labels.npy"
    elif fmt == "tar":
        with np.load(dest / "index.npz") as z:
            arrays = dict(z)
        arrays["labels"] = labels
        np.savez(dest / "index.npz", **arrays)
        name, dataset = "index.npz", "labels"
    else:
        import io

        import lmdb

        buf = io.BytesIO()
        np.save(buf, labels)
        env = lmdb.open(str(dest), subdir=True, lock=False)
        with env.begin(write=True) as txn:
            txn.put(b"__labels__", buf.getvalue())
        env.close()
        name, dataset = "data.mdb", "__labels__"
    m = read_manifest(dest)
    m["files"][name] = file_entry(dest, name)
    write_manifest(dest, m)
    return name, dataset


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "labels",
    [
        np.array([b"a"] * 17),
        np.array(["cat"] * 17),
        np.arange(17, dtype=np.float64),
        np.zeros((17, 2), np.int64),
    ],
    ids=["bytes", "str", "float", "2d"],
)
def test_labels_of_the_wrong_dtype_or_shape_are_a_problem_naming_file_and_dataset(
    tmp_path, array_folder, fmt, labels
):
    """A string /labels crashed verify with UFuncTypeError: it is a problem naming the file
    and the dataset, in every format."""
    dest = fresh(tmp_path, array_folder, fmt)
    name, dataset = _replace_labels(dest, fmt, labels)
    report = verify(dest)
    assert not report.ok and report.samples_checked == 0
    text = "\n".join(str(p) for p in report.problems)
    assert str(dest / name) in text and dataset in text, text
    found = "object" if fmt == "hdf5" and labels.dtype.kind == "U" else str(labels.dtype)
    assert found in text, text  # what was found
    json.dumps(report.to_json())  # and the report is still plain data


def test_verify_of_an_index_the_reader_does_not_check(tmp_path, array_folder):
    """verify's own check: readers may accept an index verify cannot compare (a reader
    built over crafted arrays directly); a problem, never a numpy error."""
    from gpufeed.formats.open import open_reader

    dest = fresh(tmp_path, array_folder, "mmap")
    reader = open_reader(dest)
    reader.crc32 = np.array(["x"] * reader.count)
    report = verify_mod.VerifyReport(str(dest), "mmap", reader.count)
    verify_mod._read_samples(reader, report, False, 256, True)
    assert [str(p) for p in report.problems] == [
        f"{dest / 'crc32.npy'}: holds <U1[17], expected 17 integers (crc32, one a "
        "sample, as the manifest's count says); the pack is damaged or was crafted (re-pack it)"
    ]


def test_inspect_does_not_follow_a_link_out_of_the_pack(tmp_path, array_folder):
    dest = fresh(tmp_path, array_folder)
    (dest / "dangling").symlink_to(tmp_path / "nowhere")
    assert inspect(dest)["count"] == 17


# ---- data read in place (issue 38 item 12): inspect and verify as open_dataset reads it

# the keys inspect gives a pack and data read in place alike, meaning the same
SHARED_KEYS = {
    "path",
    "format",
    "in_place",
    "count",
    "classes",
    "num_classes",
    "sample",
    "size_bytes",
    "disk_bytes",
    "files",
    "bytes_per_sample",
    "checks",
    "checksums",
}


def jpeg_bytes(value: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 10, 3), value, np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_shards(root, bad_jpeg=(), bad_npy=()):
    """Two WebDataset shards of 5 samples (jpg, cls, tokens.npy) written by webdataset."""
    wds = pytest.importorskip("webdataset")
    root.mkdir()
    for k in range(2):
        with wds.TarWriter(str(root / f"part-{k}.tar")) as sink:
            for i in range(5 * k, 5 * k + 5):
                tokens = np.arange(i, dtype=np.int32)
                sink.write(
                    {
                        "__key__": f"s{i:03d}",
                        "jpg": b"\xff\xd8\xff garbage" if i in bad_jpeg else jpeg_bytes(i * 20),
                        "cls": i % 3,
                        "tokens.npy": b"not an array" if i in bad_npy else tokens,
                    }
                )
    return root


def test_inspect_an_image_folder_in_place(jpeg_folder, packs, tmp_path):
    idx = tmp_path / "idx"
    info = inspect(jpeg_folder, index_dir=idx)
    assert (info["format"], info["kind"], info["in_place"]) == ("imagefolder", "image folder", True)
    assert info["count"] == 13 and info["classes"] == ["cat", "dog", "eel"]
    assert info["num_classes"] == 3 and info["labels"] == "class folders"
    assert info["sample"]["kind"] == "encoded" and info["files"] == 13
    images = sorted(jpeg_folder.rglob("*.jpg"))
    assert info["size_bytes"] == sum(p.stat().st_size for p in images)
    assert info["checksums"] is False and "every sample decoded" in info["checks"]
    (cached,) = idx.iterdir()
    assert info["index"] == {"path": str(cached), "status": "built"}
    assert inspect(jpeg_folder, index_dir=idx)["index"]["status"] == "cached"
    pack_info = inspect(packs["tar"])
    assert SHARED_KEYS <= set(info) and SHARED_KEYS <= set(pack_info)
    assert pack_info["in_place"] is False and pack_info["checksums"] is True
    json.dumps(info)


def test_verify_names_a_corrupt_jpeg_in_an_image_folder(tmp_path, make_images):
    files = make_images(tmp_path / "src", {"a": 3, "b": 2}, ext=".jpg")
    files[3].write_bytes(b"\xff\xd8\xff garbage")  # b/img0000.jpg
    report = verify(tmp_path / "src", index_dir=tmp_path / "idx")
    assert not report.ok and report.bad_samples == [3]
    (problem,) = report.problems
    assert problem.file == str(files[3]) and "cannot decode" in problem.message
    assert report.samples_checked == 5 and report.files_checked == 5
    out = report.to_json()
    assert out["in_place"] is True and out["checksums"] is False
    assert out["kind"] == "image folder" and out["checks"] == in_place_checks()
    assert "no checksums" in report.summary() and "FAILED" in report.summary()


def in_place_checks() -> list[str]:
    from gpufeed.tools.in_place import IN_PLACE_CHECKS

    return IN_PLACE_CHECKS


def test_a_clean_image_folder_verifies(jpeg_folder, tmp_path):
    report = verify(jpeg_folder, index_dir=tmp_path / "idx")
    assert report.ok and report.samples_checked == 13 and report.problems_total == 0
    assert "read in place" in report.summary() and "no checksums" in report.summary()


def test_webdataset_shards_in_place(tmp_path):
    root = write_shards(tmp_path / "shards", bad_jpeg={6}, bad_npy={2})
    info = inspect(root, index_dir=tmp_path / "idx")
    assert (info["format"], info["count"]) == ("webdataset", 10)
    assert info["shards"] == info["files"] == 2
    assert info["sample"]["text"] == "cls: int, jpg: image/jpeg, tokens_npy: int32[*]"
    assert info["labels"] == "the cls member" and info["classes"] is None
    assert info["size_bytes"] == sum(p.stat().st_size for p in root.iterdir())
    assert info["index"]["status"] == "built" and info["dropped"] == []
    report = verify(root, index_dir=tmp_path / "idx")
    assert report.bad_samples == [2, 6] and report.samples_checked == 9
    npy, jpg = report.problems
    assert npy.file == str(root / "part-0.tar") and "s002.tokens.npy" in npy.message
    assert jpg.file == str(root / "part-1.tar")
    assert "member 's006.jpg' (field 'jpg'): cannot decode" in jpg.message
    assert verify(tmp_path / "shards" / "part-{0..0}.tar", index_dir=tmp_path / "idx").count == 5


def test_a_foreign_hdf5_file_in_place_given_its_datasets(tmp_path, packs):
    import h5py

    path = tmp_path / "theirs.h5"
    with h5py.File(path, "w") as f:
        f["images"] = np.arange(6 * 12, dtype=np.uint8).reshape(6, 3, 2, 2)
        f["labels"] = np.arange(6) % 2
        f["names"] = np.array([b"x"] * 6)
    with pytest.raises(NotPackedError, match="datasets"):
        inspect(path)  # which datasets hold a row per sample is not ours to guess
    datasets = {"image": "/images", "label": "/labels"}
    info = inspect(path, datasets=datasets)
    assert (info["format"], info["count"], info["files"]) == ("hdf5-file", 6, 1)
    assert info["sample"]["text"] == "image: uint8[3,2,2], label: int"
    assert info["datasets"] == datasets and info["index"] is None
    report = verify(path, datasets=["/images", "/labels", "/names"])
    assert report.ok and report.samples_checked == 6 and report.files_checked == 1
    with pytest.raises(UsageError, match=r"datasets= \(--datasets\) apply to local data"):
        verify(packs["hdf5"], datasets=datasets)
