"""gpufeed.write.staging: committed parts a resume keeps, and those it reads again (a source
file changed since its part was committed, even with its size and mtime put back)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import SourceError


def _same_size_same_mtime(path, data: bytes) -> None:
    """Rewrite the file with other bytes of the same size, its mtime put back (what cp -p,
    rsync -t or a careful tool leave): only its ctime tells."""
    st = os.stat(path)
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_read_again(tmp_path, make_arrays):
    src = tmp_path / "src"
    paths = make_arrays(src, {"a": 6}, shape=(8,))
    paths[5].write_bytes(b"broken")  # the last part stops the first run
    dest = tmp_path / "d"
    with pytest.raises(SourceError):
        gpufeed.pack(src, dest, format="mmap", workers=1, quiet=True, part_size=2)
    parts = tmp_path / "d.partial" / "parts"
    assert sorted(p.name for p in parts.glob("*.npz")) == ["part-000000.npz", "part-000001.npz"]
    old = np.load(paths[0])
    new = np.full(8, 7, dtype=np.uint8)
    assert not np.array_equal(old, new)
    fresh = tmp_path / "new.npy"
    np.save(fresh, new)
    _same_size_same_mtime(paths[0], fresh.read_bytes())  # in part 0, committed already
    np.save(paths[5], np.zeros(8, dtype=np.uint8))
    lines = []
    gpufeed.pack(src, dest, format="mmap", workers=1, part_size=2, resume=True, log=lines.append)
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert ds[0][0].tolist() == [7] * 8  # the new bytes, not the part staged before
    assert any(
        "a00000.npy: changed since it was read; reading part-000000.npz again" in line
        for line in lines
    ), lines
    assert any(
        "resuming: 1 of 3 part(s) kept (2 of 6 source files" in line and "2 part(s) to read" in line
        for line in lines
    ), lines


def test_a_part_of_an_older_gpufeed_with_size_and_mtime_stamps_is_still_checked(
    tmp_path, make_arrays
):
    """Parts committed before stamps held ctime and inode recorded (size, mtime_ns): kept
    while those match, read again when they do not."""
    src = tmp_path / "src"
    paths = make_arrays(src, {"a": 4}, shape=(8,))
    paths[3].write_bytes(b"broken")
    dest = tmp_path / "d"
    with pytest.raises(SourceError):
        gpufeed.pack(src, dest, format="hdf5", workers=1, quiet=True, part_size=2)
    part = tmp_path / "d.partial" / "parts" / "part-000000.npz"
    with np.load(part) as z:
        arrays = {k: z[k] for k in z.files}
    assert arrays["stamps"].shape == (2, 4)
    arrays["stamps"] = arrays["stamps"][:, :2].copy()  # as an older gpufeed wrote it
    with open(part, "wb") as f:
        np.savez(f, **arrays)
    np.save(paths[3], np.zeros(8, dtype=np.uint8))
    lines = []
    gpufeed.pack(src, dest, format="hdf5", workers=1, part_size=2, resume=True, log=lines.append)
    assert any("resuming: 1 of 2 part(s) kept" in line for line in lines), lines
    assert len(gpufeed.open_dataset(dest, map_style=True)) == 4
