"""A multi-field tar pack is the same bytes however it was made: pack(fn) with worker
processes, a Writer in-process, or resumed from its committed parts; for every field type,
with shard boundaries inside parts. (Kept from an attempt to serialise the members in the
workers, measured slower on 2 cores: docs/benchmarks.md, "Conversion".)"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpufeed

SCHEMA = {
    "image": "jpeg",
    "tokens": "int32[-1]",
    "boxes": "float32[-1,4]",
    "x": "float32[2,3]",
    "text": "str",
    "raw": "bytes",
    "score": "float",
    "label": "int",
    "meta": "json",
    "packed": {"type": "int16[-1]", "compression": "zstd"},
}


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 90, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


JPEG = _jpeg()


def make(i: int) -> dict:
    return {
        "image": JPEG,
        "tokens": np.arange(i % 7, dtype=np.int32) + i,
        "boxes": np.full((i % 3, 4), i / 3, np.float32),
        "x": np.full((2, 3), -i, np.float32),
        "text": f"caption {i} " * (i % 5) + "é",
        "raw": bytes([i % 256]) * (i % 600),
        "score": [0.1 * i, float("nan"), float("inf"), -1e300][i % 4],
        "label": i - 50,
        "meta": {"i": i, "tags": ["a"] * (i % 3)},
        "packed": np.arange(i % 40, dtype=np.int16),
    }


def _files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.name != "manifest.json"}


OPTS = {"format": "tar", "schema": SCHEMA, "part_size": 64, "shard_size": 150, "quiet": True}
N = 400


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> dict[str, bytes]:
    """The pack made in-process, in one run."""
    dest = tmp_path_factory.mktemp("ref") / "p"
    gpufeed.pack_map(make, range(N), dest, workers=0, **OPTS)
    return _files(dest)


def test_a_pack_made_by_workers_is_the_in_process_bytes(in_process, tmp_path):
    dest = tmp_path / "p"
    gpufeed.pack_map(make, range(N), dest, workers=2, **OPTS)
    got = _files(dest)
    assert len([n for n in got if n.endswith(".tar")]) == 3  # shard boundaries inside parts
    assert got == in_process
    ds = gpufeed.open_dataset(dest, map_style=True)
    for i in (0, 1, 57, 399):
        assert ds[i]["text"] == make(i)["text"] and ds[i]["label"] == i - 50
        np.testing.assert_array_equal(ds[i]["tokens"], make(i)["tokens"])
    with tarfile.open(dest / "shard-000001.tar") as t:  # plain tarfile reads every member
        names = t.getnames()
        assert names[0] == "000000150.image.jpg" and len(names) == 150 * len(SCHEMA)
        assert t.extractfile(names[0]).read() == JPEG


def test_a_resumed_writer_pack_is_the_same_bytes(in_process, tmp_path):
    opts = {k: v for k, v in OPTS.items() if k != "quiet"}
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError), gpufeed.Writer(resumed, **opts) as w:
        for i in range(200):
            w.write(make(i))
        raise RuntimeError("stopped after three committed parts")
    with gpufeed.Writer(resumed, resume=True, **opts) as w:
        for i in range(w.written, N):
            w.write(make(i))
    assert _files(resumed) == in_process


def test_a_default_cut_pack_is_the_same_bytes_streamed_resumed_or_by_workers(tmp_path):
    """Without shard_size a Writer's stream cuts shards before it knows the count (10,000 a
    shard: 400 samples in one); closing, it writes the pack again from its parts, cut as
    the count asks (64 a shard: gpufeed.formats.tar.writer.default_shard_size), the bytes a
    resumed Writer (which knows the count) writes."""
    opts = {k: v for k, v in OPTS.items() if k not in ("shard_size", "quiet")}
    fresh = tmp_path / "fresh"
    m = gpufeed.pack_map(make, range(N), fresh, workers=0, quiet=True, **opts)
    assert m["layout"]["shard_counts"] == [64] * 6 + [16]
    assert not (tmp_path / "fresh.partial").exists()
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError), gpufeed.Writer(resumed, **opts) as w:
        for i in range(200):
            w.write(make(i))
        raise RuntimeError("stopped after three committed parts")
    with gpufeed.Writer(resumed, resume=True, **opts) as w:
        for i in range(w.written, N):
            w.write(make(i))
    gpufeed.pack_map(make, range(N), tmp_path / "workers", workers=2, quiet=True, **opts)
    assert _files(fresh) == _files(resumed) == _files(tmp_path / "workers")
    ds = gpufeed.open_dataset(fresh, map_style=True)
    assert ds[399]["text"] == make(399)["text"] and ds[0]["label"] == -50


def test_short_writes_are_finished(in_process, tmp_path, monkeypatch):
    """The tar writer's os.write may write less than it was given (a signal, a pipe-like
    file system): the rest is written after it, the pack the same bytes."""
    import os

    real_write, calls = os.write, []

    def short_write(fd, data):
        data = memoryview(data)
        calls.append(len(data))
        return real_write(fd, data[: max(1, len(data) // 2)])

    monkeypatch.setattr(os, "write", short_write)
    dest = tmp_path / "p"
    gpufeed.pack_map(make, range(N), dest, workers=0, **OPTS)
    assert calls and _files(dest) == in_process


def test_every_shard_is_the_bytes_tarfile_writes_for_its_members(in_process, tmp_path):
    """The members' headers, data and padding, built a run of samples at a time with numpy
    (gpufeed.formats.tar.fields), against tarfile writing the same members: the same bytes;
    and each member holds what webdataset's decoders read back as the field."""
    for name in [n for n in in_process if n.endswith(".tar")]:
        members = []
        with tarfile.open(fileobj=io.BytesIO(in_process[name])) as t:
            for info in t.getmembers():
                members.append((info.name, t.extractfile(info).read()))
        ref = io.BytesIO()
        with tarfile.open(fileobj=ref, mode="w", format=tarfile.USTAR_FORMAT) as t:
            for member, data in members:
                info = tarfile.TarInfo(member)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uname = info.gname = ""
                t.addfile(info, io.BytesIO(data))
        assert ref.getvalue() == in_process[name], name
    data = dict(members)  # the last shard: samples 300..399
    i = 399
    key = f"{i:09d}"
    np.testing.assert_array_equal(np.load(io.BytesIO(data[f"{key}.tokens.npy"])), make(i)["tokens"])
    np.testing.assert_array_equal(np.load(io.BytesIO(data[f"{key}.boxes.npy"])), make(i)["boxes"])
    assert data[f"{key}.label.cls"] == b"%d" % (i - 50)
    assert data[f"{key}.text.txt"].decode() == make(i)["text"]


@pytest.mark.parametrize(
    "first_key, suffixes",
    [(0, [".image.jpg", ".label.cls"]), (10**9 - 2, [".a.npy"]), (7, ["." + "x" * 64 + ".bin"])],
)
def test_member_headers_at_once_are_member_header_for_each(first_key, suffixes):
    """ustar.member_headers (numpy, a run of samples at once; one at a time for keys past
    nine digits) is member_header for every member."""
    from gpufeed.formats.tar.members import member_header, member_headers

    sizes = np.array([[0, 511][: len(suffixes)], [512, 8**11 - 1][: len(suffixes)],
                      [1, 12345][: len(suffixes)], [7, 8][: len(suffixes)]], np.int64)  # fmt: skip
    got = member_headers(first_key, suffixes, sizes)
    for j in range(len(sizes)):
        key = f"{first_key + j:09d}"
        for k, suffix in enumerate(suffixes):
            assert got[j, k].tobytes() == member_header(key + suffix, int(sizes[j, k])), (j, k)


def test_a_ragged_field_of_one_shape_is_written_as_of_many(tmp_path):
    """A part whose ragged values all share a shape (one .npy header for all) gives the
    members a part of mixed shapes would: the same bytes for the samples they share."""
    schema = {"tokens": "int32[-1]", "label": "int"}
    same = [{"tokens": np.full(32, i, np.int32), "label": i} for i in range(6)]
    mixed = [*same, {"tokens": np.zeros(3, np.int32), "label": 6}]
    for name, samples in (("same", same), ("mixed", mixed)):
        gpufeed.pack_map(lambda s: s, samples, tmp_path / name, format="tar", schema=schema,
                     workers=0, quiet=True)  # fmt: skip
    one = (tmp_path / "same" / "shard-000000.tar").read_bytes()
    two = (tmp_path / "mixed" / "shard-000000.tar").read_bytes()
    cut = 6 * 2 * 2 * 512 - 512  # 6 samples: two members each, header + 128 B padded / 1 block
    assert one[:cut] == two[:cut]
    with tarfile.open(tmp_path / "same" / "shard-000000.tar") as t:
        got = np.load(io.BytesIO(t.extractfile("000000005.tokens.npy").read()))
    np.testing.assert_array_equal(got, np.full(32, 5, np.int32))
