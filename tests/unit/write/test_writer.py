"""gpufeed.Writer and gpufeed.pack_map(fn, inputs): crash-safe (a real kill -9, then resume or
refuse), locked, ordered, on_error semantics; docs/formats.md's multi-field snippet."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.errors import NotPackedError, SourceError, UsageError

ROOT = Path(__file__).resolve().parents[3]


def sample(i: int) -> dict:
    return {"tokens": np.arange(i % 5, dtype=np.int32) + i, "text": f"s{i}", "label": i}


def check(dest: Path, n: int) -> None:
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == n
    for i in range(n):
        got = ds[i]
        assert got["text"] == f"s{i}" and got["label"] == i
        np.testing.assert_array_equal(got["tokens"].numpy(), sample(i)["tokens"])
    np.testing.assert_array_equal(ds.labels, np.arange(n))


SCHEMA = {"tokens": "int32[-1]", "text": "str", "label": "int"}

KILLED_WRITER = """
import sys, time
import numpy as np
import gpufeed
sys.path.insert(0, {tests!r})
from test_writer import sample
w = gpufeed.Writer({dest!r}, format={fmt!r}, schema={schema!r}, part_size=10)
for i in range(100000):
    w.write(sample(i))
    time.sleep(0.002)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hdf5", "tar"])
def test_a_writer_killed_with_sigkill_is_refused_then_resumed(tmp_path, python_env, fmt):
    dest = tmp_path / "p"
    script = KILLED_WRITER.format(
        tests=str(Path(__file__).parent), dest=str(dest), fmt=fmt, schema=SCHEMA
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=python_env)
    parts = tmp_path / "p.partial" / "parts"
    deadline = time.monotonic() + 60
    while len(list(parts.glob("part-*.npz"))) < 3 and time.monotonic() < deadline:
        assert proc.poll() is None, "the writer exited early"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(NotPackedError, match=r"gpufeed.Writer.*resume=True"):
        gpufeed.open_dataset(dest)
    with pytest.raises(UsageError, match="pass resume=True to continue it or overwrite=True"):
        gpufeed.Writer(dest, format=fmt, schema=SCHEMA)
    with pytest.raises(UsageError, match="was started with schema"):
        gpufeed.Writer(dest, format=fmt, schema={"x": "str"}, resume=True)
    w = gpufeed.Writer(dest, format=fmt, resume=True, part_size=10)  # schema from the state
    assert w.written >= 30 and w.written % 10 == 0 and w.inputs_done == w.written
    for i in range(w.written, 57):
        w.write(sample(i))
    w.close()
    check(dest, 57)
    assert not (tmp_path / "p.partial").exists()
    assert gpufeed.verify(dest).ok


def test_an_exception_inside_with_leaves_a_resumable_partial(tmp_path):
    dest = tmp_path / "p"
    with pytest.raises(RuntimeError, match="boom"):
        with gpufeed.Writer(dest, format="lmdb", schema=SCHEMA, part_size=4) as w:
            for i in range(10):
                w.write(sample(i))
            raise RuntimeError("boom")
    assert not dest.exists()
    said = r"written from Python and not finished.*gpufeed.Writer\(.*resume=True\)"
    with pytest.raises(NotPackedError, match=said):
        gpufeed.open_dataset(dest)
    with gpufeed.Writer(dest, format="lmdb", schema=SCHEMA, part_size=4, resume=True) as w:
        assert w.written == 8  # two parts committed; the 2 pending samples were lost
        for i in range(w.written, 12):
            w.write(sample(i))
    check(dest, 12)


def test_one_writer_per_destination_and_only_our_packs_are_replaced(tmp_path):
    dest = tmp_path / "p"
    w = gpufeed.Writer(dest, format="mmap", schema=SCHEMA)
    with pytest.raises(UsageError, match=r"pid \d+\) is writing it now"):
        gpufeed.Writer(dest, format="mmap", schema=SCHEMA, overwrite=True)
    w.write(sample(0))
    assert w.close()["count"] == 1
    assert w.close()["count"] == 1  # closing twice returns the manifest again
    with pytest.raises(UsageError, match="this Writer is closed"):
        w.write(sample(1))
    with pytest.raises(UsageError, match="already exists; pass overwrite=True"):
        gpufeed.Writer(dest, format="mmap", schema=SCHEMA)
    with gpufeed.Writer(dest, format="mmap", schema=SCHEMA, overwrite=True) as w:
        for i in range(3):
            w.write(sample(i))
    check(dest, 3)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="refusing to replace it.*not a gpufeed pack"):
        gpufeed.Writer(mine, format="mmap", schema=SCHEMA, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_writer_with_no_samples_is_refused_without_a_schema_and_empty_with_one(tmp_path):
    with pytest.raises(UsageError, match="no sample was written"):
        with gpufeed.Writer(tmp_path / "a", format="hdf5"):
            pass
    with gpufeed.Writer(tmp_path / "b", format="tar", schema=SCHEMA):
        pass
    ds = gpufeed.open_dataset(tmp_path / "b", map_style=True)
    assert len(ds) == 0 and ds.reader.spec.schema.names == list(SCHEMA)


def convert(i: int):
    if i % 7 == 3:
        raise ValueError(f"bad input {i}")
    yield sample(2 * i)
    if i % 2:
        yield sample(2 * i + 1)


@pytest.mark.parametrize("workers", [0, 2])
def test_pack_fn_writes_in_input_order_and_skips_failed_inputs(tmp_path, workers):
    inputs = list(range(40))
    m = gpufeed.pack_map(
        convert, inputs, tmp_path / "p", format="tar", workers=workers, on_error="skip",
        quiet=True, part_size=8, schema=SCHEMA,
    )  # fmt: skip
    want = [s for i in inputs if i % 7 != 3 for s in [2 * i, 2 * i + 1][: 1 + i % 2]]
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    assert [ds[j]["label"] for j in range(len(ds))] == want
    assert [(s["item"], s["error"]) for s in m["skipped"]] == [
        (i, f"ValueError: bad input {i}") for i in inputs if i % 7 == 3
    ]
    assert m["count"] == len(want) and [s["path"] for s in m["skipped"]][:2] == ["#3", "#10"]


def test_pack_fn_stops_at_a_failed_input_naming_it_then_resumes(tmp_path):
    def fn(i):
        return sample(i)

    bad = set(range(25, 26))

    def flaky(i):
        if i in bad:
            raise OSError(f"cannot read {i}")
        return fn(i)

    with pytest.raises(SourceError, match=r"input 25 \(#25\): OSError: cannot read 25"):
        gpufeed.pack_map(
            flaky, range(40), tmp_path / "p", schema=SCHEMA, workers=2, part_size=10, quiet=True
        )
    with pytest.raises(NotPackedError, match="resume=True"):
        gpufeed.open_dataset(tmp_path / "p")
    bad.clear()
    calls = []

    def counted(i):
        calls.append(i)
        return fn(i)

    gpufeed.pack_map(
        counted, range(40), tmp_path / "p", schema=SCHEMA, workers=0, part_size=10,
        resume=True, quiet=True,
    )  # fmt: skip
    assert calls == list(range(20, 40))  # the committed parts (inputs 0..19) were kept
    check(tmp_path / "p", 40)


def test_pack_fn_takes_the_schema_from_the_first_sample_with_workers(tmp_path):
    m = gpufeed.pack_map(
        lambda i: {"x": np.full(3, i, np.int16), "s": str(i)}, range(50), tmp_path / "p",
        format="lmdb", workers=2, quiet=True,
    )  # fmt: skip
    assert m["sample"]["fields"][0] == {"name": "x", "type": "array", "dtype": "<i2", "shape": [3]}
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert [ds[i]["s"] for i in range(50)] == [str(i) for i in range(50)]
    assert ds[49]["x"].tolist() == [49] * 3


def test_pack_fn_refuses_a_sample_that_is_not_a_dict(tmp_path):
    with pytest.raises(SourceError, match="fn returned str"):
        gpufeed.pack_map(lambda i: "x", [1], tmp_path / "p", workers=0, quiet=True)


def test_the_readme_multi_field_snippet_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "formats.md").read_text()
    marker = r"tests/unit/write/test_writer.py runs these snippets -->\n```python\n(.*?)```"
    block = re.search(marker, text, re.S).group(1)
    rng = np.random.default_rng(0)

    def jpeg(h, w):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
        return buf.getvalue()

    my_data = [
        (jpeg(16, 16), f"caption {i}", rng.integers(0, 1000, 3 + i), rng.random((i % 3, 4)),
         rng.random(100 + i, dtype=np.float32))
        for i in range(40)
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the snippet writes packs/caps.tar
    scope = {"my_data": my_data}
    exec(compile(textwrap.dedent(block), "docs/formats.md", "exec"), scope)
    batch = scope["batch"]
    assert batch["image"].shape == (32, 3, 16, 16)
    assert batch["tokens"].shape == (32, 3 + 31) and batch["tokens_mask"].sum() == sum(
        3 + i for i in range(32)
    )
    assert isinstance(batch["boxes"], list) and batch["label"].dtype == torch.int64
    assert scope["sample"]["caption"] == "caption 0"


def test_function_packs_refuse_a_url_dest_and_url_only_options(tmp_path):
    # pack_map writes a local folder: a URL is refused by name, never made a local "s3:"
    with pytest.raises(UsageError, match="s3://bucket/x: pack_map\\(fn, inputs, DEST\\)"):
        gpufeed.pack_map(lambda i: {"x": i}, range(3), "s3://bucket/x", format="lmdb")
    # pack_map takes no URL-only option; the deprecated pack(fn, ...) refuses them by name
    with pytest.warns(DeprecationWarning), pytest.raises(UsageError, match="staging_dir= is"):
        gpufeed.pack(lambda i: {"x": i}, range(3), tmp_path / "p", staging_dir=tmp_path / "s")
    assert not (tmp_path / "p").exists() and not Path("s3:").exists()


def _pack_files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.name != "manifest.json"}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_fresh_pack_is_written_as_its_parts_are_committed(tmp_path, fmt):
    """The tar shards or LMDB file of a fresh pack are written while samples come
    (assemble.Stream), not in a second pass at close; a pack resumed from its parts
    (assembled at close) is the same, byte for byte, over several shards and past the
    index's first 1,024 rows."""
    n, opts = 5200, {"format": fmt, "schema": SCHEMA, "part_size": 500}
    opts.update(shard_size=2000) if fmt == "tar" else None
    streamed = tmp_path / "streamed"
    with gpufeed.Writer(streamed, **opts) as w:
        for i in range(4600):
            w.write(sample(i))
        w._wait_committed()  # the ninth part is written in the commit thread
        first = "shard-000000.tar" if fmt == "tar" else "data.mdb"
        written = tmp_path / "streamed.partial" / "out" / first
        # 9 parts committed: in the shard, or in LMDB's first transaction (of 4,096 records)
        assert written.stat().st_size > 4096 * 20
        for i in range(4600, n):
            w.write(sample(i))
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError), gpufeed.Writer(resumed, **opts) as w:
        for i in range(2700):
            w.write(sample(i))
        raise RuntimeError("stopped after five committed parts")
    with gpufeed.Writer(resumed, resume=True, **opts) as w:
        for i in range(w.written, n):
            w.write(sample(i))
    check(streamed, n)
    assert _pack_files(streamed) == _pack_files(resumed)
    assert fmt == "lmdb" or len(list(streamed.glob("shard-*.tar"))) == 3


def test_pack_fn_keeps_at_most_a_part_of_records_in_flight():
    """pack(fn)'s workers run ahead of the writer by up to one part of inputs (so they go
    on while a part is committed), but never by more than PART_BYTES of records; a chunk
    carries about CHUNK_BYTES of records (small samples: fewer, larger chunks)."""
    from gpufeed.write.convert import CHUNK, _chunking
    from gpufeed.write.pool import CHUNK_BYTES, MAX_CHUNK
    from gpufeed.write.writer import PART_BYTES

    def chunk(record_bytes):
        return [("ok", [(b"x" * record_bytes, 0, 0)])] * CHUNK

    size, window = _chunking(2, 1024, chunk(100))
    assert size == MAX_CHUNK and window * size >= 1024  # a whole part ahead
    for record in (100, 64 << 10, 1 << 20, 16 << 20):
        size, window = _chunking(2, 1024, chunk(record))
        assert size == 1 or size * record <= CHUNK_BYTES
        assert window >= 2 * 2  # a couple of chunks per worker, whatever the size
        assert window == 4 or window * size * record <= PART_BYTES
    assert _chunking(2, 1024, chunk(16 << 20)) == (1, 4)  # 4 x 16 MiB in flight, not 4 x 32


# ------------------------------------------------------------------ values that do not fit
# issue 37 item 7: a value the field's type cannot hold is refused, naming the field and
# the sample, never wrapped or overflowed (as uint8 given 300 always was)
@pytest.mark.parametrize(
    ("schema", "value", "stored"),
    [
        ("int16[]", np.int64(70000), "70000"),
        ("int16[]", 70000, "70000"),
        ("uint8[]", 300, "300"),
        ("uint8[2]", [3, 300], "300"),
        ("int8[2]", np.array([1, -129]), "-129"),
        ("int32[-1]", np.array([2**40], dtype=np.uint64), str(2**40)),
        ("int64[]", np.uint64(2**64 - 1), str(2**64 - 1)),
        ("uint64[]", np.int8(-1), "-1"),
        ("float16[]", 1e6, "1000000.0"),
        ("float32[2]", np.array([1.0, 1e300]), "1e+300"),
        ("int", np.uint64(2**64 - 1), str(2**64 - 1)),
        ("int", 2**70, str(2**70)),
        ("float", 10**400, "10000000..."),
    ],
)
def test_a_value_the_field_cannot_hold_is_refused_naming_field_and_sample(
    tmp_path, schema, value, stored
):
    dest = tmp_path / "p"
    with pytest.raises(UsageError) as e:
        with gpufeed.Writer(dest, format="mmap", schema={"x": schema, "n": "int"}) as w:
            w.write({"x": _zero(schema), "n": 0})
            w.write({"x": value, "n": 1})
    msg = str(e.value)
    assert f"{dest}: sample 1: field 'x': value {stored}" in msg, msg
    assert "does not fit" in msg and "str or json" in msg or "wider dtype" in msg, msg
    assert not dest.exists()


def _zero(schema: str):
    """A value of that type that fits (the sample before the one that does not)."""
    if schema in ("int", "float"):
        return 0
    dtype, dims = schema.rstrip("]").split("[")
    return np.zeros([abs(int(d)) for d in dims.split(",") if d], dtype=dtype)


def test_an_inferred_dtype_given_a_larger_value_later_says_to_declare_a_wider_one(tmp_path):
    dest = tmp_path / "p"
    with pytest.raises(UsageError) as e:
        with gpufeed.Writer(dest, format="mmap") as w:
            w.write({"x": np.array([1, 2], dtype=np.int8)})
            w.write({"x": np.array([1, 200])})
    msg = str(e.value)
    assert "sample 1: field 'x': value 200 does not fit the schema's int8" in msg, msg
    assert "schema={'x': 'int16[2]'}" in msg and "took the schema from the first sample" in msg


def test_values_that_fit_are_stored_whatever_their_integer_type(tmp_path):
    schema = {"u": "uint8[3]", "i": "int32[-1]", "h": "float16[]", "n": "int", "f": "float"}
    with gpufeed.Writer(tmp_path / "p", format="mmap", schema=schema) as w:
        w.write(
            {
                "u": [0, 3, 255],  # Python ints (int64) that fit uint8: no longer refused
                "i": np.array([2**31 - 1, -(2**31)], dtype=np.int64),
                "h": np.float64("inf"),  # not finite in: stored as it is
                "n": np.uint64(2**63 - 1),
                "f": 10**300,
            }
        )
    got = gpufeed.open_dataset(tmp_path / "p", map_style=True)[0]
    assert got["u"].tolist() == [0, 3, 255] and got["i"].tolist() == [2**31 - 1, -(2**31)]
    assert got["h"].item() == float("inf") and got["n"] == 2**63 - 1 and got["f"] == 1e300


@pytest.mark.parametrize(
    ("schema", "value", "field"),
    [
        ({"x": "int32[-1]"}, [1, [2, 3]], "x"),  # numpy's ValueError (inhomogeneous)
        ({"img": "png"}, np.zeros((4, 4, 7), dtype=np.uint8), "img"),  # PIL's TypeError
    ],
)
def test_a_value_numpy_or_pil_cannot_take_is_a_usage_error_naming_the_field(
    tmp_path, schema, value, field
):
    with pytest.raises(UsageError, match=rf"p: sample 0: field '{field}': cannot be stored"):
        with gpufeed.Writer(tmp_path / "p", format="mmap", schema=schema) as w:
            w.write({field: value})


def test_pack_of_samples_names_the_input_whose_value_does_not_fit(tmp_path):
    samples = [{"x": np.int64(i), "t": np.array([i], dtype=np.int8)} for i in (1, 2)]
    samples.append({"x": np.int64(3), "t": np.array([1000])})
    with pytest.raises(SourceError, match=r"input 2 \(#2\).*field 't': value 1000 does not fit"):
        gpufeed.pack_samples(samples, tmp_path / "p", format="mmap", quiet=True)


# ------------------------------------------------------------------ closing an empty writer
def test_closing_an_empty_writer_releases_its_lock_and_leaves_nothing(tmp_path):
    dest = tmp_path / "a"
    w = gpufeed.Writer(dest, format="hdf5")
    with pytest.raises(UsageError, match=r"a: no sample was written; nothing to pack"):
        w.close()
    assert not dest.exists() and not (tmp_path / "a.partial").exists()
    with pytest.raises(UsageError, match="this Writer is closed"):
        w.write(sample(0))
    with gpufeed.Writer(dest, format="hdf5", schema=SCHEMA) as w2:  # not "locked by pid ..."
        w2.write(sample(0))
    check(dest, 1)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"part_size": "abc"}, "part_size: expected a whole number, got 'abc'"),
        ({"part_size": None, "schema": {"x": {"type": "array", "dtype": "int8", "shape": "ab"}}},
         "field 'x': shape 'ab': expected a list of sizes"),
        ({"schema": {"x": {"type": "array", "dtype": "int8", "shape": 42}}},
         "field 'x': shape 42: expected a list of sizes"),
    ],
)  # fmt: skip
def test_a_bad_option_or_schema_is_a_usage_error_naming_it_not_a_raw_error(tmp_path, options, said):
    with pytest.raises(UsageError, match=re.escape(said)):
        gpufeed.Writer(tmp_path / "p", format="mmap", **options)
    assert not (tmp_path / "p.partial").exists()


def test_pack_with_workers_that_are_not_a_number_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="workers: expected a whole number, got 'x'"):
        gpufeed.pack_map(convert, range(3), tmp_path / "p", format="mmap", workers="x", quiet=True)


CLASSES = ["cat", "dog", "bird"]


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_a_writer_keeps_its_class_names_in_the_manifest_and_the_dataset(tmp_path, fmt):
    """Writer(classes=[...]) (HF ClassLabel.names): kept in the manifest, read back as
    dataset.classes and class_to_idx, map-style and (tar) streamed."""
    dest = tmp_path / fmt
    schema = {"x": "float32[2]", "label": "int"}
    with gpufeed.Writer(dest, fmt, schema, classes=tuple(CLASSES)) as w:
        for i in range(7):
            w.write({"x": np.full(2, i, np.float32), "label": i % 3})
    assert json.loads((dest / "manifest.json").read_text())["classes"] == CLASSES
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert ds.classes == CLASSES and ds.class_to_idx == {"cat": 0, "dog": 1, "bird": 2}
    assert [ds.classes[ds[i]["label"]] for i in range(4)] == ["cat", "dog", "bird", "cat"]
    if fmt == "tar":
        assert gpufeed.open_dataset(dest, map_style=False).classes == CLASSES


@pytest.mark.parametrize(
    "classes, said",
    [
        ("cat", "a list of class names, got str"),
        ([], "got an empty list"),
        (["cat", 1], "got int 1"),
        (["cat", "dog", "cat"], "names 'cat' twice"),
    ],
)
def test_classes_that_are_not_distinct_names_are_refused(tmp_path, classes, said):
    with pytest.raises(UsageError, match=said):
        gpufeed.Writer(tmp_path / "p", "tar", SCHEMA, classes=classes)
    assert not (tmp_path / "p").exists() and not (tmp_path / "p.partial").exists()


def test_a_label_outside_the_classes_is_refused_naming_the_sample_and_label(tmp_path):
    dest = tmp_path / "p"
    with pytest.raises(UsageError) as e, gpufeed.Writer(dest, "tar", SCHEMA, classes=CLASSES) as w:
        for i in range(5):
            w.write({**sample(i), "label": [0, 2, -1, 3, 1][i]})
    said = str(e.value)
    assert str(dest) in said and "sample 3" in said and "label 3" in said
    assert "3 classes" in said
    with pytest.raises(UsageError, match=r"sample 1 \(#1\): label -2 is not one of the 3"):
        gpufeed.pack_samples([(np.zeros(2), 0), (np.zeros(2), -2)], tmp_path / "q", classes=CLASSES)


@pytest.mark.parametrize("workers", [0, 2])
def test_pack_of_samples_and_of_a_function_take_classes(tmp_path, workers):
    def convert(i):
        return {"x": np.full(2, i, np.float32), "label": i % 2}

    fn_pack = tmp_path / "fn"
    gpufeed.pack_map(convert, range(6), fn_pack, "lmdb", workers=workers, classes=["a", "b"])
    assert gpufeed.open_dataset(fn_pack).classes == ["a", "b"]
    held = tmp_path / "held"
    gpufeed.pack_samples([(np.zeros(2), 1)] * 3, held, "mmap", workers=workers, classes=["a", "b"])
    assert gpufeed.open_dataset(held).class_to_idx == {"a": 0, "b": 1}
    with pytest.raises(UsageError, match=r"bad: sample 1 \(#1\): label 1 is not one of the 1 "):
        gpufeed.pack_map(convert, range(6), tmp_path / "bad", workers=workers, classes=["a"])


def test_a_resumed_writer_keeps_its_classes_and_refuses_others(tmp_path):
    dest = tmp_path / "p"
    with pytest.raises(RuntimeError), gpufeed.Writer(dest, "tar", SCHEMA, classes=CLASSES) as w:
        w.write({**sample(0), "label": 2})
        w.flush()
        raise RuntimeError("stopped")
    with pytest.raises(UsageError, match="classes"):
        gpufeed.Writer(dest, "tar", SCHEMA, classes=["x", "y", "z"], resume=True)
    with gpufeed.Writer(dest, "tar", SCHEMA, resume=True) as w:
        with pytest.raises(UsageError, match="label 3"):
            w.write({**sample(1), "label": 3})
        w.write({**sample(1), "label": 1})
    assert gpufeed.open_dataset(dest).classes == CLASSES


def test_a_size_that_varies_without_a_schema_becomes_ragged(tmp_path):
    """The issue's case: tokens of varying length, no schema: the second sample widened the
    inferred int32[38] to int32[-1] (the first re-encoded), not an error."""
    lengths = [38, 12, 40, 38]
    with gpufeed.Writer(tmp_path / "t.lmdb", "lmdb") as w:
        for n in lengths:
            w.write({"tokens": np.arange(n, dtype=np.int32), "id": n})
    ds = gpufeed.open_dataset(tmp_path / "t.lmdb")
    assert ds.reader.spec.schema["tokens"].shape == (-1,)
    assert [len(ds[i]["tokens"]) for i in range(4)] == lengths
    assert ds.reader.manifest["options"]["inferred_fields"] == ["tokens", "id"]


def test_a_partial_schema_declares_its_fields_the_rest_inferred(tmp_path):
    with gpufeed.Writer(tmp_path / "p.lmdb", "lmdb", schema={"tokens": "int64[-1]"}) as w:
        w.write({"tokens": np.arange(3), "caption": "a", "box": np.zeros(4, np.float32)})
        w.write({"tokens": np.arange(5), "caption": "b", "box": np.ones(4, np.float32)})
    ds = gpufeed.open_dataset(tmp_path / "p.lmdb")
    assert ds.reader.spec.schema.describe() == "tokens: int64[*], caption: str, box: float32[4]"
    assert ds.reader.manifest["options"]["inferred_fields"] == ["caption", "box"]
    assert ds[1]["caption"] == "b" and ds[1]["tokens"].tolist() == list(range(5))


def test_a_size_that_varies_after_a_committed_part_says_what_to_declare(tmp_path):
    w = gpufeed.Writer(tmp_path / "c.lmdb", "lmdb", part_size=2)
    for _ in range(2):
        w.write({"tokens": np.arange(4, dtype=np.int32)})
    w.flush()
    with pytest.raises(UsageError, match=r"int32\[-1\].*took the schema from the first sample"):
        w.write({"tokens": np.arange(6, dtype=np.int32)})
    w.abandon()


def test_a_partial_schema_resumes(tmp_path):
    schema = {"tokens": "int32[-1]"}
    w = gpufeed.Writer(tmp_path / "r.lmdb", "lmdb", schema=schema)
    w.write({"tokens": np.arange(2, dtype=np.int32), "n": 1})
    w.flush()
    w.abandon()
    with gpufeed.Writer(tmp_path / "r.lmdb", "lmdb", schema=schema, resume=True) as w:
        assert w.written == 1
        w.write({"tokens": np.arange(3, dtype=np.int32), "n": 2})
    assert [s["n"] for s in gpufeed.open_dataset(tmp_path / "r.lmdb")] == [1, 2]


def test_inspect_says_which_fields_were_inferred(tmp_path, capsys):
    from gpufeed.cli import main

    with gpufeed.Writer(tmp_path / "i.lmdb", "lmdb", schema={"n": "int"}) as w:
        w.write({"n": 1, "tokens": np.arange(3, dtype=np.int32)})
    assert main(["inspect", str(tmp_path / "i.lmdb")]) == 0
    assert re.search(r"inferred:\s+tokens", capsys.readouterr().out)


def test_sources_txt_is_written_only_where_it_says_more_than_a_samples_place(tmp_path):
    with gpufeed.Writer(tmp_path / "plain", format="tar", schema=SCHEMA) as w:
        for i in range(3):
            w.write(sample(i))
    assert not (tmp_path / "plain" / "sources.txt").exists()
    assert gpufeed.open_dataset(tmp_path / "plain").reader.sources() is None

    def two_of_some(i):  # input 1 gives no sample, input 2 two: sample k is not input k
        return [sample(i)] * (0 if i == 1 else 1 + (i == 2))

    gpufeed.pack_map(two_of_some, range(4), tmp_path / "fn", format="tar", schema=SCHEMA, workers=0)
    assert (tmp_path / "fn" / "sources.txt").read_text().splitlines() == ["#0", "#2", "#2", "#3"]
