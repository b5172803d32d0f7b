"""Opening a path: a finished pack by its manifest's format, or data read in place (WebDataset
shards, an HDF5 file given ``datasets=``: gpufeed.formats.inplace)."""

from __future__ import annotations

import difflib
import inspect
import os
from pathlib import Path
from typing import Any

from gpufeed.errors import NotPackedError, UsageError
from gpufeed.formats import reader_class
from gpufeed.formats.base import Reader
from gpufeed.formats.inplace.parquet import ParquetReader, is_parquet
from gpufeed.formats.inplace.webdataset import WebDatasetReader, is_webdataset
from gpufeed.formats.manifest import read_manifest

__all__ = ["check_reader_options", "open_in_place", "open_reader"]


def open_reader(path: str | Path, **options: Any) -> Reader:
    """The reader for a finished pack, chosen by its manifest; for a path without one, the
    reader of data read in place (WebDataset shards, an HDF5 file given ``datasets=``:
    open_in_place), else NotPackedError."""
    try:
        manifest = read_manifest(path)
    except NotPackedError:
        reader = open_in_place(path, **options)
        if reader is None:
            raise
        return reader
    root = Path(path)
    if root.is_file():
        root = root.parent
    # a merged pack's options are its parts' format's (MultiPartReader passes them on)
    check_reader_options(reader_class(manifest["format"]), options, path)
    return reader_class(manifest["format"], manifest)(root, manifest, **options)


def check_reader_options(cls: type[Reader], options: dict[str, Any], path) -> None:
    """Options a reader's __init__ does not take: a UsageError naming the first, the closest
    one it takes and all of them (its signature is the one list), never Python's TypeError."""
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


def open_in_place(path: str | os.PathLike, **options: Any) -> Reader | None:
    """The in-place reader for `path`, or None when it is none of the layouts read in place."""
    datasets = options.pop("datasets", None)
    if datasets is not None:
        from gpufeed.formats.inplace.hdf5_file import HDF5FileReader  # h5py, imported when needed

        return HDF5FileReader(path, datasets=datasets)
    if is_webdataset(path):
        return WebDatasetReader(path, **options)
    if is_parquet(path):
        options.pop("index_dir", None)  # Parquet's footers are its index: none cached
        return ParquetReader(path, **options)
    return None
