"""An image-folder tree read in place (gpufeed.formats.inplace.imagefolder): the cached listing
is used only for the very folders it came from, the listing's problems and symbolic links are
refused as `gpufeed pack` refuses them, and a file changed since the listing is never another
sample."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from faults import DROP_DAC, ROOT_USER
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import DataError, SourceError, StalePackError, UnsafePathError


def folder_times(root) -> dict[str, tuple[int, int]]:
    return {
        os.path.relpath(d, root): (os.stat(d).st_atime_ns, os.stat(d).st_mtime_ns)
        for d, _, _ in os.walk(root)
    }


def test_a_new_tree_with_the_old_folder_mtimes_is_listed_again(tmp_path, make_images):
    """What `cp -rp`, `rsync -t` or unpacking an archive give: other files, the same folder
    mtimes. The old listing (10 images) served 6 of them with no warning."""
    root = tmp_path / "imgs"
    make_images(root, {"a": 5, "b": 5})
    idx = tmp_path / "idx"
    assert len(gpufeed.open_dataset(root, index_dir=idx)) == 10
    times = folder_times(root)
    time.sleep(0.05)  # ctime has a coarse tick: the new tree's must fall in a later one
    os.rename(root, tmp_path / "old")
    make_images(root, {"a": 3, "b": 3}, seed=7)
    for name in ("img0000.png", "img0001.png", "img0002.png"):
        os.rename(root / "b" / name, root / "b" / f"new-{name}")
    for rel, (atime, mtime) in times.items():
        os.utime(root / rel, ns=(atime, mtime))
    assert {k: m for k, (_, m) in folder_times(root).items()} == {
        k: m for k, (_, m) in times.items()
    }

    ds = gpufeed.open_dataset(root, index_dir=idx)
    assert len(ds) == 6
    assert ds.reader.sources()[3:] == [os.path.join("b", f"new-img000{i}.png") for i in range(3)]
    assert [ds[i][1] for i in range(6)] == [0, 0, 0, 1, 1, 1]


def test_a_file_gone_since_the_listing_is_an_error_naming_it(tmp_path, make_images):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2, "b": 2})
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    (root / "b" / "img0001.png").unlink()
    with pytest.raises(StalePackError, match=r"b/img0001.png: sample 3: gone since the tree"):
        ds[3]
    assert len(gpufeed.open_dataset(root, index_dir=tmp_path / "idx")) == 3


@pytest.fixture()
def secret(tmp_path, make_images):
    """An image outside the tree (standing for ~/.ssh/id_rsa: anything the user can read)."""
    (path,) = make_images(tmp_path / "outside", {"s": 1}, seed=3)
    return path


def test_a_file_link_leaving_the_tree_is_refused_unless_asked(tmp_path, make_images, secret):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2, "b": 2})
    (root / "a" / "key.png").symlink_to(secret)
    idx = tmp_path / "idx"
    with pytest.raises(UnsafePathError, match=r"a/key.png: symbolic link to .*outside") as err:
        gpufeed.open_dataset(root, index_dir=idx)
    assert str(secret) in str(err.value) and "follow_symlinks=True" in str(err.value)

    ds = gpufeed.open_dataset(root, index_dir=idx, follow_symlinks=True)
    assert len(ds) == 5
    i = ds.reader.sources().index(os.path.join("a", "key.png"))
    assert ds.reader.read_batch(np.array([i]))[0] == secret.read_bytes()
    with pytest.raises(UnsafePathError):  # the followed listing is cached apart
        gpufeed.open_dataset(root, index_dir=idx)


def test_gpufeed_pack_applies_the_same_link_policy(tmp_path, make_images, secret):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2})
    (root / "a" / "key.png").symlink_to(secret)
    with pytest.raises(SourceError, match=r"a/key.png: symbolic link to .*outside the source"):
        gpufeed.pack(root, tmp_path / "d", format="tar", workers=1, quiet=True)
    m = gpufeed.pack(
        root, tmp_path / "d", format="tar", workers=1, quiet=True, follow_symlinks=True
    )
    assert m["count"] == 3
    (root / "a" / "inside.png").symlink_to(root / "a" / "img0000.png")  # a second way: a problem
    (root / "a" / "key.png").unlink()
    with pytest.raises(SourceError, match="reaches a/img0000.png again"):
        gpufeed.open_dataset(root, index_dir=tmp_path / "idx")


def test_a_file_swapped_for_a_link_after_the_listing_is_not_read(tmp_path, make_images, secret):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2})
    ds = gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    (root / "a" / "img0001.png").unlink()
    (root / "a" / "img0001.png").symlink_to(secret)
    with pytest.raises(DataError, match=r"a/img0001.png: now a symbolic link to .*outside"):
        ds.reader.read_batch(np.array([1]))
    with pytest.raises(DataError, match="now a symbolic link"):
        ds[1]


def test_broken_links_and_folder_links_are_refused_as_pack_refuses_them(tmp_path, make_images):
    """In place they gave a class with 0 samples and dropped files silently."""
    root = tmp_path / "imgs"
    make_images(root, {"a": 2, "c": 1})
    make_images(tmp_path / "elsewhere", {"x": 2})
    (root / "b").symlink_to(tmp_path / "elsewhere" / "x")
    (root / "a" / "gone.png").symlink_to(tmp_path / "missing.png")
    with pytest.raises(SourceError) as packing:
        gpufeed.pack(root, tmp_path / "d", format="tar", workers=1, quiet=True)
    with pytest.raises(SourceError) as in_place:
        gpufeed.open_dataset(root, index_dir=tmp_path / "idx")
    for err in (packing, in_place):
        assert f"{root}: 2 problem(s) listing the source" in str(err.value)
        assert "a/gone.png: broken symbolic link" in str(err.value)
        assert "b: symbolic link to a folder: not followed" in str(err.value)
    assert "gpufeed pack --on-error skip" in str(in_place.value)
    with pytest.raises(SourceError, match="1 problem"):  # still the broken link
        gpufeed.open_dataset(root, index_dir=tmp_path / "idx2", follow_symlinks=True)


@pytest.mark.slow
@pytest.mark.skipif(ROOT_USER and not __import__("shutil").which("setpriv"), reason="setpriv")
def test_an_unreadable_class_folder_is_refused_naming_it(tmp_path, make_images):
    root = tmp_path / "imgs"
    make_images(root, {"a": 2, "b": 2, "c": 2})
    (root / "b").chmod(0)
    code = (
        "import sys, gpufeed\n"
        "try:\n"
        f"    gpufeed.open_dataset({str(root)!r}, index_dir={str(tmp_path / 'idx')!r})\n"
        "except gpufeed.errors.SourceError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    cmd = [sys.executable, "-c", code]
    try:
        r = subprocess.run(
            (DROP_DAC if ROOT_USER else []) + cmd,
            env=PYTHON_ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        (root / "b").chmod(0o755)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "1 problem(s) listing the source: b: cannot read folder: Permission denied" in r.stdout
