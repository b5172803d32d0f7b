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
from gpufeed.errors import NotPackedError, UsageError
from gpufeed.storage.packs import read_manifest_at

__all__ = ["MAP_STYLE", "open_dataset"]

# format -> its dataset; every format opens map-style, so that DataLoader's shuffle=True,
# samplers and Subset work on every pack (map_style=False streams tar: TarShardDataset)
MAP_STYLE = {
    "hdf5": HDF5Dataset,
    "lmdb": LMDBDataset,
    "mmap": MmapDataset,
    "tar": TarIndexedDataset,
}


def open_dataset(path: str | os.PathLike, **options: Any):
    """The dataset for a finished pack, by its manifest's format: HDF5Dataset, LMDBDataset,
    MmapDataset or TarIndexedDataset, all map-style. ``map_style=False`` on a tar pack gives
    TarShardDataset instead, an IterableDataset that streams whole shards in order (with
    ``shuffle_buffer``, ``shuffle_shards``, ``fetch_ahead``...): the explicit extra for tar
    sets read front to back, e.g. from object storage past the cache's size.
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
    if fmt == "tar" and map_style is False:
        return TarShardDataset(path, **options)
    if map_style is False:
        raise UsageError(f"{path}: map_style=False streams tar shards only; this pack is {fmt}")
    _refuse_streaming_options(path, options)
    return MAP_STYLE[fmt](path, **options)


# options only the streamed tar dataset takes (TarShardDataset's signature)
STREAMING_OPTIONS = (
    "shuffle_buffer",
    "shuffle_shards",
    "seed",
    "read_size",
    "rank",
    "world_size",
    "fetch_ahead",
)


def _refuse_streaming_options(path, options) -> None:
    """A streamed tar option given to a map-style dataset names the way to stream."""
    given = [k for k in STREAMING_OPTIONS if k in options]
    if given:
        raise UsageError(
            f"{path}: {', '.join(given)} apply to streamed tar shards: pass map_style=False "
            "(a map-style dataset is shuffled, seeded and split across ranks by its sampler, "
            "e.g. make_loader(shuffle=True, seed=...) or DistributedSampler)"
        )
