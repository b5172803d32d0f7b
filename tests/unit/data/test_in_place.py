"""Existing data read in place: WebDataset shards written by the webdataset package itself
(index cached outside the data), an ImageFolder tree (listing cached), someone else's HDF5
file given its dataset names; and `gpufeed pack` converting each."""

from __future__ import annotations

import io
import os

import h5py
import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.cli import main
from gpufeed.errors import DataError, NotPackedError, UsageError
from gpufeed.formats.inplace import webdataset as wdsindex
from gpufeed.formats.inplace import webdataset_index as webdataset_scan
from gpufeed.loading.make import make_loader

wds = pytest.importorskip("webdataset")
N = 23


def jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 10, 3), i * 9 % 256, np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def wds_sample(i: int) -> dict:
    return {
        "__key__": f"sample{i:05d}",
        "jpg": jpeg(i),
        "cls": i % 4,
        "caption.txt": f"a caption {i} ☃",
        "tokens.npy": np.arange(i % 6, dtype=np.int32) * i,
        "meta.json": {"i": i, "tags": ["x"] * (i % 2)},
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds") / "shards"
    root.mkdir()
    with wds.ShardWriter(str(root / "part-%04d.tar"), maxcount=10, verbose=0) as sink:
        for i in range(N):
            sink.write(wds_sample(i))
    for p in root.iterdir():  # the data is read-only: nothing may be written beside it
        p.chmod(0o444)
    root.chmod(0o555)
    yield root
    root.chmod(0o755)


def check_wds(ds) -> None:
    assert len(ds) == N
    assert ds.reader.spec.schema.describe() == (
        "caption_txt: str, cls: int, jpg: image/jpeg, meta_json: json, tokens_npy: int32[*]"
    )
    for i in (0, 7, 10, 22):
        s = ds[i]
        want = wds_sample(i)
        assert s["cls"] == i % 4 and s["caption_txt"] == want["caption.txt"]
        assert s["tokens_npy"].dtype == torch.int32
        np.testing.assert_array_equal(s["tokens_npy"].numpy(), want["tokens.npy"])
        assert s["meta_json"] == want["meta.json"] and s["jpg"].shape == (3, 8, 10)
    np.testing.assert_array_equal(ds.labels, np.arange(N) % 4)


def test_webdataset_shards_are_read_in_place_with_a_cached_index(shards, tmp_path, monkeypatch):
    before = sorted(os.listdir(shards))
    check_wds(gpufeed.open_dataset(shards, index_dir=tmp_path / "idx"))
    assert sorted(os.listdir(shards)) == before  # nothing written beside the data
    (cached,) = (tmp_path / "idx").iterdir()
    assert cached.name.startswith("webdataset-")

    def no_rebuild(_):
        raise AssertionError("the cached index was not used")

    monkeypatch.setattr(wdsindex, "_build", no_rebuild)
    check_wds(gpufeed.open_dataset(shards, index_dir=tmp_path / "idx"))
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "idx"))
    check_wds(gpufeed.open_dataset(shards))  # the environment names the same cache


def test_a_changed_shard_is_indexed_again(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    with wds.ShardWriter(str(root / "p-%02d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(5):
            sink.write(wds_sample(i))
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    assert len(ds) == 5
    with wds.ShardWriter(str(root / "p-%02d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(8):
            sink.write(wds_sample(i))
    os.utime(root / "p-00.tar", ns=(1, 1))
    with pytest.raises(DataError, match="changed since it was indexed"):
        ds[0]  # the old index is never used over new data
    assert len(gpufeed.open_dataset(root, index_dir=tmp_path / "idx")) == 8
    assert len(gpufeed.open_dataset(root / "p-{00..00}.tar", index_dir=tmp_path / "idx")) == 8


def test_make_loader_reads_webdataset_shards_in_place_with_workers(shards, tmp_path):
    ds = gpufeed.open_dataset(shards, index_dir=tmp_path / "idx", pad={"tokens_npy": 0})
    seen = [i for b in make_loader(ds, 5, shuffle=True, num_workers=2) for i in b["cls"].tolist()]
    assert sorted(seen) == sorted(np.arange(N) % 4)
    with pytest.raises(UsageError, match="stores no checksums"):
        gpufeed.open_dataset(shards, index_dir=tmp_path / "idx", verify_crc=True)


def test_gpufeed_pack_converts_webdataset_shards(shards, tmp_path):
    m = gpufeed.pack(shards, tmp_path / "p", "hdf5", quiet=True, index_dir=tmp_path / "idx")
    assert m["count"] == N and m["source"]["kind"] == "python"
    check_wds(gpufeed.open_dataset(tmp_path / "p"))
    assert gpufeed.verify(tmp_path / "p", decode=True).ok


def test_an_image_folder_is_read_in_place_like_its_pack(jpeg_folder, tmp_path):
    ds = gpufeed.open_dataset(jpeg_folder, index_dir=tmp_path / "idx")
    gpufeed.pack(jpeg_folder, tmp_path / "p", "lmdb", quiet=True)
    packed = gpufeed.open_dataset(tmp_path / "p")
    assert len(ds) == len(packed) == 13 and ds.classes == packed.classes == ["cat", "dog", "eel"]
    for i in range(len(ds)):
        (a, la), (b, lb) = ds[i], packed[i]
        assert la == lb and torch.equal(a, b)
    assert [p.name for p in (tmp_path / "idx").iterdir()][0].startswith("imagefolder-")


def test_an_image_folder_listing_follows_changes(tmp_path, make_images):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2, "b": 2})
    assert len(gpufeed.open_dataset(root, index_dir=tmp_path / "idx")) == 4
    make_images(root, {"c": 3}, seed=5)
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    assert len(ds) == 7 and ds.classes == ["a", "b", "c"]
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    with pytest.raises(NotPackedError, match="not an image folder to read in place"):
        gpufeed.open_dataset(empty, index_dir=tmp_path / "idx")


@pytest.fixture()
def other_h5(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["data/images"] = np.arange(10 * 2 * 3, dtype=np.float32).reshape(10, 2, 3)
        f["data/labels"] = np.arange(10) % 3
        f["data/score"] = np.linspace(0, 1, 10)
        f.create_dataset("names", data=[f"n{i}" for i in range(10)], dtype=h5py.string_dtype())
        ragged = f.create_dataset("tok", (10,), dtype=h5py.vlen_dtype(np.int16))
        for i in range(10):
            ragged[i] = np.arange(i, dtype=np.int16)
        f["short"] = np.zeros(3)
    return path


def test_someone_elses_hdf5_file_read_given_its_dataset_names(other_h5):
    ds = gpufeed.open_dataset(
        other_h5,
        datasets={"image": "data/images", "label": "/data/labels", "score": "data/score",
                  "name": "names", "tok": "tok"},
    )  # fmt: skip
    s = ds[4]
    assert s["image"].shape == (2, 3) and s["image"][0, 0] == 24 and s["label"] == 1
    assert s["name"] == "n4" and s["score"] == pytest.approx(4 / 9)
    assert s["tok"].dtype == torch.int16 and s["tok"].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(ds.labels, np.arange(10) % 3)
    assert [x["name"] for x in ds[[9, 0, 9]]] == ["n9", "n0", "n9"]
    assert list(gpufeed.open_dataset(other_h5, datasets=["names"])[0]) == ["names"]
    with pytest.raises(DataError, match=r"no dataset \['nope'\]; it has .*data/images"):
        gpufeed.open_dataset(other_h5, datasets={"x": "nope"})
    with pytest.raises(DataError, match="different numbers of rows"):
        gpufeed.open_dataset(other_h5, datasets=["names", "short"])
    # without dataset names it is not read: the error says how, and what the file holds
    with pytest.raises(NotPackedError, match=r"name its datasets") as err:
        gpufeed.open_dataset(other_h5)
    assert "/data/images float32[10, 2, 3]" in str(err.value)
    assert "/tok object[10]" in str(err.value)


def test_an_hdf5_file_without_dataset_names_is_refused_by_pack_saying_how(
    other_h5, tmp_path, capsys
):
    dest = tmp_path / "p"
    with pytest.raises(UsageError, match=r"--datasets image=/images.*it has: /data/images"):
        gpufeed.pack(other_h5, dest, format="tar")
    assert not dest.exists() and not (tmp_path / "p.partial").exists()
    # the CLI said "list file is not UTF-8 text": the file was taken for a list of paths
    assert main(["pack", str(other_h5), str(dest), "-f", "lmdb"]) == 2
    assert main(["inspect", str(other_h5)]) != 0
    assert "it has: /data/images" in capsys.readouterr().err


def test_a_file_inside_a_pack_is_pointed_at_its_pack(tmp_path, make_arrays):
    dest = tmp_path / "pack"
    make_arrays(tmp_path / "src", {"a": 2, "b": 2})
    gpufeed.pack(tmp_path / "src", dest, format="hdf5")
    (inner,) = [p for p in dest.iterdir() if p.suffix == ".h5"]
    with pytest.raises(NotPackedError, match=f"a file of the gpufeed pack {dest}"):
        gpufeed.open_dataset(inner)


def test_gpufeed_pack_converts_an_hdf5_file_from_the_cli(other_h5, tmp_path, capsys):
    dest = tmp_path / "p"
    fields = "image=data/images,name=names"
    assert main(["pack", str(other_h5), str(dest), "-f", "tar", "--datasets", fields]) == 0
    assert "packed 10 samples" in capsys.readouterr().out
    s = gpufeed.open_dataset(dest, map_style=True)[9]
    assert s["name"] == "n9" and s["image"][1, 2] == 9 * 6 + 5
    bad = ["pack", str(other_h5), str(tmp_path / "q"), "-f", "tar", "--datasets", "a=x,b"]
    with pytest.raises(SystemExit) as exit_:
        main(bad)
    assert exit_.value.code == 2 and "every dataset as FIELD=PATH" in capsys.readouterr().err


def test_the_header_scan_lists_what_tarfile_lists(tmp_path):
    """The index's own tar header walk (ustar, pax and GNU long names) against tarfile."""
    import tarfile

    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        path = tmp_path / f"t{fmt}.tar"
        with tarfile.open(path, "w", format=fmt) as tf:
            for name, data in [("a.txt", b"x"), ("d/" + "é" * 80 + ".jpg", b"y" * 700),
                               ("n" * 120 + ".cls", b"3"), ("e.bin", b"")]:  # fmt: skip
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            tf.addfile(_dir_info())
        with tarfile.open(path) as tf:
            want = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
        assert list(webdataset_scan.members(path)) == want and len(want) == 4


def _dir_info():
    import tarfile

    info = tarfile.TarInfo("folder")
    info.type = tarfile.DIRTYPE
    return info
