"""Tar members, the exact bytes a shard holds: ustar headers, and a multi-field sample's
members serialised where the sample is encoded (a pack(fn) worker process), so that the one
process writing the shards only joins bytes.

A sample's members are header + data + zero padding for each field, in schema order
(gpufeed.formats.tar). Only the key in each member's name depends on where the sample lands
in the pack; the worker writes KEY0 ("000000000") there, and place_members() writes every
key of a part, and fixes each header's checksum, with numpy (one pass, no per-member Python).
The result is byte for byte what member_header() per member writes (a test compares).
"""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gpufeed.formats.record import member_bytes, member_name, split_record
from gpufeed.formats.schema import Schema

__all__ = ["BLOCK", "KEY0", "KEY_DIGITS", "Placed", "member_header", "place_members", "placeable",
           "sample_members"]  # fmt: skip

BLOCK = 512
KEY_DIGITS = 9  # the key format's width ("%09d"); larger keys take member_header's path
KEY0 = "0" * KEY_DIGITS
MAX_SIZE = 8**11  # ustar's size field: 11 octal digits


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
    return b"".join((raw.ljust(100, b"\0"), _HEADER[100:124], size_field, _HEADER[135:148],
                     checksum, _HEADER[156:]))  # fmt: skip


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
_ZEROS = bytes(BLOCK)


def placeable(schema: Schema) -> bool:
    """Whether every field's member name, with a KEY_DIGITS key, fits a plain ustar name
    (else member_header goes through tarfile, and its layout differs)."""
    return all(len(member_name(KEY0, f).encode("utf-8")) <= 100 for f in schema.fields)


def sample_members(schema: Schema, record) -> bytes | None:
    """A record's tar members (header + data + padding per field, KEY0 as key), or None where
    place_members cannot place them (a member of 8 GiB or more, a name over 100 bytes): the
    writer then builds them itself."""
    chunks = []
    for field, stored in zip(schema.fields, split_record(schema, record), strict=True):
        data = member_bytes(field, stored)
        size = len(data)
        name = member_name(KEY0, field)
        if size >= MAX_SIZE or len(name.encode("utf-8")) > 100:
            return None
        chunks += [member_header(name, size), data, _ZEROS[: (-size) % BLOCK]]
    return b"".join(chunks)


_OCTAL = 8 ** np.arange(5, -1, -1, dtype=np.int64)
_SIZE = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_DECIMAL = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)


class Placed(NamedTuple):
    """place_members' result: ``data`` the samples' members back to back; per sample, its
    ``starts`` in data, ``sizes`` (its members, padding included) and ``spans`` (from its
    first header to the end of its last field's data: what the tar index records)."""

    data: bytearray
    starts: np.ndarray
    sizes: np.ndarray
    spans: np.ndarray


def place_members(members: Sequence[bytes], fields: int, first_key: int) -> Placed:
    """Samples first_key, first_key + 1, ... (sample_members' bytes, ``fields`` members
    each): joined, each header's KEY0 replaced by the sample's key and its checksum
    corrected. Keys must stay below 10**KEY_DIGITS."""
    n = len(members)
    buf = bytearray().join(members)
    view = np.frombuffer(buf, np.uint8)
    sizes = np.fromiter(map(len, members), np.int64, n)
    starts = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    digits = (np.arange(first_key, first_key + n, dtype=np.int64)[:, None] // _DECIMAL) % 10
    digit_sum = digits.sum(1)
    digits += ord("0")
    head, spans = starts.copy(), starts
    for _ in range(fields):  # the k-th header of every sample at once
        size = (view[head[:, None] + 124 + np.arange(11)].astype(np.int64) - ord("0")) @ _SIZE
        view[head[:, None] + np.arange(KEY_DIGITS)] = digits
        # KEY0's digits counted ord("0") each in the checksum; the key's count theirs
        where = head[:, None] + 148 + np.arange(6)
        checksum = (view[where].astype(np.int64) - ord("0")) @ _OCTAL + digit_sum
        view[where] = (checksum[:, None] // _OCTAL) % 8 + ord("0")
        spans = head + BLOCK + size
        head = spans + (-size) % BLOCK
    return Placed(buf, starts, sizes, spans - starts)
