"""gpufeed.data.open: open_dataset's signature, and every option it cannot take named as a
UsageError with the closest valid one (never a reader's TypeError)."""

from __future__ import annotations

import inspect

import h5py
import numpy as np
import pytest

from gpufeed.data import open as open_mod
from gpufeed.data.map_style import PackedDataset
from gpufeed.data.open import open_dataset
from gpufeed.data.streaming import TarShardDataset
from gpufeed.data.tokens import TokenWindows
from gpufeed.errors import UsageError


@pytest.fixture(scope="module")
def packs(pack_factory):
    return {fmt: pack_factory(fmt) for fmt in ("hdf5", "lmdb", "tar", "mmap")}


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_a_typo_is_named_with_the_closest_option(packs, fmt):
    """transfrom= was "LMDBReader.__init__() got an unexpected keyword argument"."""
    with pytest.raises(UsageError) as e:
        open_dataset(packs[fmt], transfrom=lambda x: x)
    message = str(e.value)
    assert message.startswith(f"{packs[fmt]}: open_dataset got an unknown option transfrom=")
    assert "did you mean transform=?" in message
    assert f"the options for a {fmt} pack are: " in message and "on_error" in message


def test_the_reader_options_of_each_format_are_listed_and_taken(packs):
    with pytest.raises(UsageError, match=r"did you mean use_mmap=\?.*rdcc_mb"):
        open_dataset(packs["hdf5"], use_map=False)
    with pytest.raises(UsageError, match=r"did you mean readahead=\?"):
        open_dataset(packs["lmdb"], read_ahead=False)
    with pytest.raises(UsageError, match="unknown option readahead="):  # lmdb's, not mmap's
        open_dataset(packs["mmap"], readahead=False)
    assert len(open_dataset(packs["hdf5"], use_mmap=False, rdcc_mb=8)) == 17
    assert len(open_dataset(packs["lmdb"], readahead=False)) == 17


def test_block_size_on_a_pack_of_no_token_field_says_what_it_reads(packs, tmp_path):
    for path in (packs["mmap"], packs["tar"]):
        with pytest.raises(UsageError, match="block_size= reads token documents") as e:
            open_dataset(path, block_size=128)
        assert str(path) in str(e.value) and "uint16[-1]" in str(e.value)
    with pytest.raises(UsageError, match="eos= apply to token windows: give block_size="):
        open_dataset(packs["mmap"], eos=0)
    with pytest.raises(UsageError, match="transform= do not apply to token windows"):
        open_dataset(packs["mmap"], block_size=8, transform=abs)
    with pytest.raises(UsageError, match="block_size= reads a gpufeed token pack"):
        open_dataset(tmp_path, block_size=8)


def test_streamed_tar_options(packs):
    with pytest.raises(UsageError, match=r"did you mean shuffle_buffer=\?.*streamed tar pack"):
        open_dataset(packs["tar"], map_style=False, shufle_buffer=4)
    with pytest.raises(UsageError, match="apply to streamed tar shards: pass map_style=False"):
        open_dataset(packs["tar"], shuffle_buffer=4)
    with pytest.raises(UsageError, match="map_style=False streams tar shards only"):
        open_dataset(packs["hdf5"], map_style=False)
    ds = open_dataset(packs["tar"], map_style=False, shuffle_buffer=0, seed=3)
    assert isinstance(ds, TarShardDataset) and ds.shuffle_buffer == 0 and ds.seed == 3


def test_in_place_options_on_a_pack_and_pack_options_in_place(packs, tmp_path, image_folder):
    with pytest.raises(UsageError, match="index_dir= apply to data read in place"):
        open_dataset(packs["mmap"], index_dir=tmp_path)
    with pytest.raises(UsageError, match=r"unknown option use_mmap=.*image folder read in place"):
        open_dataset(image_folder, use_mmap=True, index_dir=tmp_path / "idx")
    with pytest.raises(UsageError, match="map_style=False streams gpufeed tar packs only"):
        open_dataset(image_folder, map_style=False, index_dir=tmp_path / "idx")
    assert len(open_dataset(image_folder, index_dir=tmp_path / "idx")) > 0


def test_an_hdf5_file_read_in_place_refuses_unknown_options(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((4, 2), np.float32)
        f["y"] = np.arange(4)
    datasets = {"x": "/x", "y": "/y"}
    with pytest.raises(UsageError, match=r"unknown option dataset=.*did you mean datasets="):
        open_dataset(path, dataset=datasets)
    assert len(open_dataset(path, datasets=datasets)) == 4


def test_the_signature_is_real_and_its_defaults_are_the_datasets():
    """help() and IDEs show the options; their defaults are the datasets' own."""
    sig = inspect.signature(open_dataset)
    own = {n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert own == open_mod.PACK_OPTIONS | open_mod.IN_PLACE_OPTIONS | open_mod.TOKEN_OPTIONS
    assert "Args:" in open_dataset.__doc__ and "transform:" in open_dataset.__doc__
    for cls in (PackedDataset, TarShardDataset):
        theirs = inspect.signature(cls.__init__).parameters
        for name in open_mod.COMMON_OPTIONS - {"map_style"}:
            assert sig.parameters[name].default == theirs[name].default, (cls, name)
    theirs = inspect.signature(TokenWindows.__init__).parameters
    for name in open_mod.TOKEN_OPTIONS - {"block_size"}:
        assert sig.parameters[name].default == theirs[name].default, name


def test_a_hugging_face_dataset_dict_is_not_taken_for_an_image_folder(tmp_path):
    """Its split folders looked like class folders: "not an image folder to read in place"."""
    import json

    from gpufeed.errors import NotPackedError

    root = tmp_path / "dd"
    for split in ("train", "test"):
        folder = root / split
        folder.mkdir(parents=True)
        (folder / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff" + b"\0" * 60)
        (folder / "dataset_info.json").write_text("{}")
        (folder / "state.json").write_text(json.dumps({"_data_files": []}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(NotPackedError, match=rf"{root}: a Hugging Face datasets folder"):
        open_dataset(root)
