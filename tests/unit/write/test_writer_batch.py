"""gpufeed.Writer's fast paths: write() of a sample that needs no conversion
(write.records.sample_encoder) and write_batch() of columns (write.records.batch_records)
make the same records, parts and pack as the general path, with the same refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.formats.record import encode_record
from gpufeed.formats.schema import parse_schema
from gpufeed.write.records import batch_records, encoded, sample_encoder

SCHEMA = {"x": "uint8[16]", "y": "float32[2,3]", "f": "float", "label": "int"}


def columns(a: int, b: int) -> dict[str, np.ndarray]:
    i = np.arange(a, b)
    return {
        "x": (i[:, None] + np.arange(16)).astype(np.uint8),
        "y": (i[:, None, None] * np.ones((2, 3))).astype(np.float32),
        "f": i / 7,
        "label": i % 10,
    }


def row(cols: dict[str, np.ndarray], j: int) -> dict:
    return {
        "x": cols["x"][j],
        "y": cols["y"][j],
        "f": float(cols["f"][j]),
        "label": int(cols["label"][j]),
    }


def files(dest: Path) -> dict[str, bytes]:
    """Every file of a pack, the manifest without what names the run (its folder)."""
    out = {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.is_file()}
    manifest = json.loads(out.pop("manifest.json"))
    manifest["source"].pop("path", None)
    out["manifest"] = json.dumps(manifest, sort_keys=True).encode()
    return out


@pytest.mark.parametrize("fmt", ["tar", "lmdb", "mmap", "hdf5"])
def test_write_batch_makes_the_pack_write_makes(tmp_path, fmt):
    n = 2500
    cols = columns(0, n)
    with gpufeed.Writer(tmp_path / "rows", fmt, SCHEMA, part_size=1000) as w:
        for j in range(n):
            w.write(row(cols, j))
    with gpufeed.Writer(tmp_path / "cols", fmt, SCHEMA, part_size=1000) as w:
        w.write_batch({k: v[:700] for k, v in cols.items()})
        w.write(row(cols, 700))  # single samples and batches mix, in order
        w.write_batch({k: v[701:2400] for k, v in cols.items()})
        for j in range(2400, n):
            w.write(row(cols, j))
    assert files(tmp_path / "cols") == files(tmp_path / "rows")
    ds = gpufeed.open_dataset(tmp_path / "cols", map_style=True)
    got = ds[1234]
    assert got["x"].tolist() == cols["x"][1234].tolist() and got["label"] == 4
    assert got["f"] == 1234 / 7 and got["y"].tolist() == cols["y"][1234].tolist()
    np.testing.assert_array_equal(ds.labels, cols["label"])


def test_write_batch_commits_a_part_every_part_size_samples(tmp_path):
    dest = tmp_path / "p"
    with (
        pytest.raises(RuntimeError, match="stop"),
        gpufeed.Writer(dest, "tar", SCHEMA, part_size=1000) as w,
    ):
        w.write_batch(columns(0, 2500))
        assert (w.parts, w.written, w.inputs_done) == (2, 2500, 2500)  # 500 not yet committed
        raise RuntimeError("stop")
    with gpufeed.Writer(dest, "tar", SCHEMA, part_size=1000, resume=True) as w:
        assert (w.written, w.inputs_done) == (2000, 2000)
        w.write_batch(columns(2000, 3000))
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == 3000 and ds[2999]["x"][0] == (2999 % 256)


def test_write_batch_refuses_what_write_refuses_naming_field_and_sample(tmp_path):
    dest = tmp_path / "p"
    cols = columns(0, 10)
    wide = cols["x"].astype(np.int64)
    wide[6, 3] = 300  # does not fit uint8: the batch goes row by row and sample 6 is refused
    with pytest.raises(UsageError) as e, gpufeed.Writer(dest, "tar", SCHEMA) as w:
        w.write_batch({**cols, "x": wide})
    assert f"{dest}: sample 6: field 'x': value 300 does not fit" in str(e.value)
    with pytest.raises(UsageError, match=r"sample 13 \(#13\): label 7 is not one of the 3"):
        with gpufeed.Writer(dest, "tar", SCHEMA, classes=["a", "b", "c"], overwrite=True) as w:
            w.write_batch({**cols, "label": np.zeros(10, np.int64)})
            w.write_batch({**cols, "label": np.array([0, 1, 2, 7, 0, 0, 0, 0, 0, 0])})
    with pytest.raises(UsageError, match=r"columns differ in length: \{'x': 10, 'y': 9"):
        with gpufeed.Writer(dest, "tar", SCHEMA, overwrite=True) as w:
            w.write_batch({**cols, "y": cols["y"][:9]})
    with pytest.raises(UsageError, match=r"sample fields .* missing \['label'\]"):
        with gpufeed.Writer(dest, "tar", SCHEMA, overwrite=True) as w:
            w.write_batch({k: v for k, v in cols.items() if k != "label"})
    with pytest.raises(UsageError, match="write_batch takes a dict of columns"):
        with gpufeed.Writer(dest, "tar", SCHEMA, overwrite=True) as w:
            w.write_batch([row(cols, 0)])


def test_write_batch_without_a_schema_takes_it_from_the_first_row(tmp_path):
    cols = {"x": np.arange(12, dtype=np.int16).reshape(4, 3), "label": np.arange(4)}
    with gpufeed.Writer(tmp_path / "p", "mmap") as w:
        w.write_batch(cols)
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    assert ds[3]["x"].tolist() == [9, 10, 11] and ds.labels.tolist() == [0, 1, 2, 3]


PLAIN = {"a": "uint8[4]", "b": "float64[]", "n": "int", "f": "float", "s": "str", "raw": "bytes"}


@pytest.mark.parametrize(
    "sample",
    [
        {
            "a": np.arange(4, dtype=np.uint8),
            "b": np.float64(2.5),
            "n": 3,
            "f": 0.5,
            "s": "é",
            "raw": b"xy",
        },
        # values write() converts: a list, a non-contiguous or big-endian array, numpy ints
        {
            "a": [1, 2, 3, 4],
            "b": np.array(1.0, ">f8"),
            "n": np.int8(-3),
            "f": 2,
            "s": "",
            "raw": bytearray(b"z"),
        },
        {
            "a": np.arange(8, dtype=np.uint8)[::2],
            "b": 1.0,
            "n": 2**63 - 1,
            "f": float("nan"),
            "s": "a",
            "raw": b"",
        },
    ],
)
def test_write_fast_path_makes_the_records_encode_record_makes(sample):
    schema = parse_schema(PLAIN)
    record, label, crc = sample_encoder(schema)(sample)
    assert (record, label, crc) == encoded(schema, sample)
    assert record == encode_record(schema, sample)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"n": 2**63}, "does not fit an int field"),
        ({"a": np.arange(5, dtype=np.uint8)}, "shape [5]"),
        ({"s": b"bytes"}, "the schema says str, got bytes"),
        ({"extra": 1}, "not in the schema ['extra']"),
    ],
)
def test_write_fast_path_refuses_what_the_general_path_refuses(tmp_path, change, said):
    base = {"a": np.zeros(4, np.uint8), "b": 1.0, "n": 1, "f": 1.0, "s": "s", "raw": b"r"}
    with pytest.raises(UsageError) as e, gpufeed.Writer(tmp_path / "p", "tar", PLAIN) as w:
        w.write(base)
        w.write({**base, **change})
    assert "sample 1: " in str(e.value) and said in str(e.value), str(e.value)


def test_batch_records_are_encode_records_records_or_none_where_a_column_needs_a_check():
    schema = parse_schema(SCHEMA)
    cols = columns(5, 9)
    payload, size, labels = batch_records(schema, cols, 4)
    rows = [encode_record(schema, row(cols, j)) for j in range(4)]
    assert payload.tobytes() == b"".join(rows) and size == len(rows[0])
    assert labels.tolist() == [5, 6, 7, 8]
    for bad in (
        {"x": cols["x"].astype(np.int16)},  # another dtype: each value checked by write()
        {"label": cols["label"].astype(bool)},
        {"label": np.array([2**63] * 4, np.uint64)},
        {"f": cols["f"].astype(np.longdouble)},
        {"y": list(cols["y"])},
    ):
        assert batch_records(schema, {**cols, **bad}, 4) is None
