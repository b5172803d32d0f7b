"""WebDataset shards read in place (gpufeed.formats.inplace.webdataset): the cached index serves
only the files it was built from, and a member that cannot be read names its shard and member."""

from __future__ import annotations

import io
import os
import tarfile
import time

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import CorruptSampleError, DataError, StalePackError
from gpufeed.formats.inplace import webdataset as wds


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_shard(path, samples: list[dict[str, bytes]]) -> None:
    """A tar of samples (key -> {suffix: bytes}) as the webdataset package writes them."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i, sample in enumerate(samples):
            for suffix, data in sample.items():
                info = tarfile.TarInfo(f"sample{i:05d}.{suffix}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def captioned(captions: list[str]) -> list[dict[str, bytes]]:
    return [{"cls": str(i).encode(), "txt": c.encode()} for i, c in enumerate(captions)]


def replace_keeping_size_and_mtime(path, samples, in_place: bool) -> None:
    """What `cp -p` / `rsync -t` of a reproducible tar give: new bytes, the same size and
    mtime_ns (ctime is the kernel's: it moves on, the tick after the first write)."""
    before = os.stat(path)
    time.sleep(0.05)  # ctime has a coarse tick: a later write must fall in a later one
    new = path.with_name("new.tmp")
    write_shard(new, samples)
    assert new.stat().st_size == before.st_size
    if in_place:  # the same inode, overwritten
        with open(path, "r+b") as f:
            f.write(new.read_bytes())
        new.unlink()
    else:
        os.replace(new, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("in_place", [False, True], ids=["new-file", "overwritten"])
def test_a_shard_replaced_with_its_size_and_mtime_is_indexed_again(tmp_path, in_place):
    root = tmp_path / "shards"
    root.mkdir()
    write_shard(root / "p-00.tar", captioned(["a cor", "b"]))
    idx = tmp_path / "idx"
    old = gpufeed.open_dataset(root, index_dir=idx)
    assert old[0]["txt"] == "a cor"
    fixed = "a corrected, longer caption"  # still one 512-byte block: the same tar size
    replace_keeping_size_and_mtime(root / "p-00.tar", captioned([fixed, "b"]), in_place)

    fresh = gpufeed.open_dataset(root, index_dir=idx)
    assert fresh[0]["txt"] == fixed and fresh[1]["txt"] == "b"
    if in_place:  # the reader's open file now holds other bytes: its index no longer fits
        with pytest.raises(StalePackError, match="p-00.tar: sample 0, .*changed since it was"):
            old[0]
    else:  # its open file is the old one, whole: old index, old bytes
        assert old[0]["txt"] == "a cor"
    waiting = gpufeed.open_dataset(root, index_dir=idx)
    replace_keeping_size_and_mtime(root / "p-00.tar", captioned(["a cor", "b"]), in_place)
    with pytest.raises(StalePackError, match="p-00.tar: changed since it was indexed"):
        waiting[1]  # opened before, first read after: never the new file through the old index


def test_a_cached_index_that_misplaces_a_member_is_caught_on_read_and_rebuilt(tmp_path):
    """The header before each member is checked on read: an index pointing elsewhere (its
    shard rewritten within the ctime's tick, a damaged cache) is an error, never other bytes."""
    root = tmp_path / "shards"
    root.mkdir()
    write_shard(root / "p-00.tar", captioned(["zero", "one", "two"]))
    idx = tmp_path / "idx"
    gpufeed.open_dataset(root, index_dir=idx)
    (cache,) = idx.iterdir()
    with np.load(cache) as z:
        index = {k: z[k] for k in z.files}
    index["offsets"][1, 1] = index["offsets"][1, 0]  # sample 1's caption -> its .cls member
    index["sizes"][1, 1] = index["sizes"][1, 0]
    np.savez(cache, **index)

    ds = gpufeed.open_dataset(root, index_dir=idx)
    assert ds[0]["txt"] == "zero" and ds[2]["txt"] == "two"
    with pytest.raises(StalePackError, match=r"p-00.tar: sample 1, field 'txt': found the head"):
        ds[1]
    assert not cache.exists()  # forgotten: the next open builds it anew
    assert gpufeed.open_dataset(root, index_dir=idx)[1]["txt"] == "one"


def test_a_cached_index_reaching_past_its_shard_is_rebuilt(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    write_shard(root / "p-00.tar", captioned(["zero", "one"]))
    idx = tmp_path / "idx"
    gpufeed.open_dataset(root, index_dir=idx)
    (cache,) = idx.iterdir()
    with np.load(cache) as z:
        index = {k: z[k] for k in z.files}
    index["offsets"][1, 1] = -1000  # before the file: bytes of whatever precedes the map
    index["sizes"][0, 1] = 10**9
    np.savez(cache, **index)
    ds = gpufeed.open_dataset(root, index_dir=idx)
    assert [ds[i]["txt"] for i in range(2)] == ["zero", "one"]


def test_a_cls_beyond_int64_names_its_shard_and_member_when_read(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    samples = captioned(["zero", "one", "two"])
    samples[1]["cls"] = b"9" * 30
    write_shard(root / "p-00.tar", samples)
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")  # the folder still opens
    assert ds.labels.tolist() == [0, -1, 2] and ds[2]["txt"] == "two"
    with pytest.raises(CorruptSampleError, match="member 'sample00001.cls'") as err:
        ds[1]
    assert str(root / "p-00.tar") in str(err.value)


def tokens(samples: int, first: bytes | None = None, dtype=np.int32) -> list[dict[str, bytes]]:
    out = [{"cls": b"1", "tok.npy": npy(np.arange(i + 1, dtype=dtype))} for i in range(samples)]
    if first is not None:
        out[0]["tok.npy"] = first
    return out


def test_a_bad_first_npy_names_its_shard_and_member_and_the_rest_open(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    write_shard(root / "p-00.tar", tokens(3, first=b"\x93NUMPY garbage"))
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    assert ds.reader.spec.schema.describe() == "cls: int, tok_npy: int32[*]"
    assert ds[2]["tok_npy"].tolist() == [0, 1, 2]
    with pytest.raises(CorruptSampleError, match=r"member 'sample00000.tok.npy'") as err:
        ds[0]
    assert str(root / "p-00.tar") in str(err.value)


def test_no_readable_npy_is_an_error_naming_the_shard_and_member(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    write_shard(root / "p-00.tar", [{"tok.npy": b"not an array"} for _ in range(2)])
    with pytest.raises(DataError, match=r"p-00.tar: member sample00000.tok.npy: not a .npy"):
        gpufeed.open_dataset(root, index_dir=tmp_path / "idx")


def test_an_npy_of_another_dtype_is_refused_not_reinterpreted(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    samples = tokens(3)
    samples[1]["tok.npy"] = npy(np.array([1.5, 2.5], dtype=np.float32))  # int32's itemsize
    samples[2]["tok.npy"] = npy(np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)))
    write_shard(root / "p-00.tar", samples)
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    with pytest.raises(CorruptSampleError, match=r"sample00001.tok.npy.*dtype <f4; the field is"):
        ds[1]
    with pytest.raises(CorruptSampleError, match="Fortran-ordered"):
        ds[2]


def crafted_size(path, size_field: bytes) -> None:
    """A one-member tar whose header declares size_field (checksum fixed up)."""
    write_shard(path, [{"txt": b"hello"}])
    data = bytearray(path.read_bytes())
    data[124:136] = size_field
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "size_field",
    [b"\x80" + (10**12).to_bytes(11, "big"), b"\xff" * 12, b"-0000000005\0"],
    ids=["past-the-end", "negative-base256", "signed"],
)
def test_a_member_size_that_does_not_fit_the_shard_is_an_error_naming_it(tmp_path, size_field):
    root = tmp_path / "shards"
    root.mkdir()
    crafted_size(root / "p-00.tar", size_field)
    with pytest.raises(DataError, match="p-00.tar: ") as err:
        gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    assert str(root / "p-00.tar") in str(err.value)


def test_the_header_check_accepts_what_tar_writers_write(tmp_path):
    """Long names (GNU, pax, truncated name fields) and v7 tars (no ustar magic) read."""
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT, "v7"):
        root = tmp_path / f"s{fmt}"
        root.mkdir()
        with tarfile.open(
            root / "p.tar", "w", format=tarfile.GNU_FORMAT if fmt == "v7" else fmt
        ) as tf:
            for i in range(2):
                stem = ("k" * 130 if fmt != "v7" and fmt != tarfile.USTAR_FORMAT else "k") + str(i)
                for suffix, data in (("cls", b"%d" % i), ("caption.txt", b"c%d" % i)):
                    info = tarfile.TarInfo(f"d/{stem}.{suffix}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        if fmt == "v7":  # strip the magic: tarfile reads it as a v7 header
            data = bytearray((root / "p.tar").read_bytes())
            for pos in range(0, len(data) - 512, 512):
                if data[pos + 257 : pos + 262] == b"ustar":
                    data[pos + 257 : pos + 265] = bytes(8)
                    data[pos + 148 : pos + 156] = b" " * 8
                    data[pos + 148 : pos + 156] = b"%06o\0 " % sum(data[pos : pos + 512])
            (root / "p.tar").write_bytes(bytes(data))
        ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
        assert [ds[i]["caption_txt"] for i in range(2)] == ["c0", "c1"], fmt
        assert ds.labels.tolist() == [0, 1]


def test_in_place_identity_tells_a_restored_copy_from_the_original(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"x" * 10)
    time.sleep(0.05)
    b = tmp_path / "b"
    b.write_bytes(b"y" * 10)
    st = os.stat(a)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(b, a)
    assert wds.in_place_identity(os.stat(a)) != wds.in_place_identity(st)
