"""gpufeed.formats (the registry): open_reader names a reader option it does not take."""

from __future__ import annotations

import pytest

import gpufeed
from gpufeed.data.map_style import HDF5Dataset, LMDBDataset, MmapDataset
from gpufeed.errors import UsageError
from gpufeed.formats.open import open_reader


@pytest.mark.parametrize(
    "fmt,cls,typo,meant",
    [
        ("hdf5", HDF5Dataset, "use_map", "use_mmap"),
        ("lmdb", LMDBDataset, "read_ahead", "readahead"),
    ],
)
def test_a_reader_option_typo_is_a_usage_error(tmp_path, array_folder, fmt, cls, typo, meant):
    """A dataset class opened directly passed it on to the reader: "LMDBReader.__init__() got
    an unexpected keyword argument"."""
    dest = tmp_path / fmt
    gpufeed.pack(array_folder, dest, format=fmt, workers=1, quiet=True)
    for opening in (lambda: open_reader(dest, **{typo: 1}), lambda: cls(dest, **{typo: 1})):
        with pytest.raises(UsageError, match=rf"{dest}: the {fmt} reader takes no option "):
            opening()
        with pytest.raises(UsageError, match=rf"did you mean {meant}=\?"):
            opening()
    assert len(cls(dest, **{meant: False})) == 17


def test_a_reader_without_options(tmp_path, array_folder):
    dest = tmp_path / "mmap"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    with pytest.raises(UsageError, match="its options: none"):
        MmapDataset(dest, block_size=64)
