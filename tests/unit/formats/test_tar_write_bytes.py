"""formats/tar/writer.py + fields.py: a TarWriter writes the same bytes whichever way it
builds a run (fixed-size samples a whole run at once, samples of varying sizes member by
member): each shard is what Python's tarfile writes for the members record.member_bytes
makes (an independent reference, below), and the files' sha256 are pinned to the bytes of
the writer as it was before the fixed-size path (so no rule of the layout moved, the index
included)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from gpufeed.formats.parts import Part
from gpufeed.formats.record import encode_record, member_bytes, member_name, split_record
from gpufeed.formats.schema import parse_schema
from gpufeed.formats.spec import SampleSpec
from gpufeed.formats.tar import writer
from gpufeed.formats.tar.members import KEY_FORMAT
from gpufeed.formats.tar.writer import INDEX_NAME, TarWriter

PART = 100  # samples a part
COUNT = 350  # samples a pack: 4 parts, the last short


def _jpeg(i: int) -> bytes:
    return b"\xff\xd8\xff\xe0" + bytes([i % 256]) * (700 + 37 * i % 2000)


FLOATS = [0.1, float("nan"), float("inf"), -float("inf"), -1e300, 5e-324, 1.0, -0.0, 2.5e16]
INTS = [0, -1, 7, -(1 << 63), (1 << 63) - 1, 123456789012, -999]

# name -> (schema, sample i)
CASES = {
    "fixed": ({"x": "uint8[1024]", "label": "int"}, lambda i: {
        "x": np.full(1024, i % 256, np.uint8), "label": i % 1000}),
    "fixed_multi": ({"x": "float32[3,5]", "y": "int16[7]", "label": "int", "score": "float"},
        lambda i: {"x": np.full((3, 5), i / 7, np.float32), "y": np.arange(7, dtype=np.int16) - i,
                   "label": INTS[i % 7] + (i if i % 7 in (0, 1, 2) else 0),
                   "score": FLOATS[i % 9] * (1 if i % 9 in (1, 2, 3) else i + 1)}),
    "fixed_big": ({"x": "uint8[100,1000]", "label": "int"}, lambda i: {
        "x": np.full((100, 1000), i % 256, np.uint8), "label": i}),
    "ragged": ({"tokens": "int32[-1]", "boxes": "float32[-1,4]"}, lambda i: {
        "tokens": np.arange(i % 7, dtype=np.int32) + i,
        "boxes": np.full((i % 3, 4), i / 3, np.float32)}),
    "ragged_one_shape": ({"t": "int64[-1]"}, lambda i: {"t": np.arange(5, dtype=np.int64) * i}),
    "jpeg": ({"image": "jpeg", "label": "int"}, lambda i: {"image": _jpeg(i), "label": i % 1000}),
    "bytes": ({"raw": "bytes"}, lambda i: {"raw": bytes([i % 256]) * (i % 1100)}),
    "str_one_block": ({"text": "str"}, lambda i: {"text": "é" * (i % 200 + 1)}),
    "str_json": ({"text": "str", "meta": "json"}, lambda i: {
        "text": f"caption {i} " * (i % 5), "meta": {"i": i, "tags": ["a"] * (i % 3)}}),
    "floats": ({"score": "float"}, lambda i: {"score": FLOATS[i % 9] * (i + 1)}),
    "zstd": ({"packed": {"type": "int16[-1]", "compression": "zstd"}, "label": "int"},
        lambda i: {"packed": np.arange(i % 40, dtype=np.int16), "label": -i}),
}  # fmt: skip

# name -> sha256 of (each shard's bytes, then index.npz's arrays), made by the writer before
# its fixed-size path (commit 2ba62d6)
PINNED = {
    "bytes": "02159bf7fd0eac49335c28a75c93944f86e76f87dabbdf6b0399320f41dafb48",
    "fixed": "adb9977198a95c8bfd41a620ef4843f983d4f87e69aba2e9c6c89767ba68d6aa",
    "fixed_big": "2d979d7bf90fa7c536afbe3f7c546517719f6d25173e8944cc8d45fc14a8a072",
    "fixed_multi": "9b42b9a55c0c56c028d3776404835cf17ddcc14c1311bc05b6e19a0af5d80084",
    "floats": "5b02247d1362e4ec9046b7a1f011c614811f04ca8b1ddcb579dffb409325031d",
    "jpeg": "be98c62973a1809b21a1aa718b8d16d6de994a70adf324b35bd23a8400998597",
    "ragged": "83447062fb164cbb08be6b09a48633a55df946042c3c2c07f76f436ea9b68c96",
    "ragged_one_shape": "ab4364a4450cac3ab284a2b892b67d3ed89976b330350b705dd20efddde7faf6",
    "str_json": "36956573cc4af84bbd5c89c618c750aa87c9823509991c23522a873362fc1356",
    "str_one_block": "e7b89a44fd9f146da7cd2fd5653434945d6b612d53ff2f4fc30fd7c84626a23b",
    "zstd": "d03352e03239dce28c14fc5ab20a8fd5a9641cf6ca5d343f30e59a64f2774b27",
    "array": "70c92fa0cff211effc43162746aa271baed2c145ec74bf1fe20a9b46aedd4035",
    "encoded": "5892b35f28ab97372e98c1cc24b690279b40d193b879ec2b9cdc00040a7a1cc2",
}


def _parts(schema, make, count=COUNT, part=PART) -> list[Part]:
    spec = SampleSpec("fields", schema=schema)
    parts = []
    for a in range(0, count, part):
        records = [encode_record(schema, make(i)) for i in range(a, min(count, a + part))]
        sizes = np.array([len(r) for r in records], np.int64)
        offsets = np.zeros(len(records) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        n = len(records)
        payload = np.frombuffer(b"".join(records), np.uint8)
        parts.append(Part(payload, offsets, np.zeros(n, np.int64), np.zeros(n, np.uint32),
                          np.arange(a, a + n), np.full(n, "rec", dtype="<U8"),
                          np.zeros(0, np.int64), np.zeros(0, str), spec))  # fmt: skip
    return parts


def _write(out: Path, schema, parts, options) -> dict:
    out.mkdir(parents=True)
    w = TarWriter(out, SampleSpec("fields", schema=schema), None, 0, options)
    for p in parts:
        w.add(p)
    return w.finish()


def _digest(out: Path, info: dict) -> str:
    h = hashlib.sha256()
    for name in info["layout"]["shards"]:
        h.update((out / name).read_bytes())
    with np.load(out / INDEX_NAME) as z:
        for k in sorted(z.files):
            h.update(k.encode() + z[k].tobytes())
    return h.hexdigest()


def _expected_members(schema, parts) -> list[tuple[str, bytes]]:
    """Every member of the pack, in order, from record.member_bytes one sample at a time."""
    out = []
    for part in parts:
        for j in range(len(part)):
            key = KEY_FORMAT % (part.items[j])
            fields = split_record(schema, part.sample(j))
            for f, stored in zip(schema.fields, fields, strict=True):
                out.append((member_name(key, f), member_bytes(f, stored)))
    return out


def _tarfile_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """What tarfile writes for these members (owner 0, mode 0644, mtime 0), no end blocks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = len(data), 0, 0o644, "", ""
            tf.addfile(ti, io.BytesIO(data))
        end = tf.offset
    return buf.getvalue()[:end]


@pytest.mark.parametrize("run_bytes", [None, 5000])
@pytest.mark.parametrize("name", sorted(CASES))
def test_shards_are_tarfiles_bytes_and_the_pinned_ones(tmp_path, monkeypatch, name, run_bytes):
    """With the writer's runs as they are and of a few samples (a run is one write: where
    they end changes no byte)."""
    if run_bytes:
        monkeypatch.setattr(writer, "RUN_BYTES", run_bytes)
    raw, make = CASES[name]
    schema = parse_schema(raw)
    parts = _parts(schema, make)
    # shards cut inside parts, by count (and by bytes for the big arrays: 14 samples a shard)
    options = {"items": None, "shard_size": 130, "shard_bytes": 1_500_000}
    info = _write(tmp_path / "out", schema, parts, options)
    members = _expected_members(schema, parts)
    per_sample = len(schema.fields)
    at = 0
    for name_, count in zip(info["layout"]["shards"], info["layout"]["shard_counts"], strict=True):
        data = (tmp_path / "out" / name_).read_bytes()
        want = _tarfile_bytes(members[at : at + count * per_sample])
        assert data[: len(want)] == want
        assert not data[len(want) :].strip(b"\0") and len(data) % (20 * 512) == 0
        assert hashlib.sha256(data).hexdigest() == info["sha256"][name_]
        at += count * per_sample
    assert at == len(members)
    assert _digest(tmp_path / "out", info) == PINNED[name]


def _sample_parts(kind: str) -> tuple[SampleSpec, list[Part]]:
    """(image, label) packs: fixed-shape arrays (KEY.npy) or encoded files whose extension
    changes within a part (KEY.jpg, KEY.png, then KEY.cls)."""
    rng = np.random.default_rng(3)
    parts = []
    for a in range(0, COUNT, PART):
        n = min(PART, COUNT - a)
        if kind == "array":
            spec = SampleSpec("array", "uint8", (3, 8, 9))
            samples = [rng.integers(0, 255, 216, dtype=np.uint8).tobytes() for _ in range(n)]
            exts = np.full(n, "npy", dtype="<U8")
        else:
            spec = SampleSpec("encoded")
            samples = [_jpeg(a + j)[: 100 + (a + j) * 3] for j in range(n)]
            exts = np.array(["jpg" if (a + j) % 11 < 7 else "png" for j in range(n)], "<U8")
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(s) for s in samples], out=offsets[1:])
        labels = np.array([INTS[(a + j) % 7] for j in range(n)], np.int64)
        parts.append(Part(np.frombuffer(b"".join(samples), np.uint8), offsets, labels,
                          np.zeros(n, np.uint32), np.arange(a, a + n), exts,
                          np.zeros(0, np.int64), np.zeros(0, str), spec))  # fmt: skip
    return spec, parts


@pytest.mark.parametrize("kind", ["array", "encoded"])
def test_image_label_shards_are_the_pinned_bytes(tmp_path, kind):
    spec, parts = _sample_parts(kind)
    out = tmp_path / "out"
    out.mkdir()
    w = TarWriter(out, spec, None, 0, {"items": None, "shard_size": 130})
    for p in parts:
        w.add(p)
    info = w.finish()
    members = []
    header = b"" if kind == "encoded" else w.header
    for p in parts:
        for j in range(len(p)):
            key = KEY_FORMAT % p.items[j]
            members += [(f"{key}.{p.exts[j]}", header + bytes(p.sample(j)))]
            members += [(f"{key}.cls", b"%d" % p.labels[j])]
    data = b"".join((out / n).read_bytes().rstrip(b"\0") for n in info["layout"]["shards"])
    assert data == b"".join(_tarfile_bytes(members[a : a + 260]).rstrip(b"\0")
                            for a in range(0, len(members), 260))  # fmt: skip
    assert _digest(out, info) == PINNED[kind]
