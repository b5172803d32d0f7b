"""On-disk formats: one reader and one writer per format.

hdf5   HDF5File (h5py): /samples or /encoded+/offsets, /labels, /crc32
lmdb   one record per sample, keys b"%010d"
tar    WebDataset-style tar shards + index.npz
mmap   .npy (numpy memmap) or .pt (torch.load(mmap=True)) tensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufeed.formats.common import (
    CorruptSampleError,
    DataError,
    GpufeedError,
    NotPackedError,
    Reader,
    SampleSpec,
    SourceError,
    UsageError,
    Writer,
)

FORMATS = ("hdf5", "lmdb", "tar", "mmap")


def writer_class(fmt: str) -> type[Writer]:
    if fmt == "hdf5":
        from gpufeed.formats.hdf5 import HDF5Writer

        return HDF5Writer
    if fmt == "lmdb":
        from gpufeed.formats.lmdb import LMDBWriter

        return LMDBWriter
    if fmt == "tar":
        from gpufeed.formats.shards import ShardWriter

        return ShardWriter
    if fmt == "mmap":
        from gpufeed.formats.mmap import MmapWriter

        return MmapWriter
    raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def reader_class(fmt: str) -> type[Reader]:
    if fmt == "hdf5":
        from gpufeed.formats.hdf5 import HDF5Reader

        return HDF5Reader
    if fmt == "lmdb":
        from gpufeed.formats.lmdb import LMDBReader

        return LMDBReader
    if fmt == "tar":
        from gpufeed.formats.shards import ShardReader

        return ShardReader
    if fmt == "mmap":
        from gpufeed.formats.mmap import MmapReader

        return MmapReader
    raise DataError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def open_reader(path: str | Path, **options: Any) -> Reader:
    """The reader for a finished pack, chosen by its manifest."""
    from gpufeed.manifest import read_manifest

    manifest = read_manifest(path)
    root = Path(path)
    if root.is_file():
        root = root.parent
    return reader_class(manifest["format"])(root, manifest, **options)


__all__ = [
    "FORMATS",
    "CorruptSampleError",
    "DataError",
    "GpufeedError",
    "NotPackedError",
    "Reader",
    "SampleSpec",
    "SourceError",
    "UsageError",
    "Writer",
    "open_reader",
    "reader_class",
    "writer_class",
]
