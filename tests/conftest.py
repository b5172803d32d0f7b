"""Fixtures shared by every host test folder (unit, deploy, bench): source trees and packs
built once per session, the page-cache eviction, the subprocess environment."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from unit_sources import PYTHON_ENV, write_arrays, write_images
from unit_sources import evict as evict_path


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """PNG image folder: classes a (7 images) and b (5), 12x16 RGB."""
    root = tmp_path_factory.mktemp("images")
    write_images(root, {"a": 7, "b": 5})
    return root


@pytest.fixture(scope="session")
def jpeg_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    write_images(root, {"cat": 4, "dog": 6, "eel": 3}, size=(20, 24), ext=".jpg", seed=1)
    return root


@pytest.fixture(scope="session")
def array_folder(tmp_path_factory) -> Path:
    """.npy arrays uint8 [3, 4, 5]: classes x (9) and y (8)."""
    root = tmp_path_factory.mktemp("arrays")
    write_arrays(root, {"x": 9, "y": 8})
    return root


FOLDERS = {"arrays": "array_folder", "jpegs": "jpeg_folder", "images": "image_folder"}


@pytest.fixture(scope="session")
def pack_factory(tmp_path_factory, request):
    """pack_factory(fmt, source="arrays", *, classes=None, shape=None, seed=0, dtype="uint8",
    copy_to=None, **options) -> the pack's path, built once per session per arguments.

    source: "arrays", "jpegs" or "images": the session folder of that name (array_folder...),
    or, with ``classes`` ({name: count}), a tree of its own: .npy arrays of ``shape`` and
    ``dtype``, or images of ``shape`` (H, W). options go to gpufeed.pack (workers=1 and
    quiet=True unless given). The pack is shared: a test that damages it passes ``copy_to``
    (a path of its own) and gets a copy there."""
    import gpufeed

    built: dict[tuple, Path] = {}

    def build(
        fmt,
        source="arrays",
        *,
        classes=None,
        shape=None,
        seed=0,
        dtype="uint8",
        copy_to=None,
        **options,
    ):
        options = {"workers": 1, "quiet": True, **options}
        key = (fmt, source, _frozen(classes), shape, seed, str(np.dtype(dtype)), _frozen(options))
        if key not in built:
            root = tmp_path_factory.mktemp(f"pack-{fmt}")
            src = _source(request, root, source, classes, shape, seed, dtype)
            gpufeed.pack(src, root / f"pack.{fmt}", format=fmt, **options)
            built[key] = root / f"pack.{fmt}"
        if copy_to is None:
            return built[key]
        shutil.copytree(built[key], copy_to)
        return Path(copy_to)

    return build


def _frozen(mapping) -> tuple | None:
    return None if mapping is None else tuple(sorted((k, repr(v)) for k, v in mapping.items()))


def _source(request, root: Path, source: str, classes, shape, seed, dtype) -> Path:
    if source not in FOLDERS:
        raise ValueError(f"pack_factory: source {source!r}, expected one of {sorted(FOLDERS)}")
    if classes is None:
        return request.getfixturevalue(FOLDERS[source])
    src = root / "src"
    if source == "arrays":
        write_arrays(src, classes, shape=shape or (3, 4, 5), seed=seed, dtype=np.dtype(dtype))
    else:
        ext = ".jpg" if source == "jpegs" else ".png"
        write_images(src, classes, size=shape or (12, 16), ext=ext, seed=seed)
    return src


@pytest.fixture()
def evict():
    """evict(path) -> bool: a file's or a folder's pages out of the page cache (gpufeed's
    kept maps of it forgotten first); False where they stay (tmpfs): the test skips."""
    return evict_path


@pytest.fixture()
def python_env() -> dict[str, str]:
    """Environment for subprocesses that import gpufeed from the source tree."""
    return dict(PYTHON_ENV)


@pytest.fixture()
def make_images():
    """write_images(root, {class: count}, size=(H, W), ext=".png", seed=0) -> paths."""
    return write_images


@pytest.fixture()
def make_arrays():
    """write_arrays(root, {class: count} | None, count=, shape=, seed=, dtype=, ext=) -> paths."""
    return write_arrays
