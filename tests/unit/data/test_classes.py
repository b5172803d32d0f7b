"""dataset.classes and class_to_idx, the same for every kind of dataset: packs of every
format (map-style and the tar stream), an image folder read in place (torchvision's
ImageFolder names: sorted subfolders), data with no class names (None)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from unit_sources import write_images

import gpufeed

FOLDERS = {"zebra": 2, "ant": 3, "Bee": 1}
NAMES = sorted(FOLDERS)  # torchvision's find_classes: sorted(entry.name for each folder)
TO_IDX = {name: i for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cls") / "imgs"
    write_images(root, FOLDERS)
    return root


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_a_pack_of_a_folder_names_its_classes_in_every_format(folder, tmp_path, fmt):
    dest = tmp_path / fmt
    gpufeed.pack(folder, dest, fmt, workers=1, quiet=True)
    kinds = [True, False] if fmt == "tar" else [True]
    for map_style in kinds:
        ds = gpufeed.open_dataset(dest, map_style=map_style)
        assert ds.classes == NAMES and ds.class_to_idx == TO_IDX
    ds = gpufeed.open_dataset(dest)
    named = [ds.classes[int(label)] for label in ds.labels]
    assert named == ["Bee", "ant", "ant", "ant", "zebra", "zebra"]


def test_an_image_folder_read_in_place_names_its_classes_as_torchvision_does(folder, tmp_path):
    ds = gpufeed.open_dataset(folder, index_dir=tmp_path / "idx")
    assert ds.classes == NAMES and ds.class_to_idx == TO_IDX
    assert [ds.classes[ds[i][1]] for i in (0, 1, 5)] == ["Bee", "ant", "zebra"]


def _shard(path, n: int) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            for ext, data in (("cls", str(i % 2).encode()), ("txt", f"t{i}".encode())):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_data_without_class_names_says_none(tmp_path):
    """WebDataset shards read in place and a Writer's pack without classes= have none."""
    shards = tmp_path / "wds"
    shards.mkdir()
    _shard(shards / "part-0000.tar", 4)
    ds = gpufeed.open_dataset(shards, index_dir=tmp_path / "idx")
    assert ds.classes is None and ds.class_to_idx is None
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, "tar", {"x": "int64[1]", "label": "int"}) as w:
        w.write({"x": np.zeros(1, np.int64), "label": 4})
    for map_style in (True, False):
        ds = gpufeed.open_dataset(dest, map_style=map_style)
        assert ds.classes is None and ds.class_to_idx is None
