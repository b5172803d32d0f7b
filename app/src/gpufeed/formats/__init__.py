"""On-disk formats: the registry (format name -> reader and writer classes), here; the pack
contract beside it; one folder per format.

    hdf5   HDF5 (h5py): /samples or /encoded+/offsets, /labels, /crc32        formats/hdf5.py
    lmdb   one record per sample, keys b"%010d"                                formats/lmdb/
    tar    WebDataset-style tar shards + index.npz                             formats/tar/
    mmap   .npy (numpy memmap) or .pt (torch.load(mmap=True)) tensors          formats/mmap/

A new format is a reader and a writer (:class:`~gpufeed.formats.base.Reader`,
:class:`~gpufeed.formats.base.Writer`) and one line in :data:`FORMATS`. The pack contract the
formats share: the manifest and its path rules (manifest.py), the sample spec (spec.py), the
schema and its records (schema.py, record.py), .npy headers (npy.py), checksums, atomic and
disk-full-safe files (files.py), staged parts (parts.py), the pack lock (lock.py); opening a
path (open.py). Data gpufeed did not write is read in place (inplace/). Page-cache work
(read-ahead, which pages are cached, copying rows out of a map) is the layer below,
gpufeed.pagecache.

The formats layer knows numpy and the storage libraries, never torch, with one exception:
the mmap format's ``.pt`` container is torch's own file (formats/mmap/pt.py imports torch when
such a pack is written or read). Format modules are imported on first use, so listing the
formats (the CLI's choices) costs no h5py or lmdb import. This module imports nothing else
of gpufeed.formats: every other module of the layer may import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpufeed.errors import DataError, UsageError

if TYPE_CHECKING:
    from gpufeed.formats.base import Reader, Writer


@dataclass(frozen=True)
class Format:
    """Where a format's reader and writer live, as "module:Class" (imported when first asked
    for)."""

    reader: str
    writer: str

    def reader_class(self) -> type[Reader]:
        return _load(self.reader)

    def writer_class(self) -> type[Writer]:
        return _load(self.writer)


def _load(where: str):
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


# The one list of formats: name (as in the manifest and `gpufeed pack --format`) -> classes.
FORMATS: dict[str, Format] = {
    "hdf5": Format("gpufeed.formats.hdf5:HDF5Reader", "gpufeed.formats.hdf5:HDF5Writer"),
    "lmdb": Format(
        "gpufeed.formats.lmdb.reader:LMDBReader", "gpufeed.formats.lmdb.writer:LMDBWriter"
    ),
    "tar": Format("gpufeed.formats.tar.reader:TarReader", "gpufeed.formats.tar.writer:TarWriter"),
    "mmap": Format(
        "gpufeed.formats.mmap.reader:MmapReader", "gpufeed.formats.mmap.writer:MmapWriter"
    ),
}


# A merged hdf5, lmdb or mmap pack (gpufeed.write.merge) lists its parts under this layout
# key; one reader, any of those formats, reads it through the format's own reader per part.
PARTS_LAYOUT = "parts"
MULTIPART_READER = "gpufeed.formats.multipart:MultiPartReader"


def writer_class(fmt: str) -> type[Writer]:
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[fmt].writer_class()


def reader_class(fmt: str, manifest: dict[str, Any] | None = None) -> type[Reader]:
    """The reader of format `fmt`; given the pack's manifest, the reader of a merged pack of
    parts when the manifest lists parts (gpufeed.formats.multipart: it reads each part with
    the format's own reader)."""
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if manifest is not None and is_multipart(manifest):
        return _load(MULTIPART_READER)
    return FORMATS[fmt].reader_class()


def is_multipart(manifest: dict[str, Any]) -> bool:
    """Whether a manifest describes a merged pack of parts (layout.parts)."""
    layout = manifest.get("layout")
    return isinstance(layout, dict) and PARTS_LAYOUT in layout


__all__ = [
    "FORMATS",
    "MULTIPART_READER",
    "PARTS_LAYOUT",
    "Format",
    "is_multipart",
    "reader_class",
    "writer_class",
]
