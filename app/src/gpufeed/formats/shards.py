"""Tar shards in the WebDataset layout.

Each sample is a group of members sharing a key, the zero-padded sample index:
  000000123.npy   the sample: a .npy file (fixed-shape arrays) or the encoded image bytes
                  under its own extension (.jpg, .png, ...)
  000000123.cls   the label as decimal text (-1 when the source had none)
Shards are named shard-000000.tar, shard-000001.tar, ...; the manifest records the
brace-expandable pattern (shard-{000000..000012}.tar) that `webdataset.WebDataset` accepts.
Members are plain ustar entries with fixed owner, mode and mtime, so packs are reproducible.

index.npz beside the shards gives every sample's shard, data offset and size (for .npy members
the offset points past the .npy header), label and crc32: it enables random access, per-sample
verification and splitting shards without opening them.
"""

from __future__ import annotations

import os
import tarfile
from typing import Any

import numpy as np

from gpufeed.formats.common import (
    PREFETCH_MIN_BYTES,
    CorruptSampleError,
    Part,
    Reader,
    SampleSpec,
    Writer,
    fsync_dir,
    npy_bytes,
)

INDEX_NAME = "index.npz"
SHARD_FORMAT = "shard-{:06d}.tar"
BLOCK = 512
RECORD = 20 * BLOCK
DEFAULT_SHARD_SIZE = 10_000
DEFAULT_SHARD_BYTES = 256 << 20
KEY_FORMAT = "{:09d}"


def shard_pattern(n: int) -> str:
    if n <= 1:
        return SHARD_FORMAT.format(0)
    return f"shard-{{{0:06d}..{n - 1:06d}}}.tar"


def member_header(name: str, size: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def npy_header(spec: SampleSpec) -> bytes:
    full = npy_bytes(np.zeros(spec.shape, dtype=spec.dtype))
    return full[: len(full) - spec.nbytes]


class ShardWriter(Writer):
    """Splits samples into shards of at most `shard_size` samples and `shard_bytes` bytes."""

    format_name = "tar"

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self.spec = spec or SampleSpec("encoded")
        self.max_count = int(options.get("shard_size") or DEFAULT_SHARD_SIZE)
        self.max_bytes = int(options.get("shard_bytes") or DEFAULT_SHARD_BYTES)
        self.header = npy_header(self.spec) if self.spec.kind == "array" else b""
        self.shard = np.empty(count, dtype=np.int32)
        self.offset = np.empty(count, dtype=np.int64)
        self.size = np.empty(count, dtype=np.int64)
        self.labels = np.empty(count, dtype=np.int64)
        self.crcs = np.empty(count, dtype=np.uint32)
        self.names: list[str] = []
        self.f = None
        self.in_shard = 0
        self.pos = 0
        self.n = 0

    def _start_shard(self) -> None:
        self._end_shard()
        name = SHARD_FORMAT.format(len(self.names))
        self.names.append(name)
        self.f = open(self.out / name, "wb")
        self.in_shard = 0
        self.pos = 0

    def _end_shard(self) -> None:
        if self.f is None:
            return
        end = self.pos + 2 * BLOCK
        self.f.write(b"\0" * (2 * BLOCK + (-end) % RECORD))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        self.f = None

    def _member(self, name: str, data_parts: list) -> int:
        size = sum(len(d) for d in data_parts)
        self.f.write(member_header(name, size))
        start = self.pos + BLOCK
        for d in data_parts:
            self.f.write(d)
        pad = (-size) % BLOCK
        self.f.write(b"\0" * pad)
        self.pos = start + size + pad
        return start

    @staticmethod
    def _member_bytes(size: int) -> int:
        return BLOCK + size + (-size) % BLOCK

    def add(self, part: Part) -> None:
        for j in range(len(part)):
            data = part.sample(j)
            label = b"%d" % int(part.labels[j])
            need = self._member_bytes(len(self.header) + len(data)) + self._member_bytes(len(label))
            if (
                self.f is None
                or self.in_shard >= self.max_count
                or (self.in_shard and self.pos + need + 2 * BLOCK > self.max_bytes)
            ):
                self._start_shard()
            k = KEY_FORMAT.format(self.n)
            ext = "npy" if self.spec.kind == "array" else str(part.exts[j])
            start = self._member(f"{k}.{ext}", [self.header, data])
            self._member(f"{k}.cls", [label])
            self.shard[self.n] = len(self.names) - 1
            self.offset[self.n] = start + len(self.header)
            self.size[self.n] = len(data)
            self.labels[self.n] = part.labels[j]
            self.crcs[self.n] = part.crc32[j]
            self.n += 1
            self.in_shard += 1

    def finish(self) -> dict[str, Any]:
        assert self.n == self.count
        if self.f is None and not self.names:
            self._start_shard()  # an empty dataset is still one valid (empty) tar
        self._end_shard()
        with open(self.out / INDEX_NAME, "wb") as f:
            np.savez(
                f,
                shard=self.shard,
                offset=self.offset,
                size=self.size,
                labels=self.labels,
                crc32=self.crcs,
            )
        fsync_dir(self.out)
        counts = np.bincount(self.shard, minlength=len(self.names)).tolist()
        layout = {
            "pattern": shard_pattern(len(self.names)),
            "shards": self.names,
            "shard_counts": counts,
            "key_format": "%09d",
            "shard_size": self.max_count,
            "shard_bytes": self.max_bytes,
        }
        return {"files": sorted([*self.names, INDEX_NAME]), "layout": layout}


class ShardReader(Reader):
    """Random and sequential access to the shards through index.npz (os.pread, no tarfile)."""

    format_name = "tar"

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        layout = manifest["layout"]
        self.shards: list[str] = list(layout["shards"])
        with np.load(self.root / INDEX_NAME) as z:
            self.shard = z["shard"]
            self.offset = z["offset"]
            self.size = z["size"]
            self.labels = z["labels"]
            self.crc32 = z["crc32"]
        counts = np.asarray(layout["shard_counts"], dtype=np.int64)
        self.shard_start = np.concatenate([[0], np.cumsum(counts)])

    def _open(self):
        return {}

    def _close(self, handle) -> None:
        for fd in handle.values():
            os.close(fd)

    def _fd(self, shard: int) -> int:
        fds = self.handle
        fd = fds.get(shard)
        if fd is None:
            fd = fds[shard] = os.open(self.root / self.shards[shard], os.O_RDONLY)
        return fd

    def location(self, index: int) -> str:
        return str(self.root / self.shards[int(self.shard[index])])

    def shard_range(self, shard: int) -> tuple[int, int]:
        return int(self.shard_start[shard]), int(self.shard_start[shard + 1])

    def _pread(self, i: int) -> bytes:
        size = int(self.size[i])
        data = os.pread(self._fd(int(self.shard[i])), size, int(self.offset[i]))
        if len(data) != size:
            raise CorruptSampleError(self.location(i), i, "shard is truncated")
        return data

    def prefetch(self, indices: np.ndarray) -> None:
        if not hasattr(os, "posix_fadvise"):  # macOS
            return
        for i in indices.tolist():
            if self.size[i] >= PREFETCH_MIN_BYTES:
                os.posix_fadvise(
                    self._fd(int(self.shard[i])),
                    int(self.offset[i]),
                    int(self.size[i]),
                    os.POSIX_FADV_WILLNEED,
                )

    def read_batch(self, indices: np.ndarray):
        if self.spec.kind == "encoded":
            return [self._pread(int(i)) for i in indices]
        out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
        flat = out.reshape(len(indices), -1).view(np.uint8)
        width = self.spec.nbytes
        for j, i in enumerate(indices):
            i = int(i)
            if int(self.size[i]) != width:
                raise CorruptSampleError(self.location(i), i, "index size differs from spec")
            n = os.preadv(self._fd(int(self.shard[i])), [flat[j]], int(self.offset[i]))
            if n != width:
                raise CorruptSampleError(self.location(i), i, "shard is truncated")
        return out
