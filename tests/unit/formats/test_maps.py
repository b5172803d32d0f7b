"""Readers keep their memory maps across datasets in one process (pagecache/maps.py): a pass
that opens the pack again reuses the map, and with it the pages already mapped; a replaced
pack is never read through the old map; the kept maps are bounded."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed.pagecache import maps


@pytest.fixture(autouse=True)
def _no_kept_maps():
    maps.forget_maps()
    yield
    maps.forget_maps()


def _pack(src, dest, fmt):
    gpufeed.pack(src, dest, format=fmt, workers=1, quiet=True)
    return dest


@pytest.mark.parametrize("fmt", ["mmap", "hdf5", "lmdb"])
def test_a_pack_opened_again_reuses_its_map(array_folder, tmp_path, fmt):
    dest = _pack(array_folder, tmp_path / f"ds.{fmt}", fmt)
    first = gpufeed.open_dataset(dest)
    handle = first.reader.handle
    want = first.get_batch([4, 0, 7]).samples
    first.close()
    again = gpufeed.open_dataset(dest)  # the next epoch's or pass's dataset
    assert again.reader.handle is handle
    assert np.array_equal(again.get_batch([4, 0, 7]).samples, want)
    again.close()


@pytest.mark.parametrize("fmt", ["mmap", "hdf5", "lmdb"])
def test_a_replaced_pack_is_read_from_its_new_bytes(make_arrays, tmp_path, fmt):
    dest = tmp_path / f"ds.{fmt}"
    make_arrays(tmp_path / "a", {"x": 6}, seed=1)
    make_arrays(tmp_path / "b", {"x": 6}, seed=2)
    old = gpufeed.open_dataset(_pack(tmp_path / "a", dest, fmt))
    old_batch = old.get_batch([0, 1, 2]).samples.clone()
    old.close()
    shutil.rmtree(dest)
    new = gpufeed.open_dataset(_pack(tmp_path / "b", dest, fmt))
    new_batch = new.get_batch([0, 1, 2]).samples
    fresh = gpufeed.open_dataset(dest, **({"use_mmap": False} if fmt == "hdf5" else {}))
    assert not np.array_equal(new_batch, old_batch)
    assert np.array_equal(new_batch, fresh.get_batch([0, 1, 2]).samples)
    new.close()
    fresh.close()


def test_kept_maps_are_bounded_and_forgotten(make_arrays, tmp_path):
    make_arrays(tmp_path / "src", {"x": 3})
    for k in range(maps.KEEP_MAPS + 3):
        ds = gpufeed.open_dataset(_pack(tmp_path / "src", tmp_path / f"ds{k}", "mmap"))
        ds.get_batch([0])
        ds.close()
    kept = maps.kept_maps()
    assert len(kept) == maps.KEEP_MAPS
    assert str(tmp_path / f"ds{maps.KEEP_MAPS + 2}" / "samples.npy") == kept[-1]
    maps.forget_maps(kept[-1])
    assert kept[-1] not in maps.kept_maps() and len(maps.kept_maps()) == maps.KEEP_MAPS - 1


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
def test_forgetting_the_maps_maps_anew(array_folder, tmp_path, fmt):
    """What a cold pass needs: pages a process keeps mapped cannot be evicted."""
    dest = _pack(array_folder, tmp_path / f"ds.{fmt}", fmt)
    first = gpufeed.open_dataset(dest)
    handle = first.reader.handle
    first.close()
    maps.forget_maps(dest / ("samples.npy" if fmt == "mmap" else "data.mdb"))
    again = gpufeed.open_dataset(dest)
    assert again.reader.handle is not handle
    again.close()


def _deleted_files_mapped(folder: Path) -> list[str]:
    """Files under ``folder`` this process still maps though they were deleted: disk space
    that is not freed until the maps go."""
    with open("/proc/self/maps") as f:
        lines = [line.rstrip("\n") for line in f]
    return [line for line in lines if str(folder) in line and line.endswith("(deleted)")]


@pytest.mark.parametrize("fmt", ["mmap", "hdf5", "lmdb"])
@pytest.mark.parametrize("how", ["pack", "writer"])
def test_overwriting_a_pack_drops_its_kept_maps(make_arrays, tmp_path, fmt, how):
    dest = tmp_path / f"ds.{fmt}"
    make_arrays(tmp_path / "a", {"x": 6}, seed=1)
    make_arrays(tmp_path / "b", {"x": 6}, seed=2)
    old = gpufeed.open_dataset(_pack(tmp_path / "a", dest, fmt))
    old.get_batch([0, 1, 2])
    old.close()
    del old
    if how == "pack":
        gpufeed.pack(tmp_path / "b", dest, format=fmt, workers=1, quiet=True, overwrite=True)
    else:
        with gpufeed.Writer(dest, format=fmt, overwrite=True, quiet=True) as w:
            w.write({"x": np.arange(4.0)})
    assert _deleted_files_mapped(tmp_path) == []
    assert not [p for p in maps.kept_maps() if maps.covers(p, dest)]
