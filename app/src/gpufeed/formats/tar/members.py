"""Tar members' ustar headers, built directly: the bytes tarfile writes for a regular file of
owner 0, mode 0644, mtime 0 (a test compares)."""

from __future__ import annotations

import tarfile
from typing import NamedTuple

import numpy as np

__all__ = [
    "BLOCK",
    "DEC4",
    "HeaderFields",
    "field_header",
    "header_size",
    "member_header",
    "member_headers",
]

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
# the ASCII digits of 0..9999 (4 decimal digits) and 0..4095 (4 octal), each as the
# little-endian uint32 of those 4 bytes, and their byte sums (HeaderFields.numbers looks
# digits up 4 at a time)
_DEC4_TEXT = b"".join(b"%04d" % i for i in range(10**4))
_OCT4_TEXT = b"".join(b"%04o" % i for i in range(8**4))
DEC4, _OCT4 = np.frombuffer(_DEC4_TEXT, "<u4"), np.frombuffer(_OCT4_TEXT, "<u4")
_DEC4_SUM = np.frombuffer(_DEC4_TEXT, np.uint8).reshape(-1, 4).sum(axis=1, dtype=np.int64)
_OCT4_SUM = np.frombuffer(_OCT4_TEXT, np.uint8).reshape(-1, 4).sum(axis=1, dtype=np.int64)
_KEY_GROUPS = -(-KEY_DIGITS // 4)


def field_header(suffix: str) -> tuple[bytes, int] | None:
    """What member_header's bytes for KEY + suffix (a KEY_DIGITS key) hold after the key up
    to the size field, and their sum with the template's; None where the name is too long
    for a plain ustar name (member_header then builds it through tarfile)."""
    tail = suffix.encode("utf-8", "surrogateescape")
    if KEY_DIGITS + len(tail) > 100:
        return None
    name_rest = tail.ljust(100 - KEY_DIGITS, b"\0")
    return name_rest + _HEADER[100:124], _HEADER_SUM + sum(tail)


class HeaderFields(NamedTuple):
    """The ustar headers of members KEY + suffix, one suffix a field, split into what every
    sample shares (``templates``: uint8 [F, BLOCK], key and size digits zero, the checksum
    field's last two bytes set) and what ``numbers`` computes for a run of samples."""

    templates: np.ndarray  # uint8 [F, BLOCK]
    sums: np.ndarray  # int64 [F]: each template's byte sum, its checksum field as spaces

    @classmethod
    def of(cls, suffixes: list[str]) -> HeaderFields | None:
        """None where a name is too long for a plain ustar name (member_header then builds
        it through tarfile)."""
        heads = [field_header(s) for s in suffixes]
        if None in heads:
            return None
        joined = b"".join(_template(h[0]) for h in heads)
        templates = np.frombuffer(joined, np.uint8).reshape(len(heads), BLOCK).copy()
        templates[:, 154:156] = (0, 32)  # the checksum's "%06o\0 " ends so
        return cls(templates, np.array([h[1] for h in heads], np.int64))

    def numbers(self, first_key: int, sizes: np.ndarray):
        """For keys first_key, first_key + 1, ... and member sizes int64 [n, F]: (the keys'
        digits uint8 [n, KEY_DIGITS], the sizes' octal digits [n, F, 11], the checksums'
        [n, F, 6]); None where a key has more than KEY_DIGITS digits or a size more than 11
        octal ones (member_header's other cases). Digits are looked up four at a time
        (DEC4, _OCT4): a digit at a time was most of a run's headers."""
        n = len(sizes)
        if first_key + n > 10**KEY_DIGITS or (n and int(sizes.max()) >= MAX_SIZE):
            return None
        keys = first_key + np.arange(n, dtype=np.int64)
        groups = [(keys // 10 ** (4 * g)) % 10**4 for g in range(_KEY_GROUPS - 1, -1, -1)]
        key_digits = _digits(DEC4, groups)[:, -KEY_DIGITS:]
        key_sum = sum(_DEC4_SUM[g] for g in groups) - 48 * (4 * _KEY_GROUPS - KEY_DIGITS)
        # 11 octal digits: 12 (three groups of 4), the first always 0
        groups = [(sizes >> (12 * g)) & 0o7777 for g in (2, 1, 0)]
        size_digits = _digits(_OCT4, groups)[..., 1:]
        size_sum = sum(_OCT4_SUM[g] for g in groups) - 48
        checksum = self.sums + key_sum[:, None] + size_sum  # under 8**6: 8 digits, 6 kept
        checks = _digits(_OCT4, [checksum >> 12, checksum & 0o7777])[..., 2:]
        return key_digits, size_digits, checks


def _digits(table: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """uint8 [..., 4 * len(groups)]: the ASCII digits of each group (a number under
    len(table)), looked up four at a time as one uint32."""
    out = np.empty((*groups[0].shape, len(groups)), "<u4")
    for g, values in enumerate(groups):
        out[..., g] = table[values]
    return out.view(np.uint8)


def member_headers(first_key: int, suffixes: list[str], sizes: np.ndarray) -> np.ndarray:
    """uint8 [n, F, BLOCK]: member_header(KEY + suffixes[k], sizes[j, k]) for the keys
    first_key, first_key + 1, ... (KEY_DIGITS digits each), computed for all at once: the
    fields' templates, the key's and the size's digits written in, the checksums summed."""
    fields = HeaderFields.of(suffixes)
    numbers = fields.numbers(first_key, sizes) if fields is not None else None
    if numbers is None:  # rare: long names, huge members: one at a time
        return _headers_one_by_one(first_key, suffixes, sizes)
    keys, size_digits, checks = numbers
    out = np.empty((*sizes.shape, BLOCK), np.uint8)
    out[:] = fields.templates
    out[:, :, :KEY_DIGITS] = keys[:, None, :]
    out[:, :, 124:135] = size_digits
    out[:, :, 148:154] = checks
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
