"""formats/record.py (and formats/zstd.py): a compressed field never decompresses past the
bytes it may hold (a fixed-shape field's own size, else the per-field cap), whatever its
frame declares or holds; tar members' sizes are read by ustar.header_size."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import zstandard

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.formats import zstd
from gpufeed.formats.record import decode_value, plain_bytes, record_from_members
from gpufeed.formats.schema import Field, Schema
from gpufeed.formats.tar.members import member_header

GIB = 1 << 30


def zeros_frame(n: int, declare: bool = True) -> bytes:
    """A zstd frame of ``n`` zero bytes (a few KiB on disk), its header declaring ``n`` or
    no size, made a MiB at a time (never n bytes in memory)."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    o = c.compressobj(size=n if declare else -1)
    chunk = bytes(min(n, 1 << 20))
    return b"".join(o.compress(chunk) for _ in range(n // len(chunk))) + o.flush()


ARRAY = Field("a", "array", dtype="<f4", shape=(4, 4), compression="zstd")
BYTES = Field("b", "bytes", compression="zstd")


def test_compressed_fields_read_back():
    assert decode_value(BYTES, zstd.compress(b"hello")) == b"hello"
    assert decode_value(BYTES, zstd.compress(b"")) == b""
    assert decode_value(BYTES, zeros_frame(1 << 20, declare=False)) == bytes(1 << 20)
    values = np.arange(16, dtype="<f4").reshape(4, 4)
    assert np.array_equal(decode_value(ARRAY, zstd.compress(values.tobytes())), values)


def test_a_fixed_shape_field_never_decompresses_past_its_size():
    with pytest.raises(
        ValueError, match="field 'a': zstd frame declares 65 bytes, more than the 64"
    ):
        decode_value(ARRAY, zstd.compress(bytes(65)))
    with pytest.raises(ValueError, match="zstd frame holds more than the 64 bytes"):
        plain_bytes(ARRAY, zeros_frame(1 << 20, declare=False))


def test_other_fields_stop_at_the_cap(monkeypatch):
    assert zstd.max_decompressed_bytes() == zstd.MAX_DECOMPRESSED_BYTES
    with pytest.raises(ValueError, match="declares 1,073,741,824 bytes, more than the 268,435,456"):
        plain_bytes(BYTES, zeros_frame(GIB))
    monkeypatch.setenv(zstd.MAX_DECOMPRESSED_ENV, "1000")
    assert plain_bytes(BYTES, zeros_frame(1000, declare=False)) == bytes(1000)
    with pytest.raises(ValueError, match="holds more than the 1,000 .*GPUFEED_MAX_DECOMPRESSED"):
        plain_bytes(BYTES, zeros_frame(1001, declare=False))
    monkeypatch.setenv(zstd.MAX_DECOMPRESSED_ENV, "lots")
    with pytest.raises(UsageError, match="GPUFEED_MAX_DECOMPRESSED_BYTES='lots'"):
        plain_bytes(BYTES, zstd.compress(b"x"))


def test_a_frame_that_is_not_zstd_is_a_value_error():
    with pytest.raises(ValueError, match="field 'b': zstd frame does not decompress"):
        decode_value(BYTES, b"not a zstd frame")


# --------------------------------------------------------------------- a bomb in a pack
def _pack_with(tmp_path, fmt: str, frame: bytes):
    """A pack whose field z holds ``frame`` in sample 1, as a crafted pack would: written as
    plain bytes, then the manifest says z is zstd-compressed (the record is the same)."""
    dest = tmp_path / f"bomb.{fmt}"
    with gpufeed.Writer(dest, format=fmt, schema={"z": "bytes", "a": "uint8[2]"}) as w:
        for i in range(3):
            z = frame if i == 1 else zstd.compress(b"z%d" % i)
            w.write({"z": z, "a": np.full(2, i, np.uint8)})
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["sample"]["fields"][0]["compression"] = "zstd"
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


_READ_UNDER_LIMIT = """
import resource, sys, gpufeed
from gpufeed.errors import CorruptSampleError
ds = gpufeed.open_dataset(sys.argv[1], map_style=True)
assert ds[0]["z"] == b"z0"
vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize")][0]
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
try:
    ds[1]
except CorruptSampleError as e:
    print("CorruptSampleError", e, flush=True)
    sys.exit(3)
print("READ", flush=True)
"""


@pytest.fixture(scope="module")
def gib_frame() -> bytes:
    return zeros_frame(GIB)  # 32 KiB declaring 1 GiB


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["tar", "hdf5", "lmdb", "mmap"])
def test_a_zstd_bomb_in_a_pack_is_an_error_within_a_memory_limit(
    tmp_path, python_env, gib_frame, fmt
):
    # a 32 KiB frame declaring 1 GiB: reading the sample took ~3.5 GB (a MemoryError or
    # the OOM killer under a limit), in every format (they share record.py's decode)
    dest = _pack_with(tmp_path, fmt, gib_frame)
    r = subprocess.run(
        [sys.executable, "-c", _READ_UNDER_LIMIT, str(dest)],
        env=python_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-3000:])
    assert f"CorruptSampleError {dest}" in r.stdout and "sample 1" in r.stdout
    assert "field 'z'" in r.stdout and "declares 1,073,741,824 bytes" in r.stdout


# ------------------------------------------------------------------------- tar members
def test_member_sizes_are_parsed_by_ustar_and_bad_ones_refused():
    schema = Schema.from_json([{"name": "b", "type": "bytes"}])
    head = bytearray(member_header("000000001.b.bin", 5))
    assert record_from_members(schema, bytes(head) + b"hello".ljust(512, b"\0"))[-5:] == b"hello"
    head[124:136] = b"-0000000005\0"  # int(text, 8) read -5: the member ran backwards
    with pytest.raises(ValueError, match="size field .* is not a size"):
        record_from_members(schema, bytes(head) + bytes(512))
