"""Parts of a streamed tar pack: written once, into the shard.

A fresh tar pack's samples go into its shards as each part is committed
(gpufeed.write.assemble.Stream), so the part file keeps only the index: each sample's record
size, label, crc32, input, and its place in the shards (Part.where), not its bytes. Neither
the part nor the shard is fsynced until the pack is finished: after a crash, a resume moves
the streamed shards aside (DEST.partial/streamed/), reads every kept part's records back
from them and checks each against its crc32; the first part that does not check (torn by a
power loss, or its shard bytes lost) is redone, with every part after it. The resumed pack is
assembled from the parts as before (gpufeed.write.assemble), and streamed/ is deleted with
DEST.partial when it is finished.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from gpufeed.formats.parts import Part
from gpufeed.formats.record import record_from_members
from gpufeed.write.guard import OUT_DIR, STREAMED_DIR

__all__ = ["check_part", "keep_streamed", "load_part"]

SHARD_FORMAT = "shard-{:06d}.tar"  # gpufeed.formats.tar's shard names


def keep_streamed(partial: Path) -> None:
    """On resume: the shards the first run streamed, kept aside for its parts (a later
    resume keeps the same ones: only a fresh pack streams)."""
    out, kept = partial / OUT_DIR, partial / STREAMED_DIR
    if out.exists() and not kept.exists():
        os.rename(out, kept)


def load_part(path: Path, partial: Path) -> Part:
    """The part at ``path``, its payload read back from the streamed shards if it was saved
    without it (ValueError or OSError when they do not hold it)."""
    part = Part.load(path)
    if part.where is None or not len(part):
        return part
    schema = part.spec.schema
    fds: dict[int, int] = {}
    records = []
    try:
        for shard, offset, size in part.where.tolist():
            if shard not in fds:
                fds[shard] = os.open(
                    partial / STREAMED_DIR / SHARD_FORMAT.format(shard), os.O_RDONLY
                )
            span = os.pread(fds[shard], size, offset)
            if len(span) != size:
                raise ValueError(f"{path}: its samples are cut short in shard {shard}")
            records.append(record_from_members(schema, span))
    finally:
        for fd in fds.values():
            os.close(fd)
    if not np.array_equal(np.diff(part.offsets), [len(r) for r in records]):
        raise ValueError(f"{path}: the shards' records are not the sizes the part recorded")
    part.payload = np.frombuffer(b"".join(records), dtype=np.uint8)
    return part


def check_part(path: Path, partial: Path) -> Part | None:
    """The part at ``path`` read whole (its payload from the streamed shards if need be) and
    checked, or None when it is torn: unreadable (a zip member's CRC-32 included), its index
    arrays of the wrong lengths, or a sample whose crc32 is not the one recorded. What a
    resume trusts of a part that was not fsynced."""
    try:
        part = load_part(path, partial)
    except Exception:  # noqa: BLE001 - any failure to read it back: the part is torn
        return None
    n = len(part.labels)
    lengths = (len(part.offsets) - 1, len(part.crc32), len(part.items), len(part.exts))
    if any(k != n for k in lengths) or (n and int(part.offsets[-1]) != len(part.payload)):
        return None
    if n and (int(part.offsets[0]) != 0 or bool((np.diff(part.offsets) < 0).any())):
        return None
    view = memoryview(part.payload)
    bounds = part.offsets.tolist()
    for j, want in enumerate(part.crc32.tolist()):
        if zlib.crc32(view[bounds[j] : bounds[j + 1]]) != want:
            return None
    return part
