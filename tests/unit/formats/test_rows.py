"""Tar packs of fixed-shape samples read as strided rows of their shards' kept maps
(formats/tar/rows.py): the same bytes as the sample-by-sample read, in any order; packs
whose index does not give one stride a shard read as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.errors import CorruptSampleError, DataError
from gpufeed.formats.open import open_reader
from gpufeed.formats.tar.rows import gather_rows, shard_rows, shard_strides
from gpufeed.pagecache import maps

N = 60


@pytest.fixture(scope="module")
def tar_pack(pack_factory):
    """60 samples int16 [3, 8, 10] (480 bytes: not a multiple of 512) in shards of 16, 16,
    16 and 12."""
    classes = {"x": 30, "y": 30}
    return pack_factory(
        "tar", classes=classes, shape=(3, 8, 10), seed=9, dtype=np.int16, shard_size=16
    )


def one_by_one(reader, indices):
    """The sample-by-sample read (os.preadv a sample), the strided rows turned off."""
    reader.__dict__["strides"] = None
    try:
        return reader.read_batch(np.asarray(indices, dtype=np.int64))
    finally:
        del reader.__dict__["strides"]


def test_a_fixed_shape_pack_has_one_stride_a_shard(tar_pack):
    reader = open_reader(tar_pack)
    assert np.diff(reader.shard_start).tolist() == [16, 16, 16, 12]
    assert reader.strides is not None and len(reader.strides) == 4
    assert len(set(reader.strides.tolist())) == 1 and reader.strides[0] % 512 == 0


@pytest.mark.parametrize("order", ["shuffled", "one shard", "reversed run", "repeats"])
def test_rows_gathered_equal_the_sample_by_sample_read(tar_pack, order):
    reader = open_reader(tar_pack)
    indices = {
        "shuffled": np.random.default_rng(1).permutation(N),
        "one shard": np.array([20, 17, 31, 16]),
        "reversed run": np.arange(N)[::-1].copy(),
        "repeats": np.array([5, 5, 59, 0, 59]),
    }[order]
    got = reader.read_rows(indices)
    want = one_by_one(reader, indices)
    assert got.dtype == want.dtype == np.int16 and got.shape == (len(indices), 3, 8, 10)
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(reader.read_batch(indices), want)  # read_batch takes the rows


def test_strides_none_where_the_index_has_no_one_stride():
    shard_start = np.array([0, 3, 5])
    shard = np.array([0, 0, 0, 1, 1])
    offset = np.array([512, 2048, 3584, 512, 2048])
    size = np.full(5, 1000)
    assert shard_strides(shard, offset, size, shard_start, 1000).tolist() == [1536, 1536]
    mixed = size.copy()
    mixed[3] = 900  # samples of different sizes
    assert shard_strides(shard, offset, mixed, shard_start, 1000) is None
    uneven = offset.copy()
    uneven[2] += 512  # not an arithmetic progression
    assert shard_strides(shard, uneven, size, shard_start, 1000) is None
    assert shard_strides(shard, offset, size, shard_start, 1600) is None  # rows would overlap
    assert shard_strides(shard[::-1].copy(), offset, size, shard_start, 1000) is None


def test_a_pack_without_one_stride_is_read_sample_by_sample(tar_pack, monkeypatch):
    reader = open_reader(tar_pack)
    indices = np.array([40, 3, 22, 3])
    want = one_by_one(reader, indices)
    offset = reader.offset.copy()
    offset[5] += 512  # as if one member were longer: no stride for shard 0
    monkeypatch.setattr(reader, "offset", offset)
    assert shard_strides(reader.shard, offset, reader.size, reader.shard_start, 480) is None
    reader.__dict__.pop("strides", None)  # worked out again from the index
    assert reader.strides is None and reader.read_rows(indices) is None
    assert reader.read_batch(indices).tobytes() == want.tobytes()


def test_a_truncated_shard_is_not_read_as_rows(tmp_path):
    data = np.zeros(1000, dtype=np.uint8)
    assert shard_rows(data, 100, 3, 300, 250) is not None  # last row ends at 950
    assert shard_rows(data, 100, 3, 300, 301) is None
    views = {0: shard_rows(data, 0, 2, 400, 100), 1: None}
    assert gather_rows(views.get, np.array([0, 1]), np.array([1, 0]), 100) is None


def test_a_truncated_shard_still_names_the_sample(tar_pack, tmp_path):
    import shutil

    copy = tmp_path / "ds.tar"
    shutil.copytree(tar_pack, copy)
    last = copy / "shard-000003.tar"
    last.write_bytes(last.read_bytes()[:4000])  # samples 48 and 49 whole (stride 2048)
    reader = open_reader(copy)
    assert reader.strides is not None and reader.read_rows(np.array([49, 3])) is None
    assert reader.read_batch(np.array([49, 3])).shape == (2, 3, 8, 10)
    with pytest.raises(CorruptSampleError, match=r"shard-000003.tar: sample 5\d: .*truncated"):
        reader.read_batch(np.array([3, 55]))


def test_shard_maps_are_kept_across_readers(tar_pack):
    maps.forget_maps()
    a, b = open_reader(tar_pack), open_reader(tar_pack)
    a.read_rows(np.array([0, 50]))
    b.read_rows(np.array([1, 51]))
    assert a.handle["maps"] is b.handle["maps"]
    assert sorted(a.handle["maps"]) == [0, 3]
    assert str(tar_pack / "index.npz") in maps.kept_maps()
    maps.forget_maps(tar_pack)
    assert str(tar_pack / "index.npz") not in maps.kept_maps()


def test_strided_rows_survive_a_fork_into_two_loader_workers(tar_pack):
    """Maps made in the parent, then the batches of a map-style and a streaming loader with
    two forked workers: every sample once, the stored bytes."""
    reader = open_reader(tar_pack)
    want = one_by_one(reader, np.arange(N))
    reader.read_rows(np.arange(N))  # the parent maps every shard first
    ds = gpufeed.open_dataset(tar_pack)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context="fork"
    )
    stream = gpufeed.open_dataset(tar_pack, map_style=False, shuffle_buffer=10, read_size=4)
    streamed = gpufeed.make_loader(stream, 8, shuffle=True, seed=2, num_workers=2)
    for batches in (loader, streamed):
        xs = torch.cat([x for x, _ in batches]).numpy()
        assert len(xs) == N
        got = sorted(x.tobytes() for x in xs)
        assert got == sorted(w.tobytes() for w in want)


def test_blocks_of_a_map_style_order_are_populated_in_their_shards(tar_pack, monkeypatch):
    """Blocks of 12 (shards of 16): block 12-23 is populated in shard 0 (12-15), the rest
    (16-23, shard 1) asked for; a batch makes its own blocks resident, none left pending."""
    from gpufeed.formats.tar import reader as tar
    from gpufeed.pagecache import advise as readahead

    populated, asked = [], []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: False)

    def work(addr, n):
        return populated.append(n)

    monkeypatch.setattr(readahead, "populate", work)
    monkeypatch.setattr(readahead, "ask", work)  # the threads' jobs
    monkeypatch.setattr(tar, "advise_willneed", lambda spans: asked.extend(n for _, n in spans))
    reader = open_reader(tar_pack)
    assert reader.reads_ranges_ahead
    reader.read_ahead_ranges([(12, 24), (48, 60)])
    got = reader.read_batch(np.array([50, 13, 23, 59]))
    assert reader.ahead.pending() == 0
    assert sorted(populated) == sorted([reader.run_bytes(12, 16), reader.run_bytes(48, 60)])
    assert asked == [reader.run_bytes(16, 24)]
    assert got.tobytes() == one_by_one(reader, [50, 13, 23, 59]).tobytes()


def test_make_loader_reads_a_map_style_tar_pack_ahead_by_block(tar_pack, monkeypatch):
    from gpufeed.formats.tar.reader import TarReader

    announced = []
    real = TarReader.read_ahead_ranges
    monkeypatch.setattr(
        TarReader, "read_ahead_ranges", lambda self, r: announced.extend(r) or real(self, r)
    )
    monkeypatch.setattr(TarReader, "looks_warm", lambda self: False)  # the pack just written
    ds = gpufeed.open_dataset(tar_pack)
    want = one_by_one(ds.reader, np.arange(N))
    loader = gpufeed.make_loader(ds, 8, shuffle=True, seed=4, num_workers=0, block_size=4)
    xs = torch.cat([x for x, _ in loader]).numpy()
    assert sorted(x.tobytes() for x in xs) == sorted(w.tobytes() for w in want)
    assert announced and sorted(a for a, _ in announced) == list(range(0, N, 4))


def test_the_strided_view_builder_refuses_rows_outside_its_map():
    # the last line behind index.npz's checks at open: numbers that would put a row before
    # the map are an error, never a view of other memory
    data = np.zeros(4096, np.uint8)
    assert shard_rows(data, 512, 3, 1024, 480, "s.tar").shape == (3, 480)
    assert shard_rows(data, 512, 5, 1024, 480, "s.tar") is None  # past the end: truncated
    for first, stride in ((-1000, 1024), (512, -1024), (-(10**9), 10**8)):
        with pytest.raises(DataError, match="s.tar: rows at byte .* leave the shard's map"):
            shard_rows(data, first, 3, stride, 480, "s.tar")
