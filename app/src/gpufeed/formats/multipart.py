"""A pack made of parts: the reader of a merged hdf5, lmdb or mmap pack (gpufeed.write.merge).

Those formats keep a pack's samples in one file (data.h5, data.mdb, samples.npy or
encoded.npy), which cannot be joined with another without copying every sample. A merged
pack of them keeps each part as the pack it was, in a folder of its own inside the merged
one (hard links of the part's files: no sample is copied), and its manifest lists them:

    manifest.json   format (the parts'), count (their sum), sample, classes as the parts';
                    layout {"parts": [{"path": "parts/000000", "count": N0}, ...]}; files:
                    every part's files under their path in the pack ("parts/000000/data.h5")
    parts/000000/   part 0, a complete pack (its own manifest.json)
    parts/000001/   ...

Sample i of the merged pack is sample i - starts[k] of part k, starts the running sum of
the parts' counts: one reader a part (each the format's own, opened lazily and fork-safe
as always), global indices mapped to (part, local index) here, so samplers, rank splits,
block shuffles and resume see one pack of ``count`` samples. Tar packs are merged into an
ordinary tar pack instead (their shards are files of their own: gpufeed.write.merge).
Everything read is untrusted: part paths must stay inside the pack (pack_file's rule),
each part's manifest must agree with the merged one (format, sample, classes, count).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import DataError, UnsafePathError
from gpufeed.formats import PARTS_LAYOUT, is_multipart, reader_class
from gpufeed.formats.base import Reader
from gpufeed.formats.manifest import MANIFEST_NAME, read_manifest, unsafe_name

__all__ = ["MultiPartReader", "part_entries"]


def part_entries(root: Path, manifest: dict[str, Any]) -> list[tuple[str, int]]:
    """The manifest's parts as (path inside the pack, count), checked: a list of objects
    with a plain relative path that stays inside the pack and a non-negative count."""
    where = root / MANIFEST_NAME
    entries = manifest["layout"][PARTS_LAYOUT]
    if not isinstance(entries, list):
        raise DataError(f"{where}: layout.parts is not a list of parts; re-merge the pack")
    out = []
    for k, entry in enumerate(entries):
        path = entry.get("path") if isinstance(entry, dict) else None
        count = entry.get("count") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not isinstance(count, int) or isinstance(count, bool):
            raise DataError(
                f"{where}: layout.parts[{k}] is {str(entry)[:80]}, expected "
                '{"path": "parts/NNNNNN", "count": N}; re-merge the pack'
            )
        if count < 0:
            raise DataError(f"{where}: layout.parts[{k}] has a negative count; re-merge the pack")
        _check_inside(root, path)
        out.append((path, count))
    return out


def _check_inside(root: Path, name: str) -> None:
    """A part folder named by the manifest stays inside the pack (by name, and where links
    on the way lead): the rule pack_file applies to files."""
    unsafe = unsafe_name(name)
    if unsafe:
        raise UnsafePathError(root / name, f"{unsafe}; it is not read")
    real, top = os.path.realpath(root / name), os.path.realpath(root)
    if os.path.commonpath([real, top]) != top:
        raise UnsafePathError(root / name, f"leads outside the pack (to {real}); it is not read")


class MultiPartReader(Reader):
    """Reads a merged pack through one reader per part (see the module docstring); options
    are the part format's reader options (HDF5's use_mmap, LMDB's readahead, ...)."""

    def __init__(self, root, manifest, **options):
        super().__init__(root, manifest)
        self.format_name = manifest["format"]
        cls = reader_class(self.format_name)
        self.parts: list[Reader] = []
        for k, (path, count) in enumerate(part_entries(self.root, manifest)):
            self.parts.append(self._open_part(cls, k, path, count, options))
        counts = np.array([p.count for p in self.parts], dtype=np.int64)
        self.check_count("the parts (layout.parts)", int(counts.sum()))
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.labels = self._joined("labels", np.int64)
        self.crc32 = self._joined("crc32", np.uint32)

    def _open_part(self, cls, k: int, path: str, count: int, options: dict) -> Reader:
        """Part k's reader, its manifest checked against the merged one first."""
        part_manifest = read_manifest(self.root / path)
        self._check_part(k, path, part_manifest, count)
        return cls(self.root / path, part_manifest, **options)

    def _check_part(self, k: int, path: str, part: dict[str, Any], count: int) -> None:
        """A part must be what the merged manifest says: same format, sample and classes,
        the recorded count, and not itself made of parts."""
        where = self.root / path / MANIFEST_NAME
        mine = self.manifest
        for key in ("format", "sample", "classes"):
            if part.get(key) != mine.get(key):
                raise DataError(
                    f"{where}: part {k}'s {key} is {str(part.get(key))[:80]}, the merged "
                    f"pack's is {str(mine.get(key))[:80]}; the pack is inconsistent (re-merge it)"
                )
        if part["count"] != count or is_multipart(part):
            raise DataError(
                f"{where}: part {k} holds {part['count']:,} samples (or parts of its own), "
                f"the merged manifest says {count:,}; the pack is inconsistent (re-merge it)"
            )

    def _joined(self, name: str, dtype) -> np.ndarray:
        arrays = [np.asarray(getattr(p, name), dtype=dtype) for p in self.parts]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)

    # -- from global indices to parts --------------------------------------------------------
    def _split(self, indices: np.ndarray):
        """(part, positions in `indices`, local indices) for each part `indices` touch."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        if len(which) and which[0] == which[-1] and (which == which[0]).all():
            k = int(which[0])
            return [(k, None, indices - self.starts[k])]
        out = []
        for k in np.unique(which).tolist():
            at = np.flatnonzero(which == k)
            out.append((k, at, indices[at] - self.starts[k]))
        return out

    def read_batch(self, indices: np.ndarray):
        pieces = self._split(indices)
        if len(pieces) == 1 and pieces[0][1] is None:  # one part: its own batch as it is
            k, _, local = pieces[0]
            return self.parts[k].read_batch(local)
        out = None
        for k, at, local in pieces:
            got = self.parts[k].read_batch(local)
            if out is None:
                out = (
                    np.empty((len(indices), *got.shape[1:]), dtype=got.dtype)
                    if isinstance(got, np.ndarray)
                    else [None] * len(indices)
                )
            if isinstance(out, np.ndarray):
                out[at] = got
            else:
                for j, i in enumerate(at.tolist()):
                    out[i] = got[j]
        return out

    def location(self, index: int) -> str:
        k = int(np.searchsorted(self.starts, index, side="right") - 1)
        return self.parts[k].location(int(index - self.starts[k]))

    def read_ahead(self, indices: np.ndarray) -> None:
        for k, _, local in self._split(indices):
            self.parts[k].read_ahead(local)

    def read_ahead_ranges(self, ranges) -> None:
        per_part: dict[int, list[tuple[int, int]]] = {}
        for a, b in ranges:
            for k in range(len(self.parts)):
                lo, hi = max(a, self.starts[k]), min(b, self.starts[k + 1])
                if lo < hi:
                    per_part.setdefault(k, []).append(
                        (int(lo - self.starts[k]), int(hi - self.starts[k]))
                    )
        for k, local in per_part.items():
            self.parts[k].read_ahead_ranges(local)

    @property
    def reads_ranges_ahead(self) -> bool:
        return bool(self.parts) and bool(self.parts[0].reads_ranges_ahead)

    @property
    def reads_ranges_ahead_in_order(self) -> bool:
        return bool(self.parts) and bool(self.parts[0].reads_ranges_ahead_in_order)

    def looks_warm(self) -> bool:
        return bool(self.parts) and all(p.looks_warm() for p in self.parts)

    def sources(self) -> list[str] | None:
        names = [p.sources() for p in self.parts]
        if any(n is None for n in names):
            return None
        return [name for part in names for name in part]

    def close(self) -> None:
        for part in self.parts:
            part.close()
        super().close()
