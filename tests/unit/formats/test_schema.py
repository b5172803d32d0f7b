"""The sample schema: every field type in every format, round trip exact (dtype, shape,
ragged sizes, values), the manifest's schema, and what is refused with a message."""

from __future__ import annotations

import io
import json
import re
import tarfile

import h5py
import lmdb
import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.errors import DataError, UsageError
from gpufeed.formats import FORMATS
from gpufeed.formats.record import decode_record, encode_record, split_record
from gpufeed.formats.schema import infer_schema, parse_schema
from gpufeed.formats.spec import FORMAT_VERSION, SampleSpec


def _image(fmt: str, seed: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(
        buf, format=fmt.upper(), **({"lossless": True} if fmt == "webp" else {})
    )
    return buf.getvalue(), pixels


SCHEMA = {
    "jpg": "jpeg",
    "png": "png",
    "webp": "webp",
    "fixed": "float16[2,3]",
    "cplx": "complex64[2]",
    "big": ">i4[3]",
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
    "zblob": {"type": "bytes", "compression": "zstd"},
    "zmeta": {"type": "json", "compression": "zstd"},
}


def _sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "jpg": _image("jpeg", i)[0],
        "png": _image("png", i)[0],
        "webp": _image("webp", i)[0],
        "fixed": rng.standard_normal((2, 3)).astype(np.float16),
        "cplx": np.array([1 + 2j, i - 1j], dtype=np.complex64),
        "big": np.array([1, -2, i], dtype=">i4"),
        "tokens": rng.integers(-(2**31), 2**31 - 1, i, dtype=np.int32),  # i = 0: empty
        "boxes": rng.random((i % 3, 4), dtype=np.float32),
        "planes": rng.integers(0, 65535, (2, i + 1, 3 - i % 2), dtype=np.uint16),
        "blob": bytes(range(i * 7 % 256))[: i * 5] + b"\x00\xff",
        "text": f"caption {i} naïve ☃ \n\t" * i,
        "count": -(2**62) + i,
        "score": [0.1, -1e300, 5e-324, float("nan"), float("inf")][i % 5],
        "meta": {"i": i, "boxes": [[1, 2.5]], "name": None, "ok": True},
        "zarr": rng.standard_normal((3, 2)),
        "ztok": np.arange(i * 50, dtype=np.uint16),
        "ztext": "zstd " * i * 30,
        "zblob": bytes(i * 100),
        "zmeta": {"i": [i] * i},
    }


def _check_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in ("fixed", "cplx", "big", "tokens", "boxes", "planes", "zarr", "ztok"):
        g, w = got[name], np.asarray(want[name])
        assert isinstance(g, torch.Tensor)
        g = g.numpy()
        assert g.dtype == w.dtype.newbyteorder("=") or g.dtype == w.dtype, (name, g.dtype)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        np.testing.assert_array_equal(g, w)
    assert got["png"].dtype == torch.uint8 and tuple(got["png"].shape) == (3, 6, 10)
    assert tuple(got["jpg"].shape) == (3, 6, 10) and tuple(got["webp"].shape) == (3, 6, 10)
    for name in ("blob", "text", "count", "meta", "ztext", "zblob", "zmeta"):
        assert got[name] == want[name] and type(got[name]) is type(want[name]), name
    assert np.float64(got["score"]).tobytes() == np.float64(want["score"]).tobytes()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_field_type_round_trips_exactly_in_every_format(tmp_path, fmt):
    dest = tmp_path / fmt
    samples = [_sample(i) for i in range(7)]
    with gpufeed.Writer(dest, format=fmt, schema=SCHEMA, part_size=3) as w:
        for s in samples:
            w.write(s)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["sample"]["kind"] == "fields"
    assert [f["name"] for f in manifest["sample"]["fields"]] == list(SCHEMA)
    assert manifest["format_version"] == 2 and manifest["count"] == 7
    ds = gpufeed.open_dataset(dest, map_style=True)
    for i in (0, 3, 6, -1):
        _check_same(ds[i], samples[i])
        png = ds[i]["png"].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(png, _image("png", i % 7)[1])
        webp = ds[i]["webp"].permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(webp, _image("webp", i % 7)[1])  # lossless
    assert [s["count"] for s in ds[[5, 1, 5]]] == [samples[j]["count"] for j in (5, 1, 5)]
    assert gpufeed.verify(dest, decode=True).ok


def test_the_images_are_decoded_by_the_existing_decoders_and_kept_as_bytes_without(tmp_path):
    jpg, _ = _image("jpeg", 1)
    with gpufeed.Writer(tmp_path / "p", format="lmdb", schema={"image": "jpeg"}) as w:
        w.write({"image": jpg})
    raw = gpufeed.open_dataset(tmp_path / "p", decode=False)[0]["image"]
    assert raw.dtype == torch.uint8 and bytes(raw.numpy()) == jpg
    assert gpufeed.open_dataset(tmp_path / "p")[0]["image"].shape == (3, 6, 10)


def test_plain_libraries_read_the_documented_layouts(tmp_path):
    """docs/formats.md: a record is int64 sizes then the fields; tar members are .npy/.txt/..."""
    samples = [_sample(i) for i in range(3)]
    schema = parse_schema(SCHEMA)
    for fmt in ("hdf5", "lmdb", "tar"):
        with gpufeed.Writer(tmp_path / fmt, format=fmt, schema=SCHEMA) as w:
            for s in samples:
                w.write(s)
    with h5py.File(tmp_path / "hdf5" / "data.h5") as f:
        rec = f["encoded"][f["offsets"][1] : f["offsets"][2]]
    sizes = np.frombuffer(rec.tobytes(), "<i8", len(SCHEMA))
    tokens_at = 8 * len(SCHEMA) + sizes[: schema.names.index("tokens")].sum()
    assert np.frombuffer(rec.tobytes(), "<i8", 1, tokens_at)[0] == 1  # its shape: [1]
    env = lmdb.open(str(tmp_path / "lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        assert decode_record(schema, txn.get(b"0000000002"))["text"] == samples[2]["text"]
    env.close()
    with tarfile.open(tmp_path / "tar" / "shard-000000.tar") as t:
        names = t.getnames()
        exts = "jpg png webp npy npy npy npy npy npy bin txt cls json json".split()
        exts += ["npy.zst", "npy.zst", "txt.zst", "bin.zst", "json.zst"]
        assert names[: len(SCHEMA)] == [
            f"000000000.{n}.{e}" for n, e in zip(SCHEMA, exts, strict=True)
        ]
        boxes = np.load(io.BytesIO(t.extractfile("000000002.boxes.npy").read()))
        np.testing.assert_array_equal(boxes, samples[2]["boxes"])
        assert t.extractfile("000000001.count.cls").read() == b"%d" % samples[1]["count"]


def test_webdataset_reads_a_multi_field_tar_pack(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = [_sample(i) for i in range(4)]
    with gpufeed.Writer(tmp_path / "t", format="tar", schema=SCHEMA) as w:
        for s in samples:
            w.write(s)
    got = list(
        wds.WebDataset(str(tmp_path / "t" / "shard-000000.tar"), shardshuffle=False).decode()
    )
    assert [g["text.txt"] for g in got] == [s["text"] for s in samples]
    np.testing.assert_array_equal(got[3]["tokens.npy"], samples[3]["tokens"])
    assert got[2]["meta.json"] == samples[2]["meta"]


def test_infer_schema_from_the_first_sample(tmp_path):
    jpg, _ = _image("jpeg", 0)
    schema = infer_schema(
        {
            "a": jpg,
            "b": np.zeros((2, 3), np.int8),
            "c": "x",
            "d": 1,
            "e": 2.0,
            "f": {"k": 1},
            "g": b"\x00",
        }
    )
    assert schema.describe() == (
        "a: image/jpeg, b: int8[2,3], c: str, d: int, e: float, f: json, g: bytes"
    )
    with gpufeed.Writer(tmp_path / "p", format="mmap") as w:
        w.write({"x": np.arange(3), "y": "a"})
        w.write({"x": np.arange(4), "y": "b"})  # its size varies: x is made ragged (issue 41)
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert ds.reader.spec.schema["x"].shape == (-1,) and ds[1]["x"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("schema", "sample", "message"),
    [
        ({"t": "int32[-1]"}, {"t": np.zeros(2, np.float32)}, "float32 values do not fit .* int32"),
        ({"t": "int32[3]"}, {"t": np.zeros((3, 1), np.int32)}, r"shape \[3, 1\]"),
        ({"i": "jpeg"}, {"i": b"\x89PNG\r\n\x1a\n...."}, "expected jpeg bytes, found png"),
        ({"s": "str"}, {"s": b"x"}, "field 's': the schema says str, got bytes"),
        ({"n": "int"}, {"n": True}, "the schema says int, got bool"),
        ({"j": "json"}, {"j": {1j}}, "not JSON-able"),
        ({"a": "str"}, {"a": "x", "b": 1}, r"not in the schema \['b'\]"),
        ({"a": "str", "b": "int"}, {"a": "x"}, r"missing \['b'\]"),
    ],
)
def test_a_sample_that_does_not_fit_is_refused_naming_the_field(schema, sample, message):
    with pytest.raises(UsageError, match=message):
        encode_record(parse_schema(schema), sample)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"a": "float33[2]"}, "not a numpy dtype"),
        ({"a": "object[2]"}, "cannot be stored as raw bytes"),
        ({"a": "tiff"}, "unknown type 'tiff'"),
        ({"a b": "str"}, "field name 'a b'"),
        ({"a": {"type": "image", "format": "png", "compression": "zstd"}}, "compressed already"),
        ({"a": {"type": "str", "compression": "lz4"}}, "compression 'lz4'"),
        ({}, "expected a dict of field name"),
    ],
)
def test_a_bad_schema_is_refused_naming_the_field(schema, message):
    with pytest.raises(UsageError, match=message):
        parse_schema(schema)


def test_the_pt_container_refuses_fields_naming_them_and_the_npy_container(tmp_path):
    with pytest.raises(UsageError, match=r"multi-field samples \(t: str\); use the npy container"):
        with gpufeed.Writer(tmp_path / "p", format="mmap", container="pt") as w:
            w.write({"t": "x"})


def test_the_schema_is_checked_on_open_and_shown_by_inspect(tmp_path, capsys):
    with gpufeed.Writer(tmp_path / "p", format="hdf5", schema={"t": "int32[-1]", "c": "str"}) as w:
        w.write({"t": [1, 2], "c": "x"})
    info = gpufeed.inspect(tmp_path / "p")
    assert info["sample"]["text"] == "t: int32[*], c: str"
    from gpufeed.cli import main

    assert main(["inspect", str(tmp_path / "p")]) == 0
    assert "t: int32[*], c: str" in capsys.readouterr().out
    path = tmp_path / "p" / "manifest.json"
    m = json.loads(path.read_text())
    m["sample"]["fields"][0]["dtype"] = "float99"
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match="schema is invalid: field 't'.*float99"):
        gpufeed.open_dataset(tmp_path / "p")


def test_image_packs_keep_format_version_1_and_their_tuple_view(tmp_path, image_folder):
    m = gpufeed.pack(image_folder, tmp_path / "p", "lmdb", quiet=True)
    assert m["format_version"] == 1 and m["sample"] == {"kind": "encoded"}
    image, label = gpufeed.open_dataset(tmp_path / "p")[0]
    assert image.shape == (3, 12, 16) and label == 0
    assert SampleSpec("fields", schema=parse_schema({"a": "str"})).format_version == 2
    assert FORMAT_VERSION == 2


def test_a_record_that_does_not_add_up_is_an_error():
    schema = parse_schema({"a": "bytes", "b": "str"})
    rec = encode_record(schema, {"a": b"xy", "b": "z"})
    assert [bytes(v) for v in split_record(schema, rec)] == [b"xy", b"z"]
    with pytest.raises(ValueError, match="do not add up"):
        split_record(schema, rec[:-1])


def test_zstd_fields_are_smaller_on_disk_and_recorded_in_the_manifest(tmp_path):
    text = "the same words again and again " * 60
    for comp in (None, "zstd"):
        schema = {"t": {"type": "str", "compression": comp}, "image": "png"}
        with gpufeed.Writer(tmp_path / str(comp), format="mmap", schema=schema) as w:
            for i in range(50):
                w.write({"t": text + str(i), "image": _image("png", i)[0]})
    size = {c: (tmp_path / str(c) / "encoded.npy").stat().st_size for c in (None, "zstd")}
    assert size["zstd"] < size[None] - 50 * len(text) // 2
    fields = json.loads((tmp_path / "zstd" / "manifest.json").read_text())["sample"]["fields"]
    assert fields == [{"name": "t", "type": "str", "compression": "zstd"},
                      {"name": "image", "type": "image", "format": "png"}]  # fmt: skip
    assert gpufeed.open_dataset(tmp_path / "zstd")[7]["t"] == text + "7"


@pytest.mark.parametrize("shape", ["ab", "12", 42, [1.5], [True], [None]])
def test_an_array_shape_that_is_not_a_list_of_sizes_is_a_usage_error(shape):
    from gpufeed.formats.schema import parse_schema

    with pytest.raises(UsageError, match=r"field 'x': shape .*: expected a list of sizes"):
        parse_schema({"x": {"type": "array", "dtype": "int8", "shape": shape}})


@pytest.mark.parametrize("shape", [[3, 2**63], [-1, 2**47, 4], [1] * 33])
def test_a_field_shape_no_real_value_has_is_refused(shape):
    """A manifest's field shape of 2**63 reached torch.empty as a raw TypeError."""
    with pytest.raises(UsageError, match=r"field 'x': shape .*at most 32 dimensions"):
        parse_schema({"x": {"type": "array", "dtype": "int16", "shape": shape}})
    manifest_sample = {"kind": "fields", "fields": [{"name": "x", "type": "array",
                       "dtype": "int16", "shape": shape}]}  # fmt: skip
    with pytest.raises(DataError, match="the manifest's sample schema is invalid"):
        SampleSpec.from_json(manifest_sample)


@pytest.mark.parametrize(
    ("dtype", "values", "refused"),
    [
        ("int16", np.array([70000]), "70000"),
        ("int8", np.array([1, 200]), "200"),
        ("uint8", np.array([-1]), "-1"),
        ("int32", np.array([2**40], dtype=np.uint64), str(2**40)),
        ("int64", np.array([2**64 - 1], dtype=np.uint64), str(2**64 - 1)),
        ("float16", np.array([1e6]), "1000000.0"),
        ("float32", np.array([np.inf, 1e300]), "1e+300"),
    ],
)
def test_encode_record_refuses_a_value_its_dtype_cannot_hold(dtype, values, refused):
    from gpufeed.formats.schema import parse_schema

    schema = parse_schema({"x": f"{dtype}[-1]"})
    with pytest.raises(UsageError, match=rf"field 'x': value {re.escape(refused)} does not fit"):
        encode_record(schema, {"x": values})


def test_encode_record_stores_values_that_fit_of_any_integer_type():
    from gpufeed.formats.schema import parse_schema

    schema = parse_schema({"x": "uint8[-1]", "f": "float16[-1]"})
    sample = {"x": np.array([0, 255], dtype=np.int64), "f": np.array([np.inf, np.nan, 1.5])}
    out = decode_record(schema, encode_record(schema, sample))
    assert np.asarray(out["x"]).tolist() == [0, 255]
    f = np.asarray(out["f"])
    assert f[0] == np.inf and np.isnan(f[1]) and f[2] == 1.5


def test_partial_schema_names_some_fields_the_rest_inferred():
    from gpufeed.formats.schema import inferred_names

    sample = {"tokens": np.arange(5, dtype=np.int32), "caption": "x", "n": 3}
    schema = infer_schema(sample, {"tokens": "int32[-1]"})
    assert schema.describe() == "tokens: int32[*], caption: str, n: int"
    assert inferred_names(schema, {"tokens": "int32[-1]"}) == ["caption", "n"]
    with pytest.raises(UsageError, match="does not hold"):
        infer_schema(sample, {"boxes": "float32[-1,4]"})


def test_a_size_that_varies_widens_an_inferred_array():
    from gpufeed.formats.schema import widened

    field = infer_schema({"t": np.zeros((2, 38), np.int32)})["t"]
    wide = widened(field, np.zeros((2, 40), np.int32))
    assert wide.type == "ragged" and wide.shape == (2, -1)
    assert widened(field, np.zeros((2, 38), np.int32)) is None  # fits already
    assert widened(field, np.zeros((2, 3, 4), np.int32)) is None  # another ndim
    assert widened(field, np.zeros((2, 40), np.float64)) is None  # does not cast safely
    assert widened(wide, np.zeros((3, 7), np.int16)).shape == (-1, -1)
