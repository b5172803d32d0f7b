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
    gpufeed.pack(make, range(N), dest, workers=0, **OPTS)
    return _files(dest)


def test_a_pack_made_by_workers_is_the_in_process_bytes(in_process, tmp_path):
    dest = tmp_path / "p"
    gpufeed.pack(make, range(N), dest, workers=2, **OPTS)
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


def test_short_writes_are_finished(in_process, tmp_path, monkeypatch):
    """The tar writer's writev may write less than it was given (a signal, a pipe-like
    file system): the rest is written after it, the pack the same bytes."""
    import os

    real_write, calls = os.write, []

    def short_writev(fd, buffers):
        first = memoryview(buffers[0])
        calls.append(len(buffers))
        return real_write(fd, first[: max(1, len(first) // 2)])

    monkeypatch.setattr(os, "writev", short_writev)
    dest = tmp_path / "p"
    gpufeed.pack(make, range(N), dest, workers=0, **OPTS)
    assert calls and _files(dest) == in_process
