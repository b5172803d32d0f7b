"""Tar members' ustar headers, built directly: the bytes tarfile writes for a regular file of
owner 0, mode 0644, mtime 0 (a test compares)."""

from __future__ import annotations

import tarfile

import numpy as np

__all__ = ["BLOCK", "field_header", "header_size", "member_header", "member_headers"]

BLOCK = 512


def member_header(name: str, size: int) -> bytes:
    """The ustar header tarfile writes for a regular file of owner 0, mode 0644, mtime 0
    (byte for byte: a test compares), built directly: tarfile's TarInfo.tobuf was most of a
    tar pack's assembly (docs/performance/conversion.md). Names over 100 bytes and members of
    8 GiB and up go through tarfile."""
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


def header_size(head: bytes) -> int:
    """The member size a tar header declares (the one parser of it): octal digits, NUL- or
    space-padded, as ustar writes them, or GNU base-256 (first byte 0x80: members of 8 GiB
    and up). ValueError for anything else (a negative base-256 size, signs, other digits),
    which int(text, 8) alone would accept or turn into another number."""
    field = bytes(head[124:136])
    if len(field) != 12:
        raise ValueError(f"a tar header of {len(head)} bytes has no size field")
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    digits = field.strip(b"\0 ")
    if field[0] & 0x80 or digits.strip(b"01234567"):
        raise ValueError(f"tar header size field {field!r} is not a size")
    return int(digits or b"0", 8)


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
KEY_DIGITS = 9  # a member's key: the sample index, zero-padded to this width
KEY_FORMAT = f"%0{KEY_DIGITS}d"  # the same, as the manifest's layout.key_format says it
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


def member_headers(first_key: int, suffixes: list[str], sizes: np.ndarray) -> np.ndarray:
    """uint8 [n, F, BLOCK]: member_header(KEY + suffixes[k], sizes[j, k]) for the keys
    first_key, first_key + 1, ... (KEY_DIGITS digits each), computed for all at once: the
    fields' templates, the key's and the size's digits written in, the checksums summed."""
    n, nf = sizes.shape
    heads = [field_header(s) for s in suffixes]
    fits = n == 0 or (first_key + n <= 10**KEY_DIGITS and int(sizes.max()) < MAX_SIZE)
    if not fits or None in heads:  # rare: long names, huge members: one at a time
        return _headers_one_by_one(first_key, suffixes, sizes)
    out = np.empty((n, nf, BLOCK), np.uint8)
    out[:] = np.frombuffer(b"".join(_template(h[0]) for h in heads), np.uint8).reshape(nf, -1)
    keys = first_key + np.arange(n, dtype=np.int64)
    key_digits = (keys[:, None] // 10 ** np.arange(KEY_DIGITS - 1, -1, -1)) % 10 + 48
    out[:, :, :KEY_DIGITS] = key_digits[:, None, :]
    size_digits = (sizes[..., None] >> (3 * np.arange(10, -1, -1))) & 7
    out[:, :, 124:135] = size_digits + 48
    sums = np.array([h[1] for h in heads], np.int64)
    checksum = sums + key_digits.sum(axis=1)[:, None] + (size_digits + 48).sum(axis=-1)
    out[:, :, 148:154] = ((checksum[..., None] >> (3 * np.arange(5, -1, -1))) & 7) + 48
    out[:, :, 154:156] = (0, 32)  # "%06o\0 "
    return out


def _template(field_part: bytes) -> bytes:
    """A member header with the key's and the size's digits left zero, checksum spaces."""
    return bytes(KEY_DIGITS) + field_part + bytes(11) + _HEADER_MID + b" " * 8 + _HEADER_END


def _headers_one_by_one(first_key: int, suffixes: list[str], sizes: np.ndarray) -> np.ndarray:
    out = np.empty((*sizes.shape, BLOCK), np.uint8)
    for j, row in enumerate(sizes.tolist()):
        key = f"{first_key + j:0{KEY_DIGITS}d}"
        for k, (suffix, size) in enumerate(zip(suffixes, row, strict=True)):
            out[j, k] = np.frombuffer(member_header(key + suffix, size), np.uint8)
    return out
