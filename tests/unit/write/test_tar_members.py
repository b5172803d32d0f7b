"""Tar members serialised in pack(fn)'s workers and placed by numpy in the writer
(gpufeed.formats.tarmembers) are the bytes the per-member serialiser writes, byte for byte,
for every field type, over shard boundaries, streamed and resumed alike."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpufeed
import gpufeed.formats.tar as tar_format
from gpufeed.formats.record import encode_record
from gpufeed.formats.schema import parse_schema
from gpufeed.formats.tarmembers import place_members, sample_members

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
def per_member(tmp_path_factory) -> dict[str, bytes]:
    """The pack as the per-member serialiser writes it (placing turned off)."""
    dest = tmp_path_factory.mktemp("ref") / "p"
    mp = pytest.MonkeyPatch()
    mp.setattr(tar_format, "placeable", lambda schema: False)
    try:
        gpufeed.pack(make, range(N), dest, workers=0, **OPTS)
    finally:
        mp.undo()
    return _files(dest)


def test_worker_serialised_members_are_the_per_member_bytes(per_member, tmp_path):
    dest = tmp_path / "p"
    gpufeed.pack(make, range(N), dest, workers=2, **OPTS)
    got = _files(dest)
    assert len([n for n in got if n.endswith(".tar")]) == 3  # shard boundaries inside parts
    assert got == per_member
    ds = gpufeed.open_dataset(dest, map_style=True)
    for i in (0, 1, 57, 399):
        assert ds[i]["text"] == make(i)["text"] and ds[i]["label"] == i - 50
        np.testing.assert_array_equal(ds[i]["tokens"], make(i)["tokens"])
    with tarfile.open(dest / "shard-000001.tar") as t:  # plain tarfile reads every member
        names = t.getnames()
        assert names[0] == "000000150.image.jpg" and len(names) == 150 * len(SCHEMA)
        assert t.extractfile(names[0]).read() == JPEG


def test_a_resumed_and_an_in_process_pack_are_the_same_bytes(per_member, tmp_path):
    opts = {k: v for k, v in OPTS.items() if k != "quiet"}
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError), gpufeed.Writer(resumed, **opts) as w:
        for i in range(200):
            w.write(make(i))
        raise RuntimeError("stopped after three committed parts")
    with gpufeed.Writer(resumed, resume=True, **opts) as w:
        for i in range(w.written, N):
            w.write(make(i))
    assert _files(resumed) == per_member


def test_place_members_writes_keys_and_checksums_as_tarfile_does():
    schema = parse_schema(SCHEMA)
    members = [sample_members(schema, encode_record(schema, make(i))) for i in range(5)]
    assert all(isinstance(m, bytes) for m in members)
    placed = place_members(members, len(SCHEMA), 123_456_780)
    with tarfile.open(fileobj=io.BytesIO(bytes(placed.data) + bytes(1024))) as t:
        infos = t.getmembers()  # tarfile checks every header's checksum
    assert [i.name for i in infos[: len(SCHEMA)]] == [
        f"123456780.{k}.{v}"
        for k, v in zip(
            SCHEMA,
            ["jpg", "npy", "npy", "npy", "txt", "bin", "json", "cls", "json", "npy.zst"],
            strict=True,
        )
    ]
    assert infos[-1].name == "123456784.packed.npy.zst"
    assert placed.starts.tolist() == np.cumsum([0] + [len(m) for m in members[:-1]]).tolist()
    assert placed.sizes.tolist() == [len(m) for m in members]
    last = infos[len(SCHEMA) - 1]  # a span ends at its last member's data, before the padding
    assert placed.spans[0] == last.offset_data + last.size
