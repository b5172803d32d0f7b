"""The mmap format's writer (the layout: gpufeed.formats.mmap)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import UsageError
from gpufeed.formats.base import ContiguousWriter
from gpufeed.formats.files import preallocate
from gpufeed.formats.mmap import CONTAINERS, pt
from gpufeed.formats.spec import SampleSpec


def allocated_memmap(path: Path, dtype, shape) -> np.memmap:
    """A new .npy file mapped for writing, its blocks reserved first: open_memmap alone makes
    a sparse file, and a write through the map into a hole on a full disk is a SIGBUS."""
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    with open(path, "r+b") as f:
        preallocate(f, os.fstat(f.fileno()).st_size, path)
    return arr


class MmapWriter(ContiguousWriter):
    format_name = "mmap"

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
        if self.spec.kind == "array":
            self.current_file = self.out / "samples.npy"
            shape = (count, *self.spec.shape)
            self.data = allocated_memmap(self.current_file, self.spec.dtype, shape)
        else:
            self.current_file = self.out / "encoded.npy"
            self.data = allocated_memmap(self.current_file, np.uint8, (total_bytes,))
        self._start_index()

    def abort(self) -> None:
        self.data = None

    def finish(self) -> dict[str, Any]:
        assert self.n == self.count
        self.data.flush()
        del self.data
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
            files.append("samples.pt")
        else:
            files.append("samples.npy")
        return {"files": sorted(files), "layout": {"container": self.container}}

    def _save(self, name: str, arr: np.ndarray) -> None:
        self.current_file = self.out / name
        np.save(self.current_file, arr)
