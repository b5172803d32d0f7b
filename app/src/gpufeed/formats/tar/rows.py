"""Fixed-shape samples of a local tar pack read as rows, the way the mmap reader reads them.

gpufeed's writer lays out every fixed-shape sample the same way (the .npy member's header,
its payload padded to 512 bytes, the .cls member), so within a shard the samples' data sit
at one stride: the shard's map, seen as a read-only strided ``[count, nbytes]`` array, gives
a batch in any order with one fancy index per shard, from pages already mapped (no system
call a sample, no copy into a buffer first). The strides are read off index.npz: each
shard's offsets must form an arithmetic progression and every size be the sample's nbytes.
A pack where they do not (another writer's layout, samples of different sizes) is read as
before, sample by sample; so is a remote pack (its shards' maps close when they are
unpinned).

A local pack's shard maps are kept across readers in one process (pagecache/maps.py), all of
a pack's shards as one kept entry, so a warm pass finds their pages mapped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpufeed.errors import DataError
from gpufeed.pagecache.copy import PARALLEL_COPY_MIN_BYTES, copy_buffers

__all__ = ["gather_rows", "shard_rows", "shard_strides"]


def shard_strides(
    shard: np.ndarray,
    offset: np.ndarray,
    size: np.ndarray,
    shard_start: np.ndarray,
    width: int,
) -> np.ndarray | None:
    """Each shard's stride in bytes between consecutive samples' data, or None when some
    sample is not ``width`` bytes, the index does not list the shards' samples in order, or
    some shard's samples are not at one stride (at least ``width``)."""
    counts = np.diff(shard_start)
    if len(offset) == 0 or np.any(size != width):
        return None
    if not np.array_equal(shard, np.repeat(np.arange(len(counts)), counts)):
        return None
    steps = np.diff(offset)
    strides = np.full(len(counts), width, dtype=np.int64)
    two = counts >= 2
    strides[two] = steps[shard_start[:-1][two]]
    if np.any(strides < width):
        return None
    inner = shard[1:] == shard[:-1]
    if not np.array_equal(steps[inner], strides[shard[1:][inner]]):
        return None
    return strides


def shard_rows(data: np.ndarray, first: int, count: int, stride: int, width: int, where=""):
    """A shard's ``count`` samples as a read-only ``[count, width]`` view of its map
    ``data``, the first at byte ``first``; None when the map ends before the last row (a
    truncated shard: the per-sample read names the sample). Numbers that would put a row
    before the map (index.npz is checked at open: this is the last line) are a DataError
    naming ``where``, never a view of other memory."""
    if min(first, stride, width) < 0:
        raise DataError(
            f"{where}: rows at byte {first} + k * {stride} of {width} bytes leave the shard's "
            "map; its index is damaged or crafted: re-pack the dataset or get it again"
        )
    if count < 1 or first + (count - 1) * stride + width > len(data):
        return None
    return np.lib.stride_tricks.as_strided(
        data[first:], shape=(count, width), strides=(stride, 1), writeable=False
    )


def gather_rows(
    rows_of: Callable[[int], np.ndarray | None],
    shards: np.ndarray,
    rows: np.ndarray,
    width: int,
) -> np.ndarray | None:
    """``out[j] = rows_of(shards[j])[rows[j]]`` as a new ``[len(rows), width]`` uint8 array,
    each row copied once: a batch of one shard by one fancy index, one across shards by one
    join of its rows in order (a fancy index a shard, then placing each part in the batch,
    copied every row twice); None when a shard has no rows view."""
    if len(rows) == 0:
        return np.empty((0, width), dtype=np.uint8)
    if int(shards.min()) == int(shards.max()) and width < PARALLEL_COPY_MIN_BYTES:
        view = rows_of(int(shards[0]))
        return None if view is None else view[rows]
    views = {s: rows_of(s) for s in np.unique(shards).tolist()}
    if any(v is None for v in views.values()):
        return None
    batch = [views[s][r] for s, r in zip(shards.tolist(), rows.tolist(), strict=True)]
    if width >= PARALLEL_COPY_MIN_BYTES:  # large rows: a copy per row, on threads
        return copy_buffers(batch, np.empty((len(rows), width), dtype=np.uint8))
    return np.frombuffer(bytearray().join(batch), dtype=np.uint8).reshape(len(rows), width)
