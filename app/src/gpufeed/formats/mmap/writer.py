"""The mmap format's writer (the layout: gpufeed.formats.mmap).

Given its count (a pack assembled from its parts), it fills a preallocated memmap. Fed as
parts are committed (count None: a fresh pack, gpufeed.write.assemble.Stream; container
"npy"), it appends each part's bytes to the .npy file by pwrite after a header written for 0
rows, and rewrites the header in place when it finishes (formats.appended): the same file,
byte for byte, with no second pass over the samples but the one that hashes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import UsageError
from gpufeed.formats.appended import AppendedFile, npy_head
from gpufeed.formats.base import ContiguousWriter
from gpufeed.formats.files import preallocate
from gpufeed.formats.mmap import CONTAINERS, data_name, pt
from gpufeed.formats.spec import SampleSpec

# Part.where's first column for a sample in a streamed mmap pack's .npy file (data_name):
# (STREAMED_MMAP, file offset, size) rows (gpufeed.write.direct)
STREAMED_MMAP = -2


def data_head(spec: SampleSpec, rows: int) -> bytes:
    """The .npy header of the data file holding ``rows`` samples (array) or bytes."""
    if spec.kind == "array":
        return npy_head(spec.dtype, (rows, *spec.shape))
    return npy_head(np.uint8, (rows,))


def allocated_memmap(path: Path, dtype, shape) -> np.memmap:
    """A new .npy file mapped for writing, its blocks reserved first: open_memmap alone makes
    a sparse file, and a write through the map into a hole on a full disk is a SIGBUS."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    with open(path, "r+b") as f:
        preallocate(f, os.fstat(f.fileno()).st_size, path)
    return arr


class MmapWriter(ContiguousWriter):
    format_name = "mmap"
    place_marker = STREAMED_MMAP

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self.spec = spec or SampleSpec("encoded")
        self.container = options.get("container") or "npy"
        if self.container not in CONTAINERS:
            raise UsageError(f"unknown mmap container {self.container!r}; use npy or pt")
        if self.container == "pt" and self.spec.kind != "array":
            what = (
                f"multi-field samples ({self.spec.schema.describe()}); use the npy container"
                if self.spec.kind == "fields"
                else "encoded images; use --encode raw"
            )
            raise UsageError(
                f"the .pt container holds one fixed-shape tensor per sample, not {what}"
            )
        self.current_file = self.out / data_name(self.spec.kind)
        self.sha256: dict[str, str] = {}
        if count is None:
            self.appended = AppendedFile(self.current_file, data_head(self.spec, 0))
        elif self.spec.kind == "array":
            shape = (count, *self.spec.shape)
            self.data = allocated_memmap(self.current_file, self.spec.dtype, shape)
        else:
            self.data = allocated_memmap(self.current_file, np.uint8, (total_bytes,))
        self._start_index()

    def abort(self) -> None:
        self.data = None
        if self.appended is not None:
            self.appended.close()

    def finish(self) -> dict[str, Any]:
        self._finish_data()
        files = ["labels.npy", "crc32.npy"]
        self._save("labels.npy", self.labels)
        self._save("crc32.npy", self.crcs)
        if self.spec.kind != "array":
            self._save("offsets.npy", self.offsets)
            files += ["encoded.npy", "offsets.npy"]
        elif self.container == "pt":
            self.current_file = self.out / "samples.pt"
            pt.save_npy_as_pt(self.out / "samples.npy", self.current_file)
            os.unlink(self.out / "samples.npy")
            self.sha256.pop("samples.npy", None)
            files.append("samples.pt")
        else:
            files.append("samples.npy")
        layout = {"container": self.container}
        return {"files": sorted(files), "layout": layout, "sha256": dict(self.sha256)}

    def _finish_data(self) -> None:
        """The data file complete on disk: the map flushed, or the streamed file's header
        written for its final count (its fsync and sha256, one read of the file, in a thread:
        formats.appended.AppendedFile.finish)."""
        if self.appended is None:
            assert self.n == self.count
            self.data.flush()
            del self.data
            return
        self.trim_index()
        rows = self.n if self.spec.kind == "array" else self.nbytes
        written = self.appended.finish(data_head(self.spec, rows), hashed=self.container == "npy")
        if self.container == "npy":  # a future: assemble waits for it before the manifest
            self.sha256[self.current_file.name] = written
        else:  # the .pt file is made from it next
            written.result()

    def _save(self, name: str, arr: np.ndarray) -> None:
        self.current_file = self.out / name
        np.save(self.current_file, arr)
