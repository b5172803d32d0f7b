"""A WebDataset shard's member table, from its tar headers alone (gpufeed.formats.inplace.webdataset
indexes shards with it), and the check of a member's header when the index is used."""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path

from gpufeed.errors import DataError
from gpufeed.formats.tar.members import header_size

__all__ = ["header_mismatch", "header_name", "members", "name_end", "scan_shard"]

FILE_TYPES = (b"0", b"\0", b"7")  # tar type flags of a regular file's member


def members(path: Path):
    """(name, data offset, size) of each regular file in a tar, from its headers alone
    (tarfile's TarInfo parsing is much slower per member: docs/performance/tar-stream.md):
    ustar, GNU long names and pax path records; anything else falls back to tarfile."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos, long_name = 0, None
            while pos + 512 <= size:
                head = mm[pos : pos + 512]
                if head == bytes(512):
                    return
                if head[257:262] != b"ustar":
                    raise tarfile.ReadError(f"not a ustar header at byte {pos}")
                n = header_size(head)
                kind = head[156:157]
                data = pos + 512
                if n > size - data:
                    raise DataError(
                        f"{path}: the member at byte {pos:,} declares {n:,} bytes, past the "
                        f"end of the shard ({size:,} bytes): truncated or not a tar"
                    )
                if kind == b"L":
                    long_name = mm[data : data + n].rstrip(b"\0")
                elif kind == b"x":
                    long_name = _pax_path(mm[data : data + n]) or long_name
                elif kind in FILE_TYPES:
                    name = long_name or _ustar_name(head)
                    yield name.decode("utf-8", "surrogateescape"), data, n
                    long_name = None
                pos = data + (n + 511) // 512 * 512


def _ustar_name(head: bytes) -> bytes:
    name, prefix = head[0:100].rstrip(b"\0"), head[345:500].rstrip(b"\0")
    return prefix + b"/" + name if prefix else name


def _pax_path(records: bytes) -> bytes | None:
    for line in records.split(b"\n"):
        _, _, kv = line.partition(b" ")
        if kv.startswith(b"path="):
            return kv[5:]
    return None


def scan_shard(path: Path) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """Each sample of one shard: (key, suffix -> (data offset, size)), in member order."""
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    last_key = None
    try:
        try:
            found = list(members(path))
        except tarfile.ReadError:
            with tarfile.open(path, "r:") as tf:
                found = [(m.name, m.offset_data, m.size) for m in tf if m.isfile()]
        for name, offset, size in found:
            folder, _, base = name.rpartition("/")
            stem, dot, suffix = base.partition(".")
            if not dot or stem.startswith("_"):  # no suffix, or __key__-like metadata
                continue
            key = f"{folder}/{stem}" if folder else stem
            if key != last_key:
                samples.append((key, {}))
                last_key = key
            samples[-1][1][suffix] = (offset, size)
    except (tarfile.TarError, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable tar shard: {e}") from None
    return samples


def name_end(suffix: str) -> bytes:
    """What a member of this suffix's name ends with, as header_mismatch checks it: its last
    extension (tar writers that shorten long names keep it); b"" (nothing checked) when it
    is not ASCII (some writers drop such characters)."""
    ext = suffix.rsplit(".", 1)[-1]
    return b"." + ext.encode() if ext.isascii() else b""


def header_mismatch(head: bytes, size: int, end: bytes) -> str | None:
    """What is wrong with the tar header before a member the index placed there (None: it
    is a regular file's header of that size and, where its name field holds the whole name,
    ending with `end`, name_end's). The name's key is not compared: writers truncate long
    names. Runs for every member read: the usual header passes in a few comparisons."""
    stop = head.find(b"\0", 0, 100)
    if (
        head[257:262] == b"ustar"
        and head[156:157] in FILE_TYPES
        and _field_size(head[124:136]) == size
        and (stop < 0 or head.endswith(end, 0, stop))
    ):
        return None
    if head[257:262] != b"ustar" and not _checksum_ok(head):  # v7 tars have no magic
        return "no tar header"
    if head[156:157] not in FILE_TYPES:
        return f"a tar header of type {head[156:157]!r}, not a file"
    found = _field_size(head[124:136])
    if found is None:
        return "a tar header with a malformed size"
    if found != size:
        return f"the header of a {found:,}-byte member"
    if stop >= 0 and not head.endswith(end, 0, stop):
        return f"the header of member {header_name(head)!r}"
    return None


@functools.lru_cache(maxsize=4096)
def _field_size(field: bytes) -> int | None:
    """header_size of a size field (None: malformed); members share a few sizes' fields."""
    try:
        return header_size(bytes(124) + field)
    except ValueError:
        return None


def _checksum_ok(head: bytes) -> bool:
    try:
        want = int(head[148:156].strip(b"\0 ") or b"x", 8)
    except ValueError:
        return False
    return sum(head[:148]) + 8 * 32 + sum(head[156:]) == want


def header_name(head: bytes) -> str:
    return _ustar_name(head).decode("utf-8", "replace")
