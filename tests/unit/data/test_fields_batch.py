"""The batched read of multi-field packs (gpufeed.data.fields.decode_batch): get_batch holds
what collating the per-sample path gives, __getitems__ the per-sample dicts themselves, for
every field type in every format; ragged fields with and without pad=; a batch decoder on
the image field; bad records left out (on_error) or named."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.batch import collate_fields
from gpufeed.data.fields import decode_batch, decode_fields
from gpufeed.errors import CorruptSampleError, UsageError
from gpufeed.formats import FORMATS
from gpufeed.formats.record import encode_record, member_bytes, npy_shape, split_records
from gpufeed.formats.schema import parse_schema

SCHEMA = {
    "jpg": "jpeg",
    "png": "png",
    "fixed": "float16[2,3]",
    "cplx": "complex64[2]",
    "big": ">i4[3]",
    "bigrag": ">f8[-1]",
    "scalar": "int16[]",
    "tokens": "int32[-1]",
    "boxes": "float32[-1,4]",
    "planes": "uint16[2,-1,-1]",
    "blob": "bytes",
    "text": "str",
    "count": "int",
    "score": "float",
    "meta": "json",
    "zarr": {"type": "array", "dtype": "float64", "shape": [3, 2], "compression": "zstd"},
    "ztok": {"type": "ragged", "dtype": "uint16", "shape": [-1], "compression": "zstd"},
    "ztext": {"type": "str", "compression": "zstd"},
}
N = 9


def _image(fmt: str, i: int, size=(6, 10)) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt.upper())
    return buf.getvalue()


def _sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "jpg": _image("jpeg", i),
        "png": _image("png", i, (6 + i % 2, 10)),  # sizes differ: a list, not a stack
        "fixed": rng.standard_normal((2, 3)).astype(np.float16),
        "cplx": np.array([1 + 2j, i - 1j], dtype=np.complex64),
        "big": np.array([1, -2, i], dtype=">i4"),
        "bigrag": np.arange(i % 4, dtype=">f8") / 3,
        "scalar": np.array(i - 4, dtype=np.int16),
        "tokens": rng.integers(-(2**31), 2**31 - 1, i, dtype=np.int32),  # i = 0: empty
        "boxes": rng.random((i % 3, 4), dtype=np.float32),
        "planes": rng.integers(0, 65535, (2, i % 3 + 1, 3 - i % 2), dtype=np.uint16),
        "blob": bytes(range(i * 7 % 256))[: i * 5] + b"\x00\xff",
        "text": f"caption {i} naïve ☃ \n\t" * i,
        "count": -(2**62) + i,
        "score": [0.1, -1e300, 5e-324, float("nan"), float("inf")][i % 5],
        "meta": {"i": i, "boxes": [[1, 2.5]], "name": None},
        "zarr": rng.standard_normal((3, 2)),
        "ztok": np.arange(i * 50, dtype=np.uint16),
        "ztext": "zstd " * i * 30,
    }


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched")
    for fmt in sorted(FORMATS):
        with gpufeed.Writer(root / fmt, format=fmt, schema=SCHEMA, part_size=4) as w:
            for i in range(N):
                w.write(_sample(i))
    return root


def _same(got, want, where: str) -> None:
    """Equal values, types, dtypes and shapes (NaN equal to NaN, bit for bit)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
        assert got.numpy().tobytes() == want.numpy().tobytes(), where
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{j}]")
    elif isinstance(want, float):
        assert type(got) is float and np.float64(got).tobytes() == np.float64(want).tobytes()
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _reference(ds, indices, decode=True) -> list[dict]:
    """The per-sample path: one record at a time through decode_fields."""
    schema = ds.reader.spec.schema
    count = len(ds)
    return [decode_fields(schema, ds.reader.read(i % count), decode) for i in indices]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("decode", [True, False])
def test_batches_and_samples_match_the_per_sample_path_in_every_format(packs, fmt, decode):
    ds = gpufeed.open_dataset(packs / fmt, map_style=True, decode=decode)
    indices = [4, 0, 8, 4, -2, 1, 2, 5, 3]  # repeats, a negative index, every ragged size
    want = _reference(ds, indices, decode)
    got = ds.__getitems__(indices)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert list(g) == list(w)
        for name in w:
            _same(g[name], w[name], f"{fmt} sample {j} {name}")
    batch = ds.get_batch(indices)
    collated = collate_fields(want)
    assert list(batch) == list(collated)
    for name in collated:
        _same(batch[name], collated[name], f"{fmt} batch {name}")
    assert batch["bigrag"][2].dtype == torch.float64  # big-endian fields come out native
    assert ds[7]["count"] == -(2**62) + 7 and isinstance(ds[7]["score"], float)


@pytest.mark.parametrize("fmt", ["lmdb", "tar"])
def test_ragged_fields_pad_as_collate_fields_pads_them(packs, fmt):
    pad = {"tokens": -1, "boxes": 0.5, "planes": 7, "bigrag": 0}
    ds = gpufeed.open_dataset(packs / fmt, map_style=True, pad=pad)
    for indices in ([3, 1, 8, 0], [2, 2], [0]):  # sizes differ; agree; one empty sample
        batch = ds.get_batch(indices)
        want = collate_fields(_reference(ds, indices), pad=pad)
        assert list(batch) == list(want)
        for name in want:
            _same(batch[name], want[name], f"{indices} {name}")
    same = ds.get_batch([2, 2])
    assert same["tokens"].shape == (2, 2) and same["tokens_mask"].all()


def test_ragged_values_are_one_buffer_stacked_when_their_sizes_agree(packs):
    ds = gpufeed.open_dataset(packs / "mmap")
    spread = ds.get_batch([1, 2, 3])["tokens"]
    assert isinstance(spread, list) and [len(t) for t in spread] == [1, 2, 3]
    storage = {t.untyped_storage().data_ptr() for t in spread}
    assert len(storage) == 1  # copied once, into one buffer of the batch
    agree = ds.get_batch([4, 4])["tokens"]
    assert isinstance(agree, torch.Tensor) and agree.shape == (2, 4)


def test_a_batch_decoder_decodes_the_image_field_with_the_other_fields_in_step(tmp_path):
    schema = {"image": "jpeg", "caption": "int32[32]", "label": "int"}
    with gpufeed.Writer(tmp_path / "p", format="lmdb", schema=schema) as w:
        for i in range(20):
            w.write({"image": _image("jpeg", i, (30, 40)), "caption": np.full(32, i, np.int32),
                     "label": i})  # fmt: skip
    crop = gpufeed.RandomResizedCrop(16, backend="torch")
    ds = gpufeed.open_dataset(tmp_path / "p", decode=crop)
    batch = ds.get_batch(list(range(19, -1, -1)))
    assert batch["image"].shape == (20, 3, 16, 16) and batch["image"].dtype == torch.uint8
    assert batch["caption"].shape == (20, 32) and batch["caption"].dtype == torch.int32
    assert batch["label"].tolist() == list(range(19, -1, -1))
    assert (batch["caption"][:, 0] == batch["label"]).all()
    samples = ds.__getitems__([3, 5])
    assert samples[0]["image"].shape == (3, 16, 16) and samples[1]["label"] == 5
    with gpufeed.Writer(tmp_path / "t", format="lmdb", schema={"t": "str"}) as w:
        w.write({"t": "no image"})
    with pytest.raises(UsageError, match="decodes encoded images.*t: str"):
        gpufeed.open_dataset(tmp_path / "t", decode=crop)


def _records(schema, samples) -> list[bytes]:
    return [encode_record(schema, s) for s in samples]


def test_decode_batch_leaves_out_bad_records_and_says_why():
    schema = parse_schema({"image": "png", "tok": "int64[-1]", "s": "str", "n": "int"})
    good = [{"image": _image("png", i), "tok": np.arange(i), "s": str(i), "n": i} for i in range(6)]
    records = _records(schema, good)
    records[1] = records[1][:-1]  # sizes do not add up
    records[2] = records[2][:20]  # shorter than the image it says
    bad_png = dict(good[3], image=b"\x89PNG\r\n\x1a\n" + bytes(40))
    records[3] = encode_record(schema, bad_png)
    text = encode_record(schema, dict(good[4], s="é"))
    records[4] = text.replace("é".encode(), b"\xff\xfe")  # not UTF-8, same length
    batch, rows, failed = decode_batch(schema, records)
    assert rows.tolist() == [0, 5]
    assert batch["n"].tolist() == [0, 5] and batch["s"] == ["0", "5"]
    assert [t.tolist() for t in batch["tok"]] == [[], [0, 1, 2, 3, 4]]
    assert [j for j, _ in failed] == [1, 2, 3, 4]
    assert "do not add up" in failed[0][1] and "'s'" in failed[3][1]
    assert all(problem.startswith("cannot decode: ") for _, problem in failed)
    empty, rows, failed = decode_batch(schema, [b"", b"\x01"])
    assert rows.tolist() == [] and len(failed) == 2 and empty["tok"] == []


def test_a_dataset_skips_or_names_a_bad_record(tmp_path):
    schema = {"x": "uint8[4]", "s": "str"}
    with gpufeed.Writer(tmp_path / "p", format="mmap", schema=schema) as w:
        for i in range(6):
            w.write({"x": np.full(4, i, np.uint8), "s": "é" * i})
    data = tmp_path / "p" / "encoded.npy"
    raw = bytearray(data.read_bytes())
    at = raw.rfind("é".encode() * 3, 0, raw.find("é".encode() * 4))  # sample 3's text
    raw[at : at + 2] = b"\xff\xfe"
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSampleError, match="sample 3.*'s'"):
        gpufeed.open_dataset(tmp_path / "p").get_batch([2, 3])
    with pytest.warns(UserWarning, match="skipping corrupt samples"):
        ds = gpufeed.open_dataset(tmp_path / "p", on_error="skip")
        batch = ds.get_batch([5, 3, 1])
        samples = ds.__getitems__([3, 4])
    assert batch["x"][:, 0].tolist() == [5, 1] and batch["s"] == ["é" * 5, "é"]
    assert samples[0] is None and samples[1]["s"] == "é" * 4 and ds.skipped == 2


def test_split_records_reads_every_record_head_at_once():
    schema = parse_schema({"a": "bytes", "b": "str"})
    records = _records(schema, [{"a": b"xy" * i, "b": "z" * (3 - i)} for i in range(3)])
    parts = split_records(schema, records)
    assert parts.sizes.tolist() == [[0, 3], [2, 2], [4, 1]] and parts.bad == {}
    assert [bytes(v) for v in parts.column(0).values([2, 1])] == [b"xyxy", b"xy"]


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_npy_headers_are_read_in_each_format_version(version):
    arr = np.arange(12, dtype="<i4").reshape(3, 4)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version)
    data = buf.getvalue()
    shape, start = npy_shape(data)
    assert shape == (3, 4) and data[start:] == arr.tobytes()
    field = parse_schema({"t": "int32[-1,4]"}).fields[0]
    assert npy_shape(member_bytes(field, np.array([3, 4], "<i8").tobytes() + arr.tobytes()))[0] == (
        3,
        4,
    )
