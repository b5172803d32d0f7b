"""``open_dataset``: the dataset for a pack, by its manifest's format."""

from __future__ import annotations

import os
from typing import Any

from gpufeed.data.imagefolder import ImageFolderReader, is_image_folder
from gpufeed.data.map_style import (
    HDF5Dataset,
    LMDBDataset,
    MmapDataset,
    PackedDataset,
    TarIndexedDataset,
)
from gpufeed.data.streaming import TarShardDataset
from gpufeed.errors import NotPackedError
from gpufeed.storage.packs import read_manifest_at

__all__ = ["MAP_STYLE", "open_dataset"]

# format -> its map-style dataset (tar streams by default: TarShardDataset)
MAP_STYLE = {
    "hdf5": HDF5Dataset,
    "lmdb": LMDBDataset,
    "mmap": MmapDataset,
    "tar": TarIndexedDataset,
}


def open_dataset(path: str | os.PathLike, **options: Any):
    """The dataset for a finished pack, by its manifest's format: HDF5Dataset, LMDBDataset,
    MmapDataset, or TarShardDataset (iterable; pass map_style=True for TarIndexedDataset).
    A path without manifest.json is read in place when it is WebDataset tar shards, an
    image-folder tree or an HDF5 file given ``datasets=`` (gpufeed.formats.inplace; an
    index is cached in ``index_dir=``); anything else (an unfinished pack, say) raises
    NotPackedError.
    A URL (s3://bucket/prefix, gs://, az://, https://) reads the pack from object storage
    through a local cache: cache_dir= (default $GPUFEED_CACHE_DIR or ~/.cache/gpufeed),
    cache_limit= ("50GB"; default $GPUFEED_CACHE_LIMIT, else the disk's free space)."""
    map_style = options.pop("map_style", None)
    cache = {k: options[k] for k in ("cache_dir", "cache_limit") if k in options}
    try:
        fmt = read_manifest_at(path, **cache)["format"]
    except NotPackedError:
        if is_image_folder(path) and options.get("datasets") is None:
            return PackedDataset(path, reader=ImageFolderReader, **options)
        return PackedDataset(path, **options)  # in place, or NotPackedError again
    if fmt == "tar" and not map_style:
        return TarShardDataset(path, **options)
    return MAP_STYLE[fmt](path, **options)
