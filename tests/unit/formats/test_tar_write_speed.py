"""formats/tar/fields.py's fast paths: which samples take them, and that what they make is
record.member_bytes' members, byte for byte (the shards' bytes: test_tar_write_bytes.py).

A part whose samples all span the same bytes (fixed-shape arrays, ints, floats) is built as
[samples, bytes] rows with no Python a sample; its scratch rows are kept for the next run of
the same layout, so a run must write every byte the row leaves variable (a stale byte of an
earlier part would be a wrong member)."""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np
import pytest
from test_tar_write_bytes import _expected_members, _parts, _tarfile_bytes, _write

from gpufeed.formats import record
from gpufeed.formats.schema import parse_schema
from gpufeed.formats.spec import SampleSpec
from gpufeed.formats.tar import fields, hashing, writer
from gpufeed.formats.tar.fields import PartMembers, Scratch, float_text, int_text
from gpufeed.formats.tar.writer import TarWriter

EDGE_INTS = [0, 1, 9, 10, 99, 100, 9999, 10**4, 10**7 - 1, 10**7, 10**8 - 1, 10**8, -1, -10]
EDGE_INTS += [(1 << 63) - 1, -(1 << 63), 123456789012345]


def _texts(text) -> list[bytes]:
    assert not any(row[n:].any() for row, n in zip(text.chars, text.lens.tolist(), strict=True))
    return [row[:n].tobytes() for row, n in zip(text.chars, text.lens.tolist(), strict=True)]


@pytest.mark.parametrize("values", [EDGE_INTS, list(range(1000)), [5] * 7, [10**8 - 1] * 3])
def test_int_text_is_member_bytes(values):
    field = parse_schema({"v": "int"}).fields[0]
    arr = np.array(values, np.int64)
    want = [record.member_bytes(field, v.tobytes()) for v in arr]
    assert _texts(int_text(arr)) == want


def test_float_text_is_member_bytes():
    field = parse_schema({"v": "float"}).fields[0]
    rng = np.random.default_rng(1)
    arr = np.r_[[0.0, -0.0, 0.1, 1e16, 1e-5, 5e-324, -1.7976931348623157e308, np.nan],
                [np.inf, -np.inf, 2.5, 1 / 3], rng.standard_normal(200) * 10.0 ** rng.integers(
                    -30, 30, 200)]  # fmt: skip
    want = [record.member_bytes(field, v.tobytes()) for v in arr]
    assert _texts(float_text(arr)) == want


def _no_copy_loop(monkeypatch) -> None:
    def refused(*args, **kwargs):
        raise AssertionError("a member was copied one at a time")

    monkeypatch.setattr(fields, "_copy_field", refused)


def test_fixed_size_samples_are_built_without_python_a_sample(tmp_path, monkeypatch):
    schema = parse_schema({"x": "uint8[1000]", "y": "float32[3]", "label": "int", "s": "float"})

    def make(i):
        return {"x": np.full(1000, i % 256, np.uint8), "y": np.full(3, i, np.float32),
                "label": i * 7919 % 100_003, "s": i / 7}  # fmt: skip

    parts = _parts(schema, make, count=300, part=100)
    members = PartMembers.of_fields(schema, parts[0])
    assert members.row is not None and members.row_key is not None
    _no_copy_loop(monkeypatch)
    info = _write(tmp_path / "out", schema, parts, {"items": None, "shard_size": 70})
    got = []
    for name in info["layout"]["shards"]:
        with tarfile.open(tmp_path / "out" / name) as tf:
            got += [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    assert len(got) == 300 * 4
    i = 123
    x = np.load(io.BytesIO(dict(got)[f"{i:09d}.x.npy"]))
    np.testing.assert_array_equal(x, make(i)["x"])
    assert dict(got)[f"{i:09d}.label.cls"] == b"%d" % make(i)["label"]
    assert dict(got)[f"{i:09d}.s.json"] == repr(i / 7).encode()


def _members(schema, parts, scratch) -> list[bytes]:
    """Each part's tar bytes as built with ``scratch`` (kept across parts, as a writer does)."""
    out = []
    for part in parts:
        members = PartMembers.of_fields(schema, part, scratch)
        out.append(members.build(0, len(part), 0)[0].tobytes())
    return out


LENGTHS = [5, 300, 5, 5, 1, 300, 300, 290, 300, 290, 120]  # one a part


@pytest.mark.parametrize(
    "kind",
    ["int32[-1]", "bytes"],  # one shape a part, rows of one size; payloads of one size
)
def test_rows_kept_for_the_next_part_are_written_whole(tmp_path, kind):
    """Parts alternating between layouts and sizes (of the same layout too: 290 and 300 int32
    or bytes take the same blocks), one scratch for all: each part's bytes are those it
    builds with a fresh one."""
    schema = parse_schema({"t": kind, "label": "int", "s": "float"})

    def make(i):
        n = LENGTHS[i // 10]
        t = np.full(n, i, np.int32) if kind != "bytes" else bytes([i % 256 | 1]) * n
        return {"t": t, "label": [3, -(1 << 63), 10**9][i % 3] + i,
                "s": [0.5, float("nan"), -1e-300][i % 3]}  # fmt: skip

    parts = _parts(schema, make, count=10 * len(LENGTHS), part=10)
    kept = _members(schema, parts, Scratch())
    fresh = [_members(schema, [p], Scratch())[0] for p in parts]
    assert kept == fresh
    assert all(PartMembers.of_fields(schema, p).row_key is not None for p in parts)
    # and these are the members record.member_bytes makes (each part's first sample)
    for part, data in zip(parts, kept, strict=True):
        stored = record.split_record(schema, part.sample(0))
        want = [record.member_bytes(f, v) for f, v in zip(schema.fields, stored, strict=True)]
        got = [m.read() for m in _read_members(data)[:3]]
        assert got == want


def _read_members(data: bytes) -> list:
    tf = tarfile.open(fileobj=io.BytesIO(data + bytes(1024)))
    return [tf.extractfile(m) for m in tf.getmembers()]


def test_a_part_whose_payload_ends_early_is_an_error_not_other_memory():
    """Fixed-size records whose offsets run past the payload (a damaged part): the strided
    copy is not taken; the member copy refuses (never a view past the buffer)."""
    schema = parse_schema({"x": "uint8[1000]"})
    part = _parts(schema, lambda i: {"x": np.full(1000, i, np.uint8)}, count=8, part=8)[0]
    part.payload = part.payload[:-500]  # the last record's bytes are cut short
    members = PartMembers.of_fields(schema, part)
    with pytest.raises(ValueError):
        members.build(0, 8, 0)


@pytest.mark.parametrize("seed", range(4))
def test_parts_of_random_layouts_are_tarfiles_bytes(tmp_path, monkeypatch, seed):
    """Parts whose values are one size (rows kept) or of many sizes, in random order, runs
    of a few samples (both scratch buffers in turn, each hashed in the thread): the shards
    are tarfile's bytes of member_bytes' members, and their sha256 the manifest's."""
    monkeypatch.setattr(writer, "RUN_BYTES", 20_000)
    schema = parse_schema({"b": "bytes", "x": "uint8[-1]", "label": "int", "s": "float"})
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 290, 300, 511, 512, 513, 1000]
    plan = [(rng.random() < 0.6, int(rng.choice(sizes))) for _ in range(12)]  # a part each

    def make(i):
        one, size = plan[i // 25]
        n = size if one else int(rng.choice(sizes))
        label, s = int(rng.integers(-5, 10**9)), float(rng.standard_normal())
        x = np.full(n if one else n // 2, 7, np.uint8)
        return {"b": bytes([i % 255 + 1]) * n, "x": x, "label": label, "s": s}

    parts = _parts(schema, make, count=300, part=25)
    info = _write(tmp_path / "out", schema, parts, {"items": None, "shard_size": 70})
    members = _expected_members(schema, parts)
    at = 0
    for name, count in zip(info["layout"]["shards"], info["layout"]["shard_counts"], strict=True):
        data = (tmp_path / "out" / name).read_bytes()
        want = _tarfile_bytes(members[at : at + 4 * count])
        assert data[: len(want)] == want and not data[len(want) :].strip(b"\0")
        assert hashlib.sha256(data).hexdigest() == info["sha256"][name]
        at += 4 * count
    assert at == len(members)


_SHA256 = hashlib.sha256


def _bytes_and_label(i: int) -> dict:
    return {"b": bytes([i % 256]) * (i * 7 % 900), "label": i}


class _Counted:
    """hashlib.sha256, counting the bytes it is given (all instances together)."""

    hashed = 0

    def __init__(self):
        self._h = _SHA256()

    def update(self, data):
        _Counted.hashed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self):
        return self._h.hexdigest()


def _fed(out, schema, parts, options, recut=False):
    """A TarWriter fed as parts are committed (count None), finished as Stream does: cut
    again where it says so."""
    out.mkdir()
    w = TarWriter(out, SampleSpec("fields", schema=schema), None, 0, options)
    for p in parts:
        w.add(p)
    assert w.needs_rewrite() == recut
    if recut:
        w.end_shards()
        kept = out.parent / "streamed"
        out.rename(kept)
        out.mkdir()
        w.recut(kept)
    return w.finish()


@pytest.mark.parametrize(
    "options, count, recut",
    [
        ({"items": None}, 300, True),  # cut for 10,000 a shard: cut again, for 64
        ({"items": 1100}, 1100, False),  # cut for 69 a shard: settled by the last part
        ({"items": None, "shard_bytes": 40_000}, 300, False),  # cut by bytes: not again
        ({"items": None, "shard_size": 50}, 300, False),  # the user's cut: hashed as written
    ],
)
def test_every_shard_byte_is_hashed_once(tmp_path, monkeypatch, options, count, recut):
    """A streamed pack that may be cut again is hashed as cut at the end (not twice); one
    whose cut settles catches up from its files (the shard being written from its bytes so
    far); the digests are the files'."""
    monkeypatch.setattr(hashing.hashlib, "sha256", _Counted)
    monkeypatch.setattr(writer, "RUN_BYTES", 20_000)
    _Counted.hashed = 0
    schema = parse_schema({"b": "bytes", "label": "int"})
    parts = _parts(schema, _bytes_and_label, count=count)
    info = _fed(tmp_path / "out", schema, parts, options, recut)
    files = {n: (tmp_path / "out" / n).read_bytes() for n in info["layout"]["shards"]}
    assert info["sha256"] == {n: _SHA256(d).hexdigest() for n, d in files.items()}
    assert _Counted.hashed == sum(map(len, files.values()))
    assert sum(info["layout"]["shard_counts"]) == count


@pytest.mark.parametrize("which", ["finished", "current"])
def test_a_shard_gone_before_it_is_hashed_is_an_error_not_a_digest(tmp_path, monkeypatch, which):
    """Catching up reads the shards back: one that is not there (removed under the writer)
    fails the pack's finish, never gives the digest of what was read of it."""
    schema = parse_schema({"b": "bytes", "label": "int"})
    parts = _parts(schema, _bytes_and_label, count=1100)
    out = tmp_path / "out"
    out.mkdir()
    w = TarWriter(out, SampleSpec("fields", schema=schema), None, 0, {"items": 1100})
    catch_up = TarWriter._catch_up

    def gone(self):
        (self.current_file if which == "current" else out / self.names[0]).unlink()
        catch_up(self)

    monkeypatch.setattr(TarWriter, "_catch_up", gone)
    for p in parts:
        w.add(p)  # the last settles the cut: the shards so far are read back
    assert not w._hasher.deferred
    with pytest.raises(FileNotFoundError):
        w.finish()
