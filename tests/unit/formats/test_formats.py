"""Round trips through every format: bytes and arrays come back exact, plain tools read them."""

from __future__ import annotations

import io
import json

import h5py
import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.batch import Batch
from gpufeed.data.decoders import decode_image
from gpufeed.data.map_style import HDF5Dataset, LMDBDataset
from gpufeed.formats.open import open_reader

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]


def source_arrays(root):
    files = sorted(root.rglob("*.npy"))
    return [np.load(f) for f in files], [0 if f.parent.name == "x" else 1 for f in files]


@pytest.mark.parametrize("fmt", FORMATS)
def test_arrays_round_trip_exact(array_folder, tmp_path, fmt):
    dest = tmp_path / f"ds.{fmt}"
    manifest = gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True, part_size=4)
    arrays, labels = source_arrays(array_folder)
    assert manifest["count"] == len(arrays) == 17
    assert manifest["classes"] == ["x", "y"]
    assert manifest["sample"] == {"kind": "array", "dtype": "|u1", "shape": [3, 4, 5]}
    assert json.loads((dest / "manifest.json").read_text()) == manifest
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == 17
    for i in range(17):
        sample, label = ds[i]
        assert isinstance(sample, torch.Tensor) and sample.dtype == torch.uint8
        assert np.array_equal(sample.numpy(), arrays[i])
        assert label == labels[i] and isinstance(label, int)
    batch = ds.get_batch([16, 0, 3, 3])
    assert isinstance(batch, Batch)
    assert batch.samples.shape == (4, 3, 4, 5) and batch.samples.is_contiguous()
    assert batch.labels.dtype == torch.int64
    assert batch.labels.tolist() == [labels[16], labels[0], labels[3], labels[3]]
    for j, i in enumerate([16, 0, 3, 3]):
        assert np.array_equal(batch.samples[j].numpy(), arrays[i])


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_images_keep_source_bytes(jpeg_folder, tmp_path, fmt):
    dest = tmp_path / f"img.{fmt}"
    gpufeed.pack(jpeg_folder, dest, format=fmt, workers=1, quiet=True, encode="keep")
    files = sorted(jpeg_folder.rglob("*.jpg"))
    reader = open_reader(dest)
    assert reader.spec.kind == "encoded"
    for i, f in enumerate(files):
        assert bytes(reader.read(i)) == f.read_bytes()
    ds = gpufeed.open_dataset(dest, map_style=True)
    sample, label = ds[4]
    assert sample.shape == (3, 20, 24) and sample.dtype == torch.uint8
    # torchvision (in the images) and PIL may round JPEG pixels differently: compare with the
    # decoder in use, and with PIL within JPEG decoder tolerance
    assert torch.equal(sample, decode_image(files[4].read_bytes()))
    expect = np.asarray(Image.open(files[4]).convert("RGB")).transpose(2, 0, 1)
    assert np.abs(sample.numpy().astype(int) - expect).max() <= 3
    assert label == 1 and ds.classes == ["cat", "dog", "eel"]


def test_decode_image_png_exact_and_channels(tmp_path):
    rng = np.random.default_rng(4)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    gray = rng.integers(0, 256, (5, 7), dtype=np.uint8)
    for pixels in (rgb, gray, np.dstack([rgb, gray])):  # RGB, L, RGBA
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        t = decode_image(buf.getvalue())
        assert t.shape == (3, 5, 7) and t.dtype == torch.uint8 and t.is_contiguous()
        expect = np.asarray(Image.fromarray(pixels).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(t.numpy(), expect)


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "mmap"])
def test_raw_images_are_decoded_chw(image_folder, tmp_path, fmt):
    dest = tmp_path / f"raw.{fmt}"
    m = gpufeed.pack(image_folder, dest, format=fmt, workers=1, quiet=True, encode="raw")
    assert m["sample"]["shape"] == [3, 12, 16]
    files = sorted(image_folder.rglob("*.png"))
    ds = gpufeed.open_dataset(dest)
    batch = ds.get_batch(list(range(len(files))))
    for i, f in enumerate(files):
        expect = np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(batch.samples[i].numpy(), expect)
    assert batch.labels.tolist() == [0] * 7 + [1] * 5


def test_hdf5_plain_h5py_reads_it(array_folder, tmp_path):
    dest = tmp_path / "ds.hdf5"
    gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    arrays, labels = source_arrays(array_folder)
    with h5py.File(dest / "data.h5", "r") as f:
        assert np.array_equal(f["samples"][...], np.stack(arrays))
        assert f["labels"][...].tolist() == labels
        assert f["crc32"].dtype == np.uint32


def test_hdf5_encoded_plain_h5py_reads_it(jpeg_folder, tmp_path):
    dest = tmp_path / "img.hdf5"
    gpufeed.pack(jpeg_folder, dest, format="hdf5", workers=1, quiet=True)
    files = sorted(jpeg_folder.rglob("*.jpg"))
    with h5py.File(dest / "data.h5", "r") as f:
        offsets = f["offsets"][...]
        for i in (0, len(files) - 1):
            data = f["encoded"][offsets[i] : offsets[i + 1]].tobytes()
            assert data == files[i].read_bytes()


@pytest.mark.parametrize("compression", ["gzip:1", "lzf"])
def test_hdf5_compressed_matches_uncompressed(array_folder, tmp_path, compression):
    plain = tmp_path / "plain"
    comp = tmp_path / "comp"
    gpufeed.pack(array_folder, plain, format="hdf5", workers=1, quiet=True)
    gpufeed.pack(
        array_folder,
        comp,
        format="hdf5",
        workers=1,
        quiet=True,
        compression=compression,
    )
    with h5py.File(comp / "data.h5", "r") as f:
        assert f["samples"].compression == compression.split(":")[0]
        assert f["samples"].chunks is not None
    a, b = gpufeed.open_dataset(plain), gpufeed.open_dataset(comp)
    assert a.reader.mmap_offset is not None and b.reader.mmap_offset is None
    idx = [16, 2, 2, 9, 0, 5]
    assert torch.equal(a.get_batch(idx).samples, b.get_batch(idx).samples)


def test_hdf5_h5py_path_equals_mmap_path(array_folder, tmp_path):
    dest = tmp_path / "ds"
    gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    fast = HDF5Dataset(dest)
    slow = HDF5Dataset(dest, use_mmap=False)
    assert slow.reader.mmap_offset is None
    for idx in ([3, 1, 2], [0, 16], list(range(17)), [5, 5, 5], [15, 4, 10, 0]):
        assert torch.equal(fast.get_batch(idx).samples, slow.get_batch(idx).samples)


def test_mapped_hdf5_encoded_samples_are_plain_views_of_the_map(tmp_path):
    """Not np.memmap slices: each finalizes a memmap (a JPEG batch of 256 read in 0.85 ms
    against 0.11 ms, docs/benchmarks.md). The same bytes as h5py reads."""
    from unit_sources import write_images

    write_images(tmp_path / "src", {"a": 4, "b": 3}, ext=".jpg")
    dest = tmp_path / "ds.h5"
    gpufeed.pack(tmp_path / "src", dest, format="hdf5", workers=1, quiet=True)
    mapped, plain = open_reader(dest), open_reader(dest, use_mmap=False)
    assert mapped.spec.kind == "encoded" and mapped.mmap_offset is not None
    idx = np.array([6, 0, 3, 3])
    views, reads = mapped.read_batch(idx), plain.read_batch(idx)
    assert all(type(v) is np.ndarray and not v.flags.owndata for v in views)
    assert [v.tobytes() for v in views] == [bytes(r) for r in reads]


def test_lmdb_plain_lmdb_reads_it(array_folder, tmp_path):
    dest = tmp_path / "ds.lmdb"
    gpufeed.pack(array_folder, dest, format="lmdb", workers=1, quiet=True)
    arrays, labels = source_arrays(array_folder)
    assert not (dest / "lock.mdb").exists()
    env = lmdb.open(str(dest), readonly=True, lock=False)
    with env.begin() as txn:
        meta = json.loads(txn.get(b"__gpufeed__"))
        assert meta["count"] == 17 and meta["sample"]["shape"] == [3, 4, 5]
        raw = txn.get(b"%010d" % 7)
        assert np.array_equal(np.frombuffer(raw, np.uint8).reshape(3, 4, 5), arrays[7])
        assert np.load(io.BytesIO(txn.get(b"__labels__"))).tolist() == labels
        keys = [k for k, _ in txn.cursor()]
    env.close()
    assert keys[:17] == [b"%010d" % i for i in range(17)]


def test_lmdb_reader_reads_ahead_unless_told_not_to(array_folder, tmp_path):
    # readahead=False (MADV_RANDOM) made cold block-shuffled reads one page fault per 4 KiB
    # page (13-20x slower measured); the default keeps the kernel's read-around.
    dest = tmp_path / "ds.lmdb"
    gpufeed.pack(array_folder, dest, format="lmdb", workers=1, quiet=True)
    arrays, _ = source_arrays(array_folder)
    ahead = LMDBDataset(dest)
    assert ahead.reader.handle.flags()["readahead"] is True
    batch = ahead.get_batch([3, 1, 2]).samples
    ahead.close()
    random = LMDBDataset(dest, readahead=False)
    assert random.reader.handle.flags()["readahead"] is False
    assert torch.equal(random.get_batch([3, 1, 2]).samples, batch)
    assert np.array_equal(batch[0].numpy(), arrays[3])
    random.close()


def test_lmdb_map_size_grows_when_it_fills(array_folder, tmp_path, monkeypatch):
    from gpufeed.formats.lmdb import writer as lmdb_format

    monkeypatch.setattr(lmdb_format, "FIRST_MAP_SIZE", 64 << 10)
    dest = tmp_path / "ds.lmdb"
    gpufeed.pack(array_folder, dest, format="lmdb", workers=1, quiet=True)
    arrays, _ = source_arrays(array_folder)
    ds = gpufeed.open_dataset(dest)
    assert np.array_equal(ds.get_batch(list(range(17))).samples.numpy(), np.stack(arrays))


def test_mmap_npy_and_pt_containers(array_folder, tmp_path):
    arrays, _ = source_arrays(array_folder)
    gpufeed.pack(array_folder, tmp_path / "n", format="mmap", workers=1, quiet=True)
    gpufeed.pack(
        array_folder,
        tmp_path / "p",
        format="mmap",
        workers=1,
        quiet=True,
        container="pt",
    )
    mm = np.load(tmp_path / "n" / "samples.npy", mmap_mode="r")
    assert isinstance(mm, np.memmap) and np.array_equal(mm, np.stack(arrays))
    t = torch.load(tmp_path / "p" / "samples.pt", mmap=True, weights_only=True)
    assert np.array_equal(t.numpy(), np.stack(arrays))
    assert not (tmp_path / "p" / "samples.npy").exists()
    a = gpufeed.open_dataset(tmp_path / "n")
    b = gpufeed.open_dataset(tmp_path / "p")
    assert torch.equal(a.get_batch([4, 1]).samples, b.get_batch([4, 1]).samples)


def test_tar_shards_read_by_webdataset(jpeg_folder, tmp_path):
    wds = pytest.importorskip("webdataset")
    dest = tmp_path / "shards"
    m = gpufeed.pack(jpeg_folder, dest, format="tar", workers=1, quiet=True, shard_size=4)
    files = sorted(jpeg_folder.rglob("*.jpg"))
    assert m["layout"]["shards"] == [f"shard-{i:06d}.tar" for i in range(4)]
    assert m["layout"]["pattern"] == "shard-{000000..000003}.tar"
    url = str(dest / m["layout"]["pattern"])
    got = list(wds.WebDataset(url, shardshuffle=False))
    assert [s["__key__"] for s in got] == [f"{i:09d}" for i in range(len(files))]
    for i, s in enumerate(got):
        assert s["jpg"] == files[i].read_bytes()
        assert int(s["cls"]) == (0 if i < 4 else 1 if i < 10 else 2)


def test_tar_arrays_read_by_webdataset_as_npy(array_folder, tmp_path):
    wds = pytest.importorskip("webdataset")
    dest = tmp_path / "shards"
    m = gpufeed.pack(array_folder, dest, format="tar", workers=1, quiet=True, shard_bytes=3000)
    arrays, labels = source_arrays(array_folder)
    assert len(m["layout"]["shards"]) > 1
    for name in m["layout"]["shards"]:
        assert (dest / name).stat().st_size <= 3000 + 10240  # one record of tar padding
    url = str(dest / m["layout"]["pattern"])
    got = list(wds.WebDataset(url, shardshuffle=False).decode())
    assert len(got) == 17
    for i, s in enumerate(got):
        assert np.array_equal(s["npy"], arrays[i]) and s["cls"] == labels[i]


def test_tar_shard_size_limits(array_folder, tmp_path):
    m = gpufeed.pack(
        array_folder, tmp_path / "t", format="tar", workers=1, quiet=True, shard_size=5
    )
    assert m["layout"]["shard_counts"] == [5, 5, 5, 2]


def test_tar_member_headers_are_the_bytes_tarfile_writes():
    """formats/tar/reader.py builds ustar headers itself (tarfile's cost most of a tar pack's
    assembly): byte for byte what tarfile writes, so packs stay the same."""
    import tarfile

    from gpufeed.formats.tar.members import member_header

    for name, size in [("000000001.jpg", 0), ("000000001.caption.txt", 12345),
                       ("é" * 40, 8**11 - 1), ("x" * 100, 5)]:  # fmt: skip
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = (
            size,
            0,
            0o644,
            0,
            0,
            "",
            "",
        )
        assert member_header(name, size) == ti.tobuf(
            tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"
        )


@pytest.mark.parametrize("source", ["array_folder", "jpeg_folder"])
def test_tar_consecutive_batches_across_shards_read_a_run_per_shard(source, request, tmp_path):
    """A batch of consecutive samples that spans shards is read as one run per shard (no
    read a sample) and gives the samples one-at-a-time reads give, in order."""
    from gpufeed.formats.tar import reader as tar

    dest = tmp_path / "shards"
    m = gpufeed.pack(
        request.getfixturevalue(source), dest, format="tar", workers=1, quiet=True, shard_size=3
    )
    assert len(m["layout"]["shards"]) >= 4
    ds = gpufeed.open_dataset(dest, decode=False)
    reader = ds.reader
    n = len(ds)
    singles = [reader.read_batch(np.array([i])) for i in range(n)]
    indices = np.arange(1, n - 1)
    assert len(reader._shard_runs(indices)) == len(np.unique(reader.shard[indices]))
    calls = []
    real = tar.TarReader._read_run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            tar.TarReader, "_read_run", lambda self, a, b: calls.append((a, b)) or real(self, a, b)
        )
        got = reader.read_batch(indices)
    # one read a shard (a shard's lone sample is read the per-sample way)
    assert len(calls) == sum(len(p) > 1 for p in reader._shard_runs(indices)) >= 3
    for k, i in enumerate(indices.tolist()):
        want = singles[i][0]
        assert bytes(np.asarray(got[k]).tobytes()) == bytes(np.asarray(want).tobytes())
    assert len(reader._shard_runs(np.array([5, 2, 9]))) == 1  # not consecutive: as it is
