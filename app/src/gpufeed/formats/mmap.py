"""Memory-mapped tensors: plain .npy files (or one .pt) that index without being read whole.

Files in the dataset folder (N samples):
  samples.npy   [N, *shape] dtype, opened with np.load(mmap_mode="r")      (container "npy")
  samples.pt    one tensor [N, *shape], opened with torch.load(mmap=True)   (container "pt")
  encoded.npy   [total] uint8 and offsets.npy [N + 1] int64 for encoded samples
  labels.npy    [N] int64
  crc32.npy     [N] uint32
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.formats.common import (
    ContiguousWriter,
    Reader,
    SampleSpec,
    UsageError,
    advise_buffers,
    advise_rows,
    advise_samples,
    take_rows,
)

CONTAINERS = ("npy", "pt")


class MmapWriter(ContiguousWriter):
    format_name = "mmap"

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self.spec = spec or SampleSpec("encoded")
        self.container = options.get("container") or "npy"
        if self.container not in CONTAINERS:
            raise UsageError(f"unknown mmap container {self.container!r}; use npy or pt")
        if self.container == "pt" and self.spec.kind != "array":
            raise UsageError("the .pt container holds fixed-shape arrays; use --encode raw")
        if self.spec.kind == "array":
            self.data = np.lib.format.open_memmap(
                self.out / "samples.npy",
                mode="w+",
                dtype=self.spec.dtype,
                shape=(count, *self.spec.shape),
            )
        else:
            self.data = np.lib.format.open_memmap(
                self.out / "encoded.npy", mode="w+", dtype=np.uint8, shape=(total_bytes,)
            )
        self._start_index()

    def finish(self) -> dict[str, Any]:
        assert self.n == self.count
        self.data.flush()
        del self.data
        files = ["labels.npy", "crc32.npy"]
        np.save(self.out / "labels.npy", self.labels)
        np.save(self.out / "crc32.npy", self.crcs)
        if self.spec.kind == "encoded":
            np.save(self.out / "offsets.npy", self.offsets)
            files += ["encoded.npy", "offsets.npy"]
        elif self.container == "pt":
            import torch

            arr = np.load(self.out / "samples.npy", mmap_mode="r+")
            torch.save(torch.from_numpy(arr), self.out / "samples.pt")
            del arr
            os.unlink(self.out / "samples.npy")
            files.append("samples.pt")
        else:
            files.append("samples.npy")
        return {"files": sorted(files), "layout": {"container": self.container}}


class MmapReader(Reader):
    format_name = "mmap"

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.container = manifest.get("layout", {}).get("container", "npy")
        self.labels = np.load(self.root / "labels.npy")
        self.crc32 = np.load(self.root / "crc32.npy")
        self.offsets = np.load(self.root / "offsets.npy") if self.spec.kind == "encoded" else None

    @property
    def data_path(self) -> Path:
        if self.spec.kind == "encoded":
            return self.root / "encoded.npy"
        return self.root / ("samples.pt" if self.container == "pt" else "samples.npy")

    def _open(self):
        if self.container == "pt":
            import torch

            t = torch.load(self.data_path, mmap=True, weights_only=True, map_location="cpu")
            return t.numpy()
        # a plain ndarray over the map: np.memmap's slicing costs ~1.5 us a sample
        return np.load(self.data_path, mmap_mode="r").view(np.ndarray)

    def _close(self, handle) -> None:
        pass

    def location(self, index: int) -> str:
        return str(self.data_path)

    def prefetch(self, indices: np.ndarray) -> None:
        advise_samples(self.handle, self.offsets, indices)

    def read_batch(self, indices: np.ndarray):
        data = self.handle
        if self.spec.kind == "array":
            advise_rows(data, indices)
            out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
            take_rows(data, indices, out)
            return out
        starts, ends = self.offsets[indices].tolist(), self.offsets[indices + 1].tolist()
        views = [data[a:b] for a, b in zip(starts, ends, strict=True)]
        advise_buffers(views)
        return views
