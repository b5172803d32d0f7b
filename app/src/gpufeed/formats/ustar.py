"""Tar members' ustar headers, built directly: the bytes tarfile writes for a regular file of
owner 0, mode 0644, mtime 0 (a test compares)."""

from __future__ import annotations

import tarfile

__all__ = ["field_header", "member_header", "member_header_pieces"]


def member_header(name: str, size: int) -> bytes:
    """The ustar header tarfile writes for a regular file of owner 0, mode 0644, mtime 0
    (byte for byte: a test compares), built directly: tarfile's TarInfo.tobuf cost 140 us a
    member, most of a tar pack's assembly. Names over 100 bytes and members of 8 GiB and up
    go through tarfile."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or size >= MAX_SIZE:
        ti = tarfile.TarInfo(name)
        ti.size = size
        ti.mtime = 0
        ti.mode = 0o644
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        return ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o" % size
    # the checksum sums the header's bytes: the template's, plus the name and size written
    # into it (summing all 512 bytes each time cost a third of a member's header)
    checksum = b"%06o\0 " % (_HEADER_SUM + sum(raw) + sum(size_field))
    return b"".join((raw.ljust(100, b"\0"), _HEADER[100:124], size_field, _HEADER_MID,
                     checksum, _HEADER_END))  # fmt: skip


def _header_template() -> bytes:
    head = bytearray(512)
    head[100:124] = b"0000644\0" + b"0000000\0" * 2  # mode, uid, gid
    head[136:148] = b"00000000000\0"  # mtime 0
    head[148:156] = b" " * 8  # the checksum counts its own field as spaces
    head[156:157] = b"0"  # a regular file
    head[257:265] = b"ustar\x0000"
    # devmajor and devminor stay NUL, as tarfile leaves them for regular files
    return bytes(head)


_HEADER = _header_template()
_HEADER_SUM = sum(_HEADER)
_HEADER_MID = _HEADER[135:148]
_HEADER_END = _HEADER[156:]
KEY_DIGITS = 9  # KEY_FORMAT's width
MAX_SIZE = 8**11  # ustar's size field: 11 octal digits


def field_header(suffix: str) -> tuple[bytes, int] | None:
    """What member_header's bytes for KEY + suffix (a KEY_DIGITS key) hold after the key up
    to the size field, and their sum with the template's; None where the name is too long
    for a plain ustar name (member_header then builds it through tarfile)."""
    tail = suffix.encode("utf-8", "surrogateescape")
    if KEY_DIGITS + len(tail) > 100:
        return None
    name_rest = tail.ljust(100 - KEY_DIGITS, b"\0")
    return name_rest + _HEADER[100:124], _HEADER_SUM + sum(tail)


def member_header_pieces(
    key: bytes, key_sum: int, suffix: str, field: tuple[bytes, int] | None, size: int
) -> list[bytes]:
    """member_header(key + suffix, size) as pieces to write in a row, from the key's bytes and
    their sum (once a sample) and the suffix's field_header (once a pack): no join, no
    per-member encoding of the field's part of the name."""
    if field is None or len(key) != KEY_DIGITS or size >= MAX_SIZE:
        return [member_header(key.decode() + suffix, size)]
    size_field = b"%011o" % size
    checksum = b"%06o\0 " % (field[1] + key_sum + sum(size_field))
    return [key, field[0], size_field, _HEADER_MID, checksum, _HEADER_END]
