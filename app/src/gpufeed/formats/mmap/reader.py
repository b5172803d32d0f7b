"""The mmap format's reader (the layout: gpufeed.formats.mmap)."""

from __future__ import annotations

from pathlib import Path
from tokenize import TokenError

import numpy as np

from gpufeed.errors import DataError
from gpufeed.formats.base import (
    REPACK,
    Reader,
    check_offsets,
    index_array,
)
from gpufeed.formats.checksums import crc32, row_crcs
from gpufeed.formats.mapped import MappedSamples
from gpufeed.formats.mmap import CONTAINERS, data_name, pt
from gpufeed.formats.npy import NPY_HEADER_MAX, npy_header, read_npy_vector
from gpufeed.pagecache.advise import BlocksAhead
from gpufeed.pagecache.maps import kept_map


class MmapReader(MappedSamples, Reader):
    format_name = "mmap"

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.container = manifest.get("layout", {}).get("container", "npy")
        if self.container not in CONTAINERS:
            raise DataError(f"{self.root}: unknown mmap container {self.container!r}")
        index = ["labels.npy", "crc32.npy"] + (["offsets.npy"] if self.spec.kind != "array" else [])
        # a remote pack's samples are read while they download (until they land), see _early
        self._landing = self._header = None
        self.ahead = BlocksAhead()  # blocks of the order populated ahead (read_ahead_ranges)
        if self.source is not None:  # a remote pack's files, fetched side by side, largest first
            self.source.warm([self.data_name, *index])
            if self.container == "npy":
                self._landing = self.source.landing(self.data_name)
        self.labels = self._load("labels.npy", self.count)
        self.crc32 = self._load("crc32.npy", self.count, np.uint32)
        kind = self.spec.kind
        self.offsets = self._load("offsets.npy", self.count + 1) if kind != "array" else None
        self._landed = self._landing is None or not self._read_header()
        if self._landed:
            self._land()

    def _land(self) -> None:
        """The data file whole (fetched and pinned, for a remote pack), its header checked
        against the manifest and the file's size (the map is kept for _open)."""
        self.file(self.data_name, whole=True)
        self._check_rows(self._rows())
        self._landing, self._landed = None, True

    def _rows(self) -> np.ndarray:
        """The data file's map as a plain ndarray (np.memmap's slicing costs more than the
        copy itself), kept for the next reader of this file in this process (pagecache/maps.py). A
        file shorter than its header declares is an error here, never a map past its end."""
        path, identity = self.data_path, self.pinned_identity(self.data_name)
        if self.container == "pt":
            return kept_map(path, identity, "pt", lambda: pt.map_pt(path))

        def mapped():
            try:
                return np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
            except (OSError, ValueError, EOFError, SyntaxError, TypeError, TokenError) as e:
                raise DataError(  # numpy's header parser raises several kinds
                    f"{path}: not a readable .npy file, or shorter than its "
                    f"header says: {e}; {REPACK}"
                ) from None

        return kept_map(path, identity, "npy", mapped)

    def _check_rows(self, rows: np.ndarray) -> None:
        """The data file's array is what the manifest says: the samples' dtype and shape
        (C order), or the encoded bytes the offsets index."""
        if self.offsets is not None:
            want_dtype, want_shape = np.dtype(np.uint8), (int(self.offsets[-1]),)
            if rows.ndim == 1:
                check_offsets(self.root / "offsets.npy", self.offsets, rows.shape[0])
        else:
            want_dtype, want_shape = np.dtype(self.spec.dtype), (self.count, *self.spec.shape)
        if rows.dtype != want_dtype or rows.shape != want_shape or not rows.flags.c_contiguous:
            order = "" if rows.flags.c_contiguous else " in Fortran order"
            raise DataError(
                f"{self.data_path}: holds {rows.dtype}{list(rows.shape)}{order}, the manifest "
                f"says {want_dtype}{list(want_shape)}; {REPACK}"
            )

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if self.offsets is not None:
            check_offsets(self.root / "offsets.npy", self.offsets, shape[0])
            self.check_count("encoded.npy bytes", shape[0], int(self.offsets[-1]))
        else:
            self.check_count("samples.npy", shape[0])

    def _read_header(self) -> bool:
        """The data file's .npy header from its download in progress (False: it ended first).
        The samples then lie at _header + their offset."""
        head = bytearray(min(self._landing.size, NPY_HEADER_MAX))
        if not self._landing.read_into([(0, memoryview(head))]):
            return False
        shape, offset = npy_header(bytes(head), self.root / self.data_name)
        self._check_shape(shape)
        self._header = offset
        return True

    def _early(self, indices: np.ndarray):
        """The samples at `indices` from the data file's download in progress, each checked
        against its crc32 (the whole file's sha256 is checked when it lands); None once the
        download has ended, or when a sample fails its crc32: the landed file is read then
        (its fetch reports an object changed since the pack was made)."""
        want = self.crc32[indices]
        if self.spec.kind == "array":
            out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
            rows = map(memoryview, out.reshape(len(indices), -1).view(np.uint8))
            starts = (self._header + indices * self.spec.nbytes).tolist()
            if not self._landing.read_into(list(zip(starts, rows, strict=True))):
                return None
            return out if np.array_equal(row_crcs(out), want) else None
        a, b = self.offsets[indices], self.offsets[indices + 1]
        buf = np.empty(int((b - a).sum()), np.uint8)
        ends = np.cumsum(b - a).tolist()
        views = [buf[e - n : e] for e, n in zip(ends, (b - a).tolist(), strict=True)]
        reads = [(self._header + o, memoryview(v)) for o, v in zip(a.tolist(), views, strict=True)]
        if not self._landing.read_into(reads):
            return None
        got = np.fromiter((crc32(v) for v in views), np.uint32, len(views))
        return views if np.array_equal(got, want) else None

    def __getstate__(self):
        state = super().__getstate__()
        state["_landing"] = None  # this process's download; another one reads the landed file
        return state

    def _load(self, name: str, length: int, dtype=np.int64) -> np.ndarray:
        """Index file ``name``: ``length`` integers as ``dtype``, its size and header checked
        before anything is allocated (npy.read_npy_vector, base.index_array)."""
        path = self.file(name, whole=True)
        return index_array(path, read_npy_vector(path, length), dtype)

    @property
    def data_name(self) -> str:
        return data_name(self.spec.kind, self.container)

    @property
    def data_path(self) -> Path:
        return self.root / self.data_name

    def _open(self):
        if not self._landed:
            self._land()
        self.check_pinned(self.data_name)
        rows = self._rows()
        self._check_rows(rows)
        if rows.size:
            self.see_cache(self.data_path, rows.ctypes.data)
        return rows

    def _close(self, handle) -> None:
        self.ahead.drain()  # no thread may read the map once it can be unmapped

    def location(self, index: int) -> str:
        return str(self.data_path)

    def mapped_samples(self) -> np.ndarray | None:
        # while it downloads, the reads ahead are the download itself
        return self.handle if self._landed else None

    def read_batch(self, indices: np.ndarray):
        if not self._landed:
            early = self._early(indices) if self._landing is not None else None
            if early is not None:
                return early
            self._land()
        return self.read_mapped(self.handle, indices)
