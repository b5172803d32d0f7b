"""``open_dataset``: the dataset for a pack, by its manifest's format."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable
from typing import Any

from gpufeed.data.map_style import (
    HDF5Dataset,
    LMDBDataset,
    MmapDataset,
    PackedDataset,
    TarIndexedDataset,
)
from gpufeed.data.streaming import TarShardDataset
from gpufeed.data.tokens import TokenWindows
from gpufeed.errors import NotPackedError, UsageError
from gpufeed.formats import reader_class
from gpufeed.formats.inplace.imagefolder import ImageFolderReader, is_image_folder
from gpufeed.formats.inplace.parquet import ParquetReader, is_parquet
from gpufeed.formats.inplace.webdataset import WebDatasetReader
from gpufeed.storage.packs import read_manifest_at
from gpufeed.storage.urls import is_remote

__all__ = ["MAP_STYLE", "open_dataset"]

# format -> its dataset; every format opens map-style, so that DataLoader's shuffle=True,
# samplers and Subset work on every pack (map_style=False streams tar: TarShardDataset)
MAP_STYLE = {
    "hdf5": HDF5Dataset,
    "lmdb": LMDBDataset,
    "mmap": MmapDataset,
    "tar": TarIndexedDataset,
}


def open_dataset(
    path: str | os.PathLike,
    *,
    transform: Callable | None = None,
    batch_transform: Callable | None = None,
    verify_crc: bool = False,
    on_error: str = "raise",
    decode: bool | Callable = True,
    pad: dict[str, Any] | None = None,
    map_style: bool = True,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    datasets: dict[str, str] | None = None,
    index_dir: str | os.PathLike | None = None,
    block_size: int | None = None,
    field: str | None = None,
    eos: int | None = None,
    boundaries: bool = False,
    pad_id: int = 0,
    **options: Any,
):
    """The dataset for a finished pack, by its manifest's format.

    HDF5Dataset, LMDBDataset, MmapDataset or TarIndexedDataset, all map-style.
    ``map_style=False`` on a tar pack gives TarShardDataset instead, an IterableDataset that
    streams its shards in order, each rank and worker an equal share (``shuffle_buffer``,
    ``shuffle_shards``, ``fetch_ahead``...): the explicit extra for tar sets read front to
    back, e.g. from object storage past the cache's size. A path without manifest.json is
    read in place when it is WebDataset tar shards, an image-folder tree, an HDF5 file
    given ``datasets=``, Parquet files (a file, a glob, a folder) or a Hugging Face
    ``save_to_disk`` folder (gpufeed.formats.inplace; ``columns=`` picks columns); anything
    else (an unfinished pack, say) raises NotPackedError.

    Args:
        path: the pack's folder, or a URL (s3://bucket/prefix, gs://, az://, https://) read
            from object storage through a local cache.
        transform: applied to each sample (a tensor, or a multi-field pack's dict).
        batch_transform: applied to each read's samples stacked [B, ...] (map-style only).
        verify_crc: check each sample's crc32 on read.
        on_error: "raise" a CorruptSampleError naming file and sample, or "skip" it (counted
            in ``skipped``).
        decode: True decodes encoded images; False hands them out as 1-D uint8 tensors; a
            batch decoder such as ``gpufeed.RandomResizedCrop(224)`` decodes and augments.
        pad: multi-field packs: ragged field -> fill value (get_batch pads it, adds a mask).
        map_style: False streams a tar pack (TarShardDataset).
        cache_dir: a URL's cache (default $GPUFEED_CACHE_DIR or ~/.cache/gpufeed); unused
            for a local path.
        cache_limit: the cache's bound, e.g. "50GB" (default $GPUFEED_CACHE_LIMIT, else the
            disk's free space); unused for a local path.
        datasets: an HDF5 file without a manifest, read in place: which datasets hold a row
            per sample, e.g. ``{'image': '/images', 'label': '/labels'}``.
        index_dir: where data read in place keeps its cached index.
        block_size: a token pack read as windows of this many tokens of its documents'
            stream (gpufeed.data.tokens.TokenWindows): item i is tokens [i*B, (i+1)*B).
        field: the token field, where samples hold several ragged integer fields.
        eos: a token id appended after each document (with block_size).
        boundaries: windows start at document starts, padded with ``pad_id`` and masked.
        pad_id: the padding of ``boundaries=True`` (default 0).
        **options: the reader's own (hdf5: use_mmap, rdcc_mb; lmdb: readahead; Parquet read
            in place: columns, cache_row_groups) or, with
            map_style=False, the stream's (shuffle_buffer, shuffle_shards, seed, read_size,
            rank, world_size, fetch_ahead, ...: see TarShardDataset).

    Returns:
        A map-style gpufeed dataset, a TarShardDataset with map_style=False, or
        TokenWindows with block_size.

    Raises:
        NotPackedError: ``path`` is neither a finished pack nor data read in place.
        UsageError: an option this kind of dataset does not take (named, with the closest
            valid one and the list of valid ones), or map_style=False on a pack not tar.
    """
    common = {
        "transform": transform,
        "batch_transform": batch_transform,
        "verify_crc": verify_crc,
        "on_error": on_error,
        "decode": decode,
        "pad": pad,
    }
    cache = _given(cache_dir=cache_dir, cache_limit=cache_limit)
    in_place = _given(datasets=datasets, index_dir=index_dir)
    tokens = {"field": field, "eos": eos, "boundaries": boundaries, "pad_id": pad_id}
    if block_size is not None:
        _check_token_options(path, common, map_style, in_place)
    else:
        _refuse_token_options(path, tokens)
    try:
        fmt = read_manifest_at(path, **cache)["format"]
    except NotPackedError:
        if block_size is not None:
            raise UsageError(
                f"{path}: block_size= reads a gpufeed token pack (with manifest.json); this is "
                "none: pack the documents first (docs/pretraining.md)"
            ) from None
        return _open_in_place(path, map_style, common, in_place, cache, options)
    if in_place:
        raise UsageError(
            f"{path}: {', '.join(f'{k}=' for k in in_place)} apply to data read in place "
            f"(no manifest); this is a gpufeed {fmt} pack: leave them out"
        )
    if block_size is not None:
        _check_options(path, options, _keywords(reader_class(fmt).__init__), "token windows", ())
        return TokenWindows(path, block_size, **tokens, **cache, **options)
    if fmt == "tar" and not map_style:
        _check_options(path, options, _stream_options(), "a streamed tar pack", PACK_OPTIONS)
        return TarShardDataset(path, **common, **cache, **options)
    if not map_style:
        raise UsageError(f"{path}: map_style=False streams tar shards only; this pack is {fmt}")
    _refuse_streaming_options(path, options)
    reader_options = _keywords(reader_class(fmt).__init__)
    _check_options(path, options, reader_options, f"a {fmt} pack", PACK_OPTIONS)
    return MAP_STYLE[fmt](path, **common, **cache, **options)


# open_dataset's own options for every dataset, for a pack, for data read in place
COMMON_OPTIONS = frozenset(
    ("transform", "batch_transform", "verify_crc", "on_error", "decode", "pad", "map_style")
)
PACK_OPTIONS = COMMON_OPTIONS | {"cache_dir", "cache_limit"}
IN_PLACE_OPTIONS = COMMON_OPTIONS | {"datasets", "index_dir"}
# token windows of a pack (gpufeed.data.tokens.TokenWindows, whose defaults these are)
TOKEN_OPTIONS = frozenset(("block_size", "field", "eos", "boundaries", "pad_id"))


def _open_in_place(path, map_style, common, in_place, cache, options) -> PackedDataset:
    """Data without a manifest (gpufeed.formats.inplace), map-style only; in object storage,
    Parquet and Arrow files (read by ranges through the cache)."""
    if not map_style:
        raise UsageError(
            f"{path}: map_style=False streams gpufeed tar packs only; data read in place "
            "(no manifest) opens map-style: leave map_style out"
        )
    if "datasets" not in in_place and (is_remote(path) or is_parquet(path)):  # no classes
        from gpufeed.storage.parquet_remote import open_parquet_at

        extra = _keywords(ParquetReader.__init__) - IN_PLACE_OPTIONS
        allowed = IN_PLACE_OPTIONS | set(cache)
        _check_options(path, options, extra, "Parquet or Arrow files", allowed)
        return PackedDataset(path, reader=open_parquet_at, **common, **cache, **options)
    if is_image_folder(path) and "datasets" not in in_place:
        extra = _keywords(ImageFolderReader.__init__) - IN_PLACE_OPTIONS
        _check_options(path, options, extra, "an image folder read in place", IN_PLACE_OPTIONS)
        return PackedDataset(path, reader=ImageFolderReader, **common, **in_place, **options)
    from gpufeed.formats.inplace.hdf5_file import HDF5FileReader  # h5py, imported when needed

    readers = (WebDatasetReader.__init__, HDF5FileReader.__init__)
    extra = set().union(*map(_keywords, readers)) - IN_PLACE_OPTIONS
    _check_options(path, options, extra, "data read in place", IN_PLACE_OPTIONS)
    # read in place, or NotPackedError again
    return PackedDataset(path, **common, **in_place, **options)


# open_dataset's defaults of the options token windows do not take
_NOT_FOR_TOKENS = {
    "transform": None,
    "batch_transform": None,
    "verify_crc": False,
    "on_error": "raise",
    "decode": True,
    "pad": None,
}


def _check_token_options(path, common: dict[str, Any], map_style: bool, in_place) -> None:
    """block_size= reads windows of a pack's token stream: the sample options do not apply."""
    given = [k for k, v in common.items() if v != _NOT_FOR_TOKENS[k]]
    given += ["map_style"] if not map_style else []
    given += list(in_place)
    if given:
        raise UsageError(
            f"{path}: {', '.join(f'{k}=' for k in given)} do not apply to token windows "
            "(block_size=): leave them out (windows are tensors of the stored token dtype)"
        )


def _refuse_token_options(path, tokens: dict[str, Any]) -> None:
    given = [k for k, v in tokens.items() if v != {"boundaries": False, "pad_id": 0}.get(k)]
    if given:
        raise UsageError(
            f"{path}: {', '.join(f'{k}=' for k in given)} apply to token windows: give "
            "block_size= too, e.g. open_dataset(path, block_size=2048, eos=50256)"
        )


def _given(**values: Any) -> dict[str, Any]:
    """The options given (not None): passed on only then, so each reader keeps its default."""
    return {k: v for k, v in values.items() if v is not None}


def _keywords(fn: Callable) -> set[str]:
    """The keyword options `fn` takes (a reader's or dataset's __init__): its signature is
    the one list of them, so a new option needs no second list here."""
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = {p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds}
    return names - {"self", "path", "root", "manifest"}


def _stream_options() -> set[str]:
    """What only the streamed tar dataset takes, beyond open_dataset's own options."""
    return _keywords(TarShardDataset.__init__) - PACK_OPTIONS


def _check_options(path, options: dict[str, Any], extra: set[str], what: str, own) -> None:
    """Options beyond open_dataset's own (`own`) must be the reader's or the stream's
    (`extra`): a typo is named with the closest valid option, never a reader's TypeError."""
    unknown = sorted(set(options) - extra)
    if not unknown:
        return
    name = unknown[0]
    valid = sorted(extra | own)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]}=?)" if close else ""
    raise UsageError(
        f"{path}: open_dataset got an unknown option {name}={hint}; the options for {what} "
        f"are: {', '.join(valid)}"
    )


def _refuse_streaming_options(path, options) -> None:
    """A streamed tar option given to a map-style dataset names the way to stream."""
    stream = _stream_options()
    given = [k for k in options if k in stream]
    if given:
        raise UsageError(
            f"{path}: {', '.join(given)} apply to streamed tar shards: pass map_style=False "
            "(a map-style dataset is shuffled, seeded and split across ranks by its sampler, "
            "e.g. make_loader(shuffle=True, seed=...) or DistributedSampler)"
        )
