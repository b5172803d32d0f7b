"""index.npz of a tar pack, checked before any shard is read (docs/security.md).

index.npz is as untrusted as the shards: its offsets and sizes become reads and strided
views of the shards' maps, so a crafted index could read other memory (a strided view
running past a map) or crash the process. check_index holds it to the layout the writer
makes before anything is read or mapped.
"""

from __future__ import annotations

import numpy as np

from gpufeed.errors import DataError

__all__ = ["INDEX_ARRAYS", "check_index"]

# index.npz's arrays, one entry a sample (formats/tar/reader.py)
INDEX_ARRAYS = ("shard", "offset", "size", "labels", "crc32")


def check_index(
    where, shard: np.ndarray, offset: np.ndarray, size: np.ndarray, counts, shard_bytes
) -> None:
    """index.npz (``where``) describes the pack's shards: every sample in the shard the
    manifest's shard_counts put it in, inside that shard's ``shard_bytes`` (0 <= offset,
    offset + size <= the shard's bytes) and after the sample before it in that shard (the
    order the writer writes them in, which runs, spans and strided rows rely on). Else a
    DataError naming the first bad sample: nothing is read or mapped before this holds."""
    expected = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    ends = shard_bytes[expected]

    def refuse(bad: np.ndarray, problem: str) -> None:
        found = np.flatnonzero(bad)
        if len(found):
            i = int(found[0])
            said = problem.format(shard=expected[i], bytes=ends[i])
            raise DataError(
                f"{where}: sample {i} (shard {shard[i]}, offset {offset[i]}, size {size[i]}) "
                f"{said} ({len(found):,} sample(s) so); the index is damaged or crafted: "
                "re-pack the dataset or get it again"
            )

    refuse(shard != expected, "is in shard {shard} by the manifest's layout shard_counts")
    refuse((offset < 0) | (size < 0), "has a negative offset or size")
    refuse((offset > ends) | (size > ends - offset), "ends past its shard's {bytes:,} bytes")
    overlap = np.zeros(len(shard), dtype=bool)
    overlap[1:] = (shard[1:] == shard[:-1]) & (offset[1:] < offset[:-1] + size[:-1])
    refuse(overlap, "starts before the sample before it in its shard ends")
