"""On-disk formats: one module per format, each with a reader and a writer, and the registry.

    hdf5   HDF5 (h5py): /samples or /encoded+/offsets, /labels, /crc32        formats/hdf5.py
    lmdb   one record per sample, keys b"%010d"                                formats/lmdb.py
    tar    WebDataset-style tar shards + index.npz                             formats/tar.py
    mmap   .npy (numpy memmap) or .pt (torch.load(mmap=True)) tensors          formats/mmap.py

A new format is one new module (a :class:`~gpufeed.formats.base.Reader` and a
:class:`~gpufeed.formats.base.Writer`) and one line in :data:`FORMATS`. What the formats
share lives beside them: the manifest and its path rules (manifest.py), the sample spec
(spec.py), checksums, atomic and disk-full-safe files (files.py), staged parts (parts.py),
read-ahead hints (readahead.py), which pages are cached where mincore cannot tell
(pagecache.py), the pack lock (lock.py).

The formats layer knows numpy and the storage libraries, never torch, with one exception:
the mmap format's ``.pt`` container is torch's own file (formats/pt.py imports torch when
such a pack is written or read). Format modules are imported on first use, so listing the
formats (the CLI's choices) costs no h5py or lmdb import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufeed.errors import DataError, UsageError

if TYPE_CHECKING:
    from gpufeed.formats.base import Reader, Writer


@dataclass(frozen=True)
class Format:
    """Where a format's reader and writer live (imported when first asked for)."""

    module: str
    reader: str
    writer: str

    def reader_class(self) -> type[Reader]:
        return getattr(importlib.import_module(self.module), self.reader)

    def writer_class(self) -> type[Writer]:
        return getattr(importlib.import_module(self.module), self.writer)


# The one list of formats: name (as in the manifest and `gpufeed pack --format`) -> classes.
FORMATS: dict[str, Format] = {
    "hdf5": Format("gpufeed.formats.hdf5", "HDF5Reader", "HDF5Writer"),
    "lmdb": Format("gpufeed.formats.lmdb", "LMDBReader", "LMDBWriter"),
    "tar": Format("gpufeed.formats.tar", "TarReader", "TarWriter"),
    "mmap": Format("gpufeed.formats.mmap", "MmapReader", "MmapWriter"),
}


def writer_class(fmt: str) -> type[Writer]:
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[fmt].writer_class()


def reader_class(fmt: str) -> type[Reader]:
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt].reader_class()


def open_reader(path: str | Path, **options: Any) -> Reader:
    """The reader for a finished pack, chosen by its manifest; for a path without one, the
    reader of data read in place (WebDataset shards, an HDF5 file given ``datasets=``:
    gpufeed.formats.inplace), else NotPackedError."""
    from gpufeed.errors import NotPackedError
    from gpufeed.formats.manifest import read_manifest

    try:
        manifest = read_manifest(path)
    except NotPackedError:
        from gpufeed.formats.inplace import open_in_place

        reader = open_in_place(path, **options)
        if reader is None:
            raise
        return reader
    root = Path(path)
    if root.is_file():
        root = root.parent
    cls = reader_class(manifest["format"])
    check_reader_options(cls, options, path)
    return cls(root, manifest, **options)


def check_reader_options(cls: type[Reader], options: dict[str, Any], path) -> None:
    """Options a reader's __init__ does not take: a UsageError naming the first, the closest
    one it takes and all of them (its signature is the one list), never Python's TypeError."""
    import difflib
    import inspect

    kinds = (inspect.Parameter.KEYWORD_ONLY,)
    valid = [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind in kinds]
    unknown = [name for name in options if name not in valid]
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" (did you mean {close[0]}=?)" if close else ""
        raise UsageError(
            f"{path}: the {cls.format_name} reader takes no option {unknown[0]}={hint}; "
            f"its options: {', '.join(valid) or 'none'}"
        )


__all__ = [
    "FORMATS",
    "Format",
    "check_reader_options",
    "open_reader",
    "reader_class",
    "writer_class",
]
