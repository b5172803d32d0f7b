"""What inspect and verify know of data read in place (an image folder, WebDataset shards, an
HDF5 file given datasets=): the reader open_dataset reads it with, its cached index, its
files, and each sample decoded with the field (and tar member or dataset) named when it fails.
Such data has no manifest: no sha256 of its files, no crc32 of its samples to check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError
from gpufeed.formats.base import Reader
from gpufeed.formats.inplace import webdataset as wds
from gpufeed.formats.inplace.imagefolder import ImageFolderReader, is_image_folder, listing_path
from gpufeed.formats.inplace.parquet import ParquetReader, is_parquet
from gpufeed.storage.parquet_remote import open_parquet_at
from gpufeed.storage.urls import is_remote

__all__ = [
    "IN_PLACE_CHECKS",
    "KINDS",
    "data_files",
    "decode_problem",
    "describe",
    "files_size",
    "no_checksums",
    "open_in_place_reader",
]

# reader format -> what the data is, in words
KINDS = {
    "imagefolder": "image folder",
    "webdataset": "WebDataset shards",
    "hdf5-file": "HDF5 file",
    "parquet": "Parquet or Arrow files",
}
# what verify checks of data read in place
IN_PLACE_CHECKS = ["every sample read", "every sample decoded"]
# where the labels of each kind come from
LABELS = {
    "imagefolder": "class folders",
    "webdataset": "the cls member",
    "hdf5-file": "the label dataset",
    "parquet": "the label column",
}


def no_checksums(format_name: str) -> str:
    """What verify cannot check here, and how to get it checked."""
    return (
        f"no checksums to check: data read in place ({KINDS[format_name]}) has none; "
        "`gpufeed pack` it for sha256 and crc32 checks"
    )


def open_in_place_reader(
    path: str | os.PathLike, datasets=None, index_dir=None
) -> tuple[Reader, dict[str, str] | None] | None:
    """open_dataset's reader of `path` without a manifest (its choice: an image folder unless
    datasets= is given, an HDF5 file given datasets=, WebDataset shards), and its cached index
    ({"path", "status"}: status cached, built, rebuilt, or not saved where the index folder
    cannot be written; None for an HDF5 file or Parquet, read by their own layout). None: it
    is none."""
    if datasets is not None:
        from gpufeed.formats.inplace.hdf5_file import HDF5FileReader  # h5py, imported when needed

        return HDF5FileReader(path, datasets=datasets), None
    if is_remote(path):  # Parquet or Arrow objects in storage (no manifest there)
        return open_parquet_at(path), None
    if is_parquet(path):  # before the image folder: a DatasetDict's splits are no classes
        return ParquetReader(path), None
    where = wds.index_folder(index_dir)
    if is_image_folder(path):
        make, cached = ImageFolderReader, listing_path(Path(path).absolute(), where)
    elif wds.is_webdataset(path):
        make, cached = wds.WebDatasetReader, wds.index_path(wds.expand_shards(path), where)
    else:
        return None
    before = _stamp(cached)
    reader = make(path, index_dir=index_dir)
    return reader, {"path": str(cached), "status": _index_status(before, _stamp(cached))}


def _stamp(path: Path) -> tuple[int, int] | None:
    """The cached index file's identity (an index written anew is a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _index_status(before, after) -> str:
    if after is None:
        return "not saved"
    if before is None:
        return "built"
    return "cached" if before == after else "rebuilt"


def data_files(reader: Reader) -> list[str]:
    """The files the samples are read from: each image of a folder, the shards, the file."""
    if isinstance(reader, ImageFolderReader):
        return [reader.location(i) for i in range(reader.count)]
    return reader.data_files()


def files_size(paths: list[str]) -> tuple[int, int]:
    """(bytes of content, bytes allocated on disk) of these files (followed, as read)."""
    content = allocated = 0
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue  # verify names a file gone since it was listed
        content += st.st_size
        allocated += getattr(st, "st_blocks", 0) * 512
    return content, allocated


def describe(reader: Reader, index: dict[str, str] | None) -> dict[str, Any]:
    """inspect's keys that data read in place has (the pack's keys where they mean the same)."""
    classes = reader.manifest.get("classes")
    files = data_files(reader)
    content, allocated = files_size(files)
    source = getattr(reader, "source", None)
    if source is not None and hasattr(source, "size"):  # objects in storage: as listed
        content = sum(source.size(k) for k in range(len(files)))
    has_labels = bool(len(reader.labels)) and bool((reader.labels >= 0).any())
    info: dict[str, Any] = {
        "format": reader.format_name,
        "kind": KINDS[reader.format_name],
        "in_place": True,
        "count": reader.count,
        "classes": classes,
        "num_classes": len(classes) if classes is not None else None,
        "labels": LABELS[reader.format_name] if has_labels else None,
        "size_bytes": content,
        "disk_bytes": allocated,
        "files": len(files),
        "index": index,
        "checks": list(IN_PLACE_CHECKS),
        "checksums": False,
    }
    if reader.count:
        info["bytes_per_sample"] = round(content / reader.count, 1)
    layout = reader.manifest.get("layout", {})
    if reader.format_name == "webdataset":
        info["shards"] = len(files)
        info["dropped"] = layout.get("dropped", [])
    if reader.format_name == "hdf5-file":
        info["datasets"] = layout.get("datasets")
    return info


def decode_problem(reader: Reader, index: int, payload) -> str | None:
    """Why sample `index` (its payload as read) does not decode, naming the field and its tar
    member or HDF5 dataset; None when it decodes."""
    if reader.spec.kind != "fields":
        from gpufeed.data.decoders import decode_bytes

        try:
            decode_bytes(payload)
        except Exception as e:  # noqa: BLE001 - any decoder failure is the finding
            return _cannot_decode(e)
        return None
    from gpufeed.data.decoders import decode_image
    from gpufeed.formats.record import decode_value, split_record

    fields = reader.spec.schema.fields
    try:
        stored = split_record(reader.spec.schema, payload)
    except ValueError as e:
        return f"cannot decode: {e}"
    for j, (field, data) in enumerate(zip(fields, stored, strict=True)):
        try:
            value = decode_value(field, data)
            if field.type == "image":
                decode_image(value)
        except Exception as e:  # noqa: BLE001
            return f"{_field_place(reader, index, j)}: {_cannot_decode(e)}"
    return None


def _cannot_decode(e: Exception) -> str:
    if type(e).__name__ == "UnidentifiedImageError":  # PIL's text names a BytesIO object
        return "cannot decode: not an image torchvision or PIL reads (UnidentifiedImageError)"
    return f"cannot decode: {e}"


def _field_place(reader: Reader, index: int, j: int) -> str:
    """Field j of sample `index`: its tar member or HDF5 dataset, named."""
    name = reader.spec.schema.fields[j].name
    if isinstance(reader, wds.WebDatasetReader):
        try:
            return f"member {reader.member_name(index, j)!r} (field {name!r})"
        except (OSError, DataError):  # the shard is gone or changed: the field still named
            pass
    datasets = reader.manifest.get("layout", {}).get("datasets")
    if isinstance(datasets, dict) and name in datasets:
        return f"dataset {datasets[name]!r} (field {name!r})"
    return f"field {name!r}"
