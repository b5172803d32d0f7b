"""Data read where it lies, without packing: what ``open_dataset`` and ``gpufeed pack`` try
when a path holds no gpufeed manifest.

- WebDataset tar shards (a folder of .tar files, one .tar, a brace pattern):
  :mod:`gpufeed.formats.inplace.webdataset`, an index cached outside the data.
- An HDF5 file of someone else's, given ``datasets=``: every named dataset holds one row per
  sample (the first dimension); each becomes a field (gpufeed.formats.inplace.hdf5_file).
- An image-folder tree is read by gpufeed.formats.inplace.imagefolder (it lists files as pack does).

This package's own module tells what a path holds; gpufeed.formats.open opens it.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpufeed.formats.spec import MANIFEST_NAME

__all__ = ["DATASETS_EXAMPLE", "dataset_names", "hdf5_needs_datasets", "is_hdf5_file"]

# how datasets= names an HDF5 file's datasets, in every message that asks for it
DATASETS_EXAMPLE = "datasets={'image': '/images', 'label': '/labels'}"


def is_hdf5_file(path: str | os.PathLike) -> bool:
    """A local file with HDF5's signature (h5py.is_hdf5: the superblock, not the suffix)."""
    import h5py  # only when asked: importing this package costs no h5py

    try:
        return os.path.isfile(path) and bool(h5py.is_hdf5(path))
    except (OSError, TypeError, ValueError):
        return False


def dataset_names(f) -> list[str]:
    import h5py

    names: list[str] = []
    f.visititems(lambda k, v: names.append(k) if isinstance(v, h5py.Dataset) else None)
    return names


def hdf5_needs_datasets(path: str | os.PathLike) -> str:
    """What to do with an HDF5 file without a gpufeed manifest: name its datasets (a file of
    someone else's is read only given them: which ones hold a row per sample is not ours to
    guess)."""
    pack = Path(path).parent
    if (pack / MANIFEST_NAME).is_file():
        return f"{path}: a file of the gpufeed pack {pack}; use the pack's folder: {pack}"
    import h5py

    try:
        with h5py.File(path, "r") as f:
            have = [f"/{k} {f[k].dtype}{list(f[k].shape)}" for k in dataset_names(f)[:20]]
    except OSError as e:
        return f"{path}: an HDF5 file without a gpufeed manifest, and not readable: {e}"
    return (
        f"{path}: an HDF5 file without a gpufeed manifest; to read it in place name its "
        f"datasets that hold one row per sample: open_dataset(PATH, {DATASETS_EXAMPLE}), or "
        "`gpufeed pack PATH DEST -f FORMAT --datasets image=/images,label=/labels`; it has: "
        f"{', '.join(have) or 'no datasets'}"
    )
