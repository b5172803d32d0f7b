"""The per-sample checksum: zlib's crc32 values, computed by ISA-L where it is installed."""

import os
import zlib

import numpy as np
import pytest

from gpufeed.formats import checksums


@pytest.mark.parametrize("size", [0, 1, 7, 64, 1023, 1024, 4097, 65_537, 1 << 20])
def test_crc32_is_zlibs_for_every_size(size):
    data = os.urandom(size)
    want = zlib.crc32(data)
    assert checksums.crc32(data) == want
    assert checksums.crc32(memoryview(data)) == want
    assert checksums.crc32(np.frombuffer(data, np.uint8)) == want


def test_row_crcs_are_each_rows_zlib_crc32():
    rows = np.random.default_rng(0).integers(0, 255, (37, 3, 11), dtype=np.uint8)
    got = checksums.row_crcs(rows)
    assert got.dtype == np.uint32
    assert got.tolist() == [zlib.crc32(r.tobytes()) for r in rows]
    assert checksums.row_crcs(np.zeros((0, 5), np.uint8)).tolist() == []
    assert checksums.row_crcs(np.zeros((2, 0), np.uint8)).tolist() == [0, 0]


def test_the_fast_crc32_is_used_where_isal_is_installed():
    isal_zlib = pytest.importorskip("isal.isal_zlib")  # in requirements-dev and the images
    assert checksums.raw_crc32 is isal_zlib.crc32


@pytest.mark.parametrize("size", [0, 1, checksums.HASH_CHUNK - 1, checksums.HASH_CHUNK * 2 + 5])
def test_a_files_sha256_is_hashlibs_of_its_bytes_in_every_read_size(tmp_path, size):
    import hashlib

    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert checksums.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert checksums.sha256_fd(fd, size // 2) == hashlib.sha256(data[: size // 2]).hexdigest()
        if size:
            with pytest.raises(OSError, match="ends at byte"):
                checksums.sha256_fd(fd, size + 1)
    finally:
        os.close(fd)
