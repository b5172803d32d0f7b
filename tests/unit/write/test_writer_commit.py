"""The Writer's parts: written in a commit thread and not fsynced, so a resume checks each
part it keeps (check_part) and redoes a torn one and every part after it; a streamed tar or
LMDB pack's parts hold no payload (the shard or data.mdb does: read back on resume); the
record encoder made once a schema gives encode_record's bytes; tar shards hashed as
written."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from encoded_parts import encoded_part
from faults import tear

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.formats.checksums import sha256_file
from gpufeed.formats.parts import Part
from gpufeed.formats.record import encode_record, record_encoder
from gpufeed.formats.schema import parse_schema
from gpufeed.write.direct import check_part, keep_streamed

sys.path.insert(0, str(Path(__file__).parent))
from test_writer import SCHEMA, _pack_files, check, sample  # noqa: E402


def _stopped(dest: Path, fmt: str, n: int) -> Path:
    """A Writer of ``n`` samples in parts of 4, left by an error: its parts folder."""
    with pytest.raises(RuntimeError), gpufeed.Writer(dest, format=fmt, schema=SCHEMA,
                                                     part_size=4) as w:  # fmt: skip
        for i in range(n):
            w.write(sample(i))
        raise RuntimeError("stopped")
    parts = sorted((dest.parent / (dest.name + ".partial") / "parts").glob("part-*.npz"))
    assert len(parts) == n // 4
    return parts[0].parent


@pytest.mark.parametrize("how", ["zeros", "cut", "flipped"])
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_torn_part_is_redone_with_the_parts_after_it(tmp_path, fmt, how):
    dest = tmp_path / "p"
    parts = _stopped(dest, fmt, 20)
    partial = parts.parent
    assert Part.load(parts / "part-000002.npz").where is not None  # no payload: out/ has it
    if how == "flipped":  # sample 9's bytes in the streamed shard or data.mdb
        _torn(partial / "out" / ("shard-000000.tar" if fmt == "tar" else "data.mdb"), how)
    else:
        _torn(parts / "part-000002.npz", how)
    keep_streamed(partial)
    assert check_part(parts / "part-000001.npz", partial) is not None
    assert check_part(parts / "part-000002.npz", partial) is None
    with gpufeed.Writer(dest, format=fmt, resume=True, part_size=4) as w:
        assert w.written == 8 and w.inputs_done == 8
        assert not (parts / "part-000003.npz").exists()  # after the torn one: written again
        for i in range(w.written, 22):
            w.write(sample(i))
    check(dest, 22)
    fresh = tmp_path / "fresh"
    with gpufeed.Writer(fresh, format=fmt, schema=SCHEMA, part_size=4) as w:
        for i in range(22):
            w.write(sample(i))
    assert _pack_files(dest) == _pack_files(fresh)


def test_pack_fn_resumes_past_a_torn_part(tmp_path):
    dest = tmp_path / "p"
    parts = _stopped(dest, "tar", 16)
    _torn(parts / "part-000003.npz", "zeros")
    gpufeed.pack_map(sample, range(30), dest, format="tar", resume=True, workers=0, quiet=True,
                 part_size=4)  # fmt: skip
    check(dest, 30)


def test_a_commit_that_fails_is_raised_at_the_next_part_and_the_pack_resumes(tmp_path, monkeypatch):
    from gpufeed.formats import parts as parts_mod

    dest, calls = tmp_path / "p", []
    save = parts_mod.Part.save

    def failing(self, path, sync=True):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError("disk said no")
        save(self, path, sync)

    monkeypatch.setattr(parts_mod.Part, "save", failing)
    with pytest.raises(OSError, match="disk said no"):
        with gpufeed.Writer(dest, format="tar", schema=SCHEMA, part_size=4) as w:
            for i in range(40):
                w.write(sample(i))
    monkeypatch.setattr(parts_mod.Part, "save", save)
    with gpufeed.Writer(dest, format="tar", resume=True, part_size=4) as w:
        assert w.written == 8  # the two parts before the failed one
        for i in range(w.written, 40):
            w.write(sample(i))
    check(dest, 40)


def test_the_record_encoder_gives_encode_records_bytes():
    schema = parse_schema({"x": "float32[2,3]", "n": "int", "s": "str", "r": "int32[-1]"})
    enc = record_encoder(schema)
    samples = [
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 5, "s": "a", "r": [1, 2]},
        {
            "x": np.arange(6).reshape(2, 3),
            "n": np.int64(-3),
            "s": "",
            "r": np.zeros(0, np.int16),
        },  # cast
        {"x": np.asfortranarray(np.ones((2, 3), np.float32)), "n": 1, "s": "é", "r": [3]},
        {"x": np.ones((3, 2), np.float32).T, "n": -(1 << 63), "s": "z", "r": [7]},
        # the ragged fast path: an ndarray of the field's dtype, contiguous or not
        {"x": np.ones((2, 3), np.float32), "n": 0, "s": "", "r": np.arange(5, dtype=np.int32)},
        {"x": np.ones((2, 3), np.float32), "n": 0, "s": "", "r": np.arange(8, dtype=np.int32)[::2]},
    ]
    for s in samples:
        assert enc(s) == encode_record(schema, s)
    grid = parse_schema({"g": "uint16[-1,3]", "b": "bytes"})
    fast = record_encoder(grid)
    for s in ({"g": np.arange(6, dtype=np.uint16).reshape(2, 3), "b": b"\x00\x01"},
              {"g": np.zeros((0, 3), np.uint16), "b": bytearray(b"ab")},
              {"g": [[1, 2, 3]], "b": b""}):  # fmt: skip
        assert fast(s) == encode_record(grid, s)
    for bad in ({"g": np.zeros((2, 4), np.uint16), "b": b""},  # a fixed dimension differs
                {"g": np.zeros(3, np.uint16), "b": b""},  # another number of dimensions
                {"g": np.full((1, 3), 70000), "b": b""}):  # fmt: skip
        with pytest.raises(UsageError):
            fast(bad)
    for bad in ({"x": np.ones((3, 2), np.float32), "n": 1, "s": "", "r": []},
                {"x": np.ones((2, 3), np.float32), "n": 1, "s": ""},
                {"x": np.ones((2, 3), np.float32), "n": 1, "s": "", "r": [], "extra": 1},
                {"x": np.ones((2, 3), np.float32), "n": 1 << 63, "s": "", "r": []}):  # fmt: skip
        with pytest.raises(Exception) as want:
            encode_record(schema, bad)
        with pytest.raises(type(want.value)):
            enc(bad)


def test_the_record_encoder_stores_an_image_fields_bytes_as_given_and_checks_their_format():
    jpeg = b"\xff\xd8\xff\xe0" + bytes(range(40))
    png = b"\x89PNG\r\n\x1a\n" + bytes(30)
    schema = parse_schema({"image": "jpeg", "mask": "png", "label": "int"})
    fast = record_encoder(schema)
    sample = {"image": jpeg, "mask": png, "label": 3}
    assert fast(sample) == encode_record(schema, sample)
    assert jpeg in fast(sample) and png in fast(sample)
    webp = b"RIFF" + bytes(4) + b"WEBP" + bytes(20)
    art = parse_schema({"art": "webp"})
    assert record_encoder(art)({"art": webp}) == encode_record(art, {"art": webp})
    with pytest.raises(UsageError, match="expected webp bytes"):
        record_encoder(art)({"art": b"RIFF" + bytes(4) + b"WAVE" + bytes(20)})
    for wrong in ({"image": png, "mask": png, "label": 3},  # a PNG in the jpeg field
                  {"image": b"GIF89a" + bytes(9), "mask": png, "label": 3}):  # fmt: skip
        with pytest.raises(UsageError, match="expected jpeg bytes"):
            fast(wrong)


def test_tar_shards_are_hashed_as_written(tmp_path):
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, format="tar", schema=SCHEMA, part_size=7, shard_size=10) as w:
        for i in range(35):
            w.write(sample(i))
    files = w.manifest["files"]
    assert len([n for n in files if n.startswith("shard-")]) == 4
    for name, entry in files.items():
        assert entry["sha256"] == sha256_file(dest / name), name


def test_a_flushed_part_keeps_its_payload_and_lmdb_records_outlive_the_writer(tmp_path):
    """flush() commits a part now, with its payload (an LMDB transaction may still hold its
    records); a writer left by an error commits LMDB's pending records, so the parts that
    name them are kept by the resume."""
    dest = tmp_path / "p"
    with pytest.raises(RuntimeError), gpufeed.Writer(dest, format="lmdb", schema=SCHEMA,
                                                     part_size=4) as w:  # fmt: skip
        for i in range(6):
            w.write(sample(i))
        w.flush()
        raise RuntimeError("stopped")
    parts = tmp_path / "p.partial" / "parts"
    assert Part.load(parts / "part-000000.npz").where is not None
    assert Part.load(parts / "part-000001.npz").where is None  # flushed: holds its payload
    with gpufeed.Writer(dest, format="lmdb", resume=True, part_size=4) as w:
        assert w.written == 6
        for i in range(6, 9):
            w.write(sample(i))
    check(dest, 9)


def _torn(path: Path, how: str) -> None:
    tear(path, how, b"s9", 1)


def test_a_resume_without_part_size_keeps_the_size_the_pack_was_started_with(tmp_path):
    dest = tmp_path / "p"
    _stopped(dest, "tar", 8)  # parts of 4
    with pytest.raises(UsageError, match=r"part_size: 4 -> 6"):
        gpufeed.Writer(dest, format="tar", resume=True, part_size=6)
    with gpufeed.Writer(dest, format="tar", resume=True) as w:  # the default is not 4
        assert w.state["part_size"] == 4 and w.written == 8
        for i in range(8, 13):
            w.write(sample(i))
    check(dest, 13)


def test_a_writer_commits_parts_of_8192_samples_or_16_mib_by_default(tmp_path):
    from gpufeed.write.writer import PART_BYTES, WRITER_PART_SIZE

    assert (WRITER_PART_SIZE, PART_BYTES) == (8192, 16 << 20)
    with gpufeed.Writer(tmp_path / "n", format="tar", schema={"x": "uint8[64]"}) as w:
        for i in range(WRITER_PART_SIZE + 1):
            w.write({"x": np.full(64, i % 256, np.uint8)})
        w._wait_committed()
        assert (w.parts, w._pending.count) == (1, 1)  # one part of 8,192, one sample pending
    with gpufeed.Writer(tmp_path / "b", format="tar", schema={"x": "uint8[1048576]"}) as w:
        for i in range(17):
            w.write({"x": np.full(1 << 20, i, np.uint8)})
        assert w.parts == 1 and w._pending.count == 1  # 16 MiB of records made the part


def test_the_generated_record_encoder_takes_names_of_its_own_variables_and_many_fields():
    own = ["v0", "s1", "sample", "head", "schema", "encode_record", "MISSING", "name0"]
    schema = parse_schema({**{n: "int" for n in own}, **{f"f{i}": "float32[2]" for i in range(40)}})
    sample = {
        **{n: i for i, n in enumerate(own)},
        **{f"f{i}": np.full(2, i, np.float32) for i in range(40)},
    }
    enc = record_encoder(schema)
    assert enc(sample) == encode_record(schema, sample)
    with pytest.raises(UsageError, match="missing"):
        enc({**{k: v for k, v in sample.items() if k != "head"}, "other": 1})


@pytest.mark.parametrize("fmt", ["tar", "lmdb", "mmap", "hdf5"])
def test_parts_written_from_buffers_filled_again_keep_their_own_samples(tmp_path, fmt):
    # parts of 1,000 records: not a multiple of LMDB's transaction, so records of one part
    # wait for the next one's transaction while the Writer fills its buffers again
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (6000, 40), dtype=np.uint8)
    with gpufeed.Writer(tmp_path / "p", format=fmt, schema={"x": "uint8[-1]"}, part_size=1000) as w:
        for i, row in enumerate(rows):
            w.write({"x": row[: 8 + i % 33]})
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    for i in range(0, 6000, 7):
        np.testing.assert_array_equal(ds[i]["x"].numpy(), rows[i, : 8 + i % 33])
    assert gpufeed.verify(tmp_path / "p").ok


def test_a_parts_extensions_are_stored_once_when_every_sample_has_the_same(tmp_path):
    n = 5
    part = encoded_part(np.arange(n, dtype=np.uint8), [1] * n)
    part.exts = np.full(n, "rec", "<U8")
    part.save(tmp_path / "same.npz", sync=False)
    with np.load(tmp_path / "same.npz") as z:
        assert z["exts"].tolist() == ["rec"]
    assert Part.load(tmp_path / "same.npz").exts.tolist() == ["rec"] * n
    part.exts = np.asarray(["jpg", "png", "jpg", "jpg", "jpg"])
    part.save(tmp_path / "mixed.npz", sync=False)
    assert Part.load(tmp_path / "mixed.npz").exts.tolist() == ["jpg", "png", "jpg", "jpg", "jpg"]
