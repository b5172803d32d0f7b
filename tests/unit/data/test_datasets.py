"""Datasets: workers under fork and spawn, pickling, batch reads, corrupt records, tar streams."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from unit_sources import pack_with_broken_jpeg

import gpufeed
from gpufeed.batch import Batch, collate
from gpufeed.data.map_style import HDF5Dataset
from gpufeed.errors import CorruptSampleError, NotPackedError, UsageError

MAP_FORMATS = ["hdf5", "lmdb", "mmap"]


@pytest.fixture(scope="module")
def packs(pack_factory):
    """Every format packed from the same .npy folder (17 samples) and from the JPEGs."""
    out = {}
    for fmt in ["hdf5", "lmdb", "tar", "mmap"]:
        kw = {"shard_size": 3} if fmt == "tar" else {}
        out[fmt] = pack_factory(fmt, **kw)
        out[fmt + "-jpg"] = pack_factory(fmt, "jpegs", **kw)
    return out


def reference(array_folder):
    files = sorted(array_folder.rglob("*.npy"))
    return np.stack([np.load(f) for f in files])


class EveryFormat(torch.utils.data.Dataset):
    """The map-style datasets of every format behind one DataLoader (one set of spawned
    workers for all of them); index k * 1000 + i is sample i of format k."""

    def __init__(self, datasets):
        self.datasets = datasets

    def __len__(self):
        return 1000 * len(self.datasets)

    def __getitems__(self, indices):
        ks = {i // 1000 for i in indices}
        assert len(ks) == 1, "a batch stays within one dataset"
        return self.datasets[ks.pop()].__getitems__([i % 1000 for i in indices])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_every_format(packs, array_folder, context):
    datasets = [gpufeed.open_dataset(packs[fmt]) for fmt in MAP_FORMATS]
    for ds in datasets:
        ds[0]  # open a handle in the parent first: workers must not reuse it
    batches = [
        [k * 1000 + i for i in range(lo, min(lo + 4, 17))]
        for k in range(3)
        for lo in range(0, 17, 4)
    ]
    loader = DataLoader(
        EveryFormat(datasets),
        batch_sampler=batches,
        num_workers=2,
        multiprocessing_context=context,
        collate_fn=collate,
    )
    got = list(loader)
    assert all(isinstance(b, Batch) for b in got)
    for k in range(3):
        mine = got[k * 5 : (k + 1) * 5]
        samples = torch.cat([b.samples for b in mine])
        labels = torch.cat([b.labels for b in mine])
        assert np.array_equal(samples.numpy(), reference(array_folder)), MAP_FORMATS[k]
        assert labels.tolist() == [0] * 9 + [1] * 8


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_tar_stream_workers_read_each_sample_once(packs, array_folder, context):
    ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=5, seed=3)
    assert len(ds.shards) == 6
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=context)
    seen = [s for batch, _ in loader for s in batch]
    ref = reference(array_folder)
    got = sorted(bytes(s.numpy()) for s in seen)
    assert got == sorted(bytes(r) for r in ref)


def test_tar_shuffle_is_seeded_and_changes_with_epoch(packs):
    def order(seed, epoch):
        ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=8, seed=seed)
        ds.set_epoch(epoch)
        return [bytes(s.numpy()) for s, _ in ds]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert sorted(order(1, 0)) == sorted(order(2, 5))
    plain = gpufeed.open_dataset(
        packs["tar"], map_style=False, shuffle_buffer=0, shuffle_shards=False
    )
    ref = gpufeed.open_dataset(packs["mmap"])
    assert [bytes(s.numpy()) for s, _ in plain] == [bytes(ref[i][0].numpy()) for i in range(17)]
    assert len(plain) == 17


def test_tar_stream_splits_by_rank(packs, monkeypatch):
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=0)
        items = [bytes(s.numpy()) for s, _ in ds]
        assert len(items) == len(ds)
        seen.append(items)
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == len(seen[1]) == 8  # equal shares: the 17th is unread this epoch


@pytest.mark.parametrize("fmt", [*MAP_FORMATS, "tar"])
def test_datasets_pickle_without_handles(packs, fmt):
    ds = gpufeed.open_dataset(packs[fmt], map_style=True)
    first = ds[3]
    assert ds.reader._h is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.reader._h is None
    assert torch.equal(clone[3][0], first[0]) and clone[3][1] == first[1]
    stream = gpufeed.open_dataset(packs["tar"], map_style=False)
    next(iter(stream))
    assert pickle.loads(pickle.dumps(stream)).reader._h is None


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "mmap", "tar"])
def test_encoded_batches_stack_and_transform(packs, fmt):
    ds = gpufeed.open_dataset(
        packs[fmt + "-jpg"],
        map_style=True,
        transform=lambda t: t[:, :8, :8].float() / 255,
        batch_transform=lambda x: x * 2,
    )
    batch = ds.get_batch([0, 12, 5])
    assert batch.samples.shape == (3, 3, 8, 8) and batch.samples.dtype == torch.float32
    assert float(batch.samples.max()) <= 2.0 and float(batch.samples.max()) > 1.0
    assert batch.labels.tolist() == [0, 2, 1]
    raw = gpufeed.open_dataset(packs[fmt + "-jpg"], map_style=True, decode=False)
    b = raw.get_batch([1, 2])
    assert isinstance(b.samples, list) and b.samples[0].dtype == torch.uint8
    assert bytes(b.samples[0].numpy())[:2] == b"\xff\xd8"  # JPEG bytes, not decoded


def test_collate_contract():
    b = Batch(torch.zeros(2, 3), torch.tensor([1, 2]))
    assert collate(b) is b
    pairs = [(torch.ones(2), 1), None, (torch.zeros(2), 4)]
    out = collate(pairs)
    assert isinstance(out, Batch) and out.samples.shape == (2, 2)
    assert out.labels.tolist() == [1, 4]
    assert torch.equal(collate([torch.ones(2), torch.ones(2)]), torch.ones(2, 2))


def test_every_format_opens_map_style_and_tar_streams_on_request(packs):
    for fmt in ("hdf5", "lmdb", "mmap", "tar"):
        ds = gpufeed.open_dataset(packs[fmt])
        assert not isinstance(ds, torch.utils.data.IterableDataset), fmt
        loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
        assert sum(len(labels) for _, labels in loader) == len(ds)
    stream = gpufeed.open_dataset(packs["tar"], map_style=False)
    assert isinstance(stream, torch.utils.data.IterableDataset)
    with pytest.raises(
        UsageError, match=r"shuffle_buffer, seed apply to streamed tar .*map_style=False"
    ):
        gpufeed.open_dataset(packs["tar"], shuffle_buffer=8, seed=1)
    with pytest.raises(
        UsageError, match=r"map_style=False streams tar shards only; this pack is lmdb"
    ):
        gpufeed.open_dataset(packs["lmdb"], map_style=False)


def test_open_dataset_refuses_partial_and_plain_folders(tmp_path):
    (tmp_path / "x.partial").mkdir()
    (tmp_path / "x.partial" / "state.json").write_text("{}")
    with pytest.raises(NotPackedError, match="unfinished pack"):
        gpufeed.open_dataset(tmp_path / "x.partial")
    with pytest.raises(NotPackedError, match="unfinished"):
        gpufeed.open_dataset(tmp_path / "x")
    (tmp_path / "y").mkdir()
    with pytest.raises(NotPackedError, match="not a gpufeed dataset"):
        gpufeed.open_dataset(tmp_path / "y")


def test_wrong_dataset_class_is_refused(packs):
    with pytest.raises(UsageError, match="is a lmdb dataset, not hdf5"):
        HDF5Dataset(packs["lmdb"])


def flip_sample_byte(dest, payload: bytes) -> str:
    """Flip one byte in the middle of `payload` where it is stored under dest; returns file."""
    for f in sorted(dest.iterdir()):
        if f.name in ("manifest.json", "sources.txt"):
            continue
        data = bytearray(f.read_bytes())
        pos = data.find(payload)
        if pos >= 0:
            # every copy: LMDB may keep a stale one in a page freed by a later transaction
            while pos >= 0:
                data[pos + len(payload) // 2] ^= 0x40
                pos = data.find(payload, pos + 1)
            f.write_bytes(bytes(data))
            return f.name
    raise AssertionError("payload not found on disk")


@pytest.fixture()
def unique_pack(tmp_path, pack_factory):
    def build(fmt):
        classes = {"a": 6, "b": 6}
        return pack_factory(fmt, classes=classes, shape=(64,), seed=11, copy_to=tmp_path / fmt)

    return build


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_corrupt_record_raises_naming_file_and_sample(unique_pack, fmt):
    dest = unique_pack(fmt)
    ds = gpufeed.open_dataset(dest, map_style=True, verify_crc=True)
    payload = bytes(ds[7][0].numpy())
    flip_sample_byte(dest, payload)
    ds = gpufeed.open_dataset(dest, map_style=True, verify_crc=True)
    with pytest.raises(
        CorruptSampleError, match=r"sample 7 \(source b/a00001.npy\): crc32 mismatch"
    ):
        ds.get_batch([6, 7, 8])
    unchecked = gpufeed.open_dataset(dest, map_style=True)
    assert bytes(unchecked[7][0].numpy()) != payload  # verify_crc=False reads it (fast path)
    skipping = gpufeed.open_dataset(dest, map_style=True, verify_crc=True, on_error="skip")
    with pytest.warns(UserWarning, match="skipping corrupt samples"):
        batch = skipping.get_batch([6, 7, 8])
    assert batch.samples.shape[0] == 2 and batch.labels.tolist() == [1, 1]
    assert skipping.skipped == 1
    assert skipping[7] is None and skipping.skipped == 2


def test_undecodable_image_raises_with_index(tmp_path):
    dest = pack_with_broken_jpeg(tmp_path)
    ds = gpufeed.open_dataset(dest)
    with pytest.raises(CorruptSampleError, match=r"encoded.npy: sample 1 .*cannot decode"):
        ds.get_batch([0, 1, 2])
    assert len(gpufeed.open_dataset(dest, on_error="skip").get_batch([0, 1, 2]).labels) == 2


def test_index_arrays_are_numpy(packs):
    for fmt in MAP_FORMATS:
        ds = gpufeed.open_dataset(packs[fmt])
        assert isinstance(ds.labels, np.ndarray) and ds.labels.dtype == np.int64
        assert isinstance(ds.reader.crc32, np.ndarray)


def test_out_of_range_index(packs):
    ds = gpufeed.open_dataset(packs["hdf5"])
    with pytest.raises(IndexError, match="sample 17 out of range for 17"):
        ds[17]
    assert torch.equal(ds[-1][0], ds[16][0])


def _stream_batches(path, batch_size, **kw):
    return list(gpufeed.open_dataset(path, map_style=False, **kw).iter_batches(batch_size))


def test_tar_batches_hold_every_sample_once_in_full_batches(packs, array_folder):
    ref = sorted(bytes(r) for r in reference(array_folder))
    for buffer in (0, 4, 100):  # storage order, a small buffer, one bigger than the data
        batches = _stream_batches(packs["tar"], 5, shuffle_buffer=buffer, seed=2)
        assert [len(b.labels) for b in batches] == [5, 5, 5, 2]
        assert all(b.samples.is_contiguous() for b in batches)
        got = sorted(bytes(s.numpy()) for b in batches for s in b.samples)
        assert got == ref, buffer
    stream = _stream_batches(packs["tar"], 5, shuffle_buffer=0, shuffle_shards=False)
    plain = torch.cat([b.samples for b in stream])
    assert np.array_equal(plain.numpy(), reference(array_folder))  # storage order, exactly
    ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=4)
    assert [len(b.labels) for b in ds.iter_batches(5, drop_last=True)] == [5, 5, 5]


def test_tar_batches_are_shuffled_seeded_and_writable(packs):
    def order(seed, epoch=0):
        ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=6, seed=seed)
        ds.set_epoch(epoch)
        return [bytes(s.numpy()) for b in ds.iter_batches(4) for s in b.samples]

    assert order(1) == order(1)
    assert order(1) != order(2) and order(1) != order(1, epoch=1)
    batch = next(
        gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=6).iter_batches(4)
    )
    # the batch owns its memory: gathered out of the shard's read-only map, not a view of it
    assert batch.samples.numpy().flags.writeable
    assert batch.samples.untyped_storage().nbytes() == batch.samples.nbytes
    batch.samples.zero_()  # and writing to it leaves the pack alone
    assert order(1) == order(1)


def test_make_loader_over_tar_yields_whole_batches(packs, array_folder):
    ds = gpufeed.open_dataset(packs["tar"], map_style=False, shuffle_buffer=4)
    for workers in (0, 2):
        loader = gpufeed.make_loader(ds, 4, num_workers=workers)
        batches = list(loader)
        assert all(isinstance(b, Batch) for b in batches)
        got = sorted(bytes(s.numpy()) for b in batches for s in b.samples)
        assert got == sorted(bytes(r) for r in reference(array_folder))


def test_tar_run_reads_equal_member_reads(packs):
    for name in ("tar", "tar-jpg"):
        reader = gpufeed.open_dataset(packs[name], map_style=True).reader
        run = np.arange(3, 6)  # one shard (shard_size 3): one span of the map
        assert reader._run_in_one_shard(run)
        together = reader.read_batch(run)
        apart = [reader.read_batch(np.array([i]))[0] for i in run]
        for a, b in zip(together, apart, strict=True):
            assert bytes(np.asarray(a).tobytes()) == bytes(np.asarray(b).tobytes())
        assert not reader._run_in_one_shard(np.array([2, 3, 4]))  # crosses a shard


def test_truncated_shard_is_named(packs, tmp_path):
    import shutil

    dest = tmp_path / "t.tar"
    shutil.copytree(packs["tar"], dest)
    shard = dest / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:2000])  # cut inside its first sample
    ds = gpufeed.open_dataset(dest, map_style=False, shuffle_buffer=0, shuffle_shards=False)
    with pytest.raises(CorruptSampleError, match=r"shard-000001.tar: sample [34] .*truncated"):
        list(ds.iter_batches(3))


def test_lmdb_missing_or_resized_records_are_named(packs, tmp_path):
    import shutil

    import lmdb

    from gpufeed.formats.lmdb.keys import key

    dest = tmp_path / "l.lmdb"
    shutil.copytree(packs["lmdb"], dest)
    env = lmdb.open(str(dest), subdir=True)
    with env.begin(write=True) as txn:
        txn.delete(key(4))
        txn.put(key(6), b"short")
    env.close()
    ds = gpufeed.open_dataset(dest)
    with pytest.raises(CorruptSampleError, match=r"data.mdb: sample 4 .*record missing"):
        ds.get_batch([3, 4, 5])
    with pytest.raises(CorruptSampleError, match=r"sample 6 .*record is 5 bytes, expected 60"):
        ds.get_batch([5, 6])
