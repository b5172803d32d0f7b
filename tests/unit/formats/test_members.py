"""formats/tar/members.py: header_size, the one parser of a tar header's size field."""

from __future__ import annotations

import tarfile

import pytest

from gpufeed.formats.tar.members import header_size, member_header


def _with_size_field(field: bytes) -> bytes:
    head = bytearray(member_header("a", 0))
    head[124:136] = field
    return bytes(head)


def test_octal_and_gnu_base_256_sizes():
    assert header_size(member_header("000000001.x.npy", 12345)) == 12345
    big = tarfile.TarInfo("big")
    big.size = 9 << 30  # past ustar's 11 octal digits: GNU base-256
    assert header_size(big.tobuf(tarfile.GNU_FORMAT)) == 9 << 30
    assert header_size(_with_size_field(b"          7 ")) == 7  # space-padded
    assert header_size(_with_size_field(bytes(12))) == 0


@pytest.mark.parametrize(
    "field",
    [
        b"-0000000017\0",
        b"+0000000017\0",
        b"00_00000017\0",
        b"0000000009\0\0",
        b"\xff" * 12,
        b"\x81" + bytes(11),
        b"12 34\0\0\0\0\0\0\0",
    ],  # fmt: skip
)
def test_anything_else_is_a_value_error(field):
    # int(text, 8) took signs and underscores: a negative size ran a member backwards
    with pytest.raises(ValueError, match="is not a size"):
        header_size(_with_size_field(field))
    with pytest.raises(ValueError, match="no size field"):
        header_size(b"short")
