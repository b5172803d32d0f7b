"""Shared fixtures for gpufeed's unit tests: small source trees built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "app" / "src")}


def write_images(root: Path, classes: dict[str, int], size=(12, 16), ext=".png", seed=0):
    """class name -> count images of random pixels (H x W = size); returns sorted paths."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for name, count in classes.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            p = d / f"img{i:04d}{ext}"
            options = {"quality": 90} if ext == ".jpg" else {}
            Image.fromarray(pixels).save(p, **options)
            paths.append(p)
    return sorted(paths)


def write_arrays(
    root: Path,
    classes: dict[str, int] | None,
    count=0,
    shape=(3, 4, 5),
    seed=0,
    dtype=np.uint8,
    ext=".npy",
):
    """.npy (or .pt) files of random values, in class subfolders or flat; returns paths."""
    rng = np.random.default_rng(seed)
    paths = []
    groups = classes.items() if classes else [("", count)]
    for name, n in groups:
        d = root / name if name else root
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            arr = (rng.random(shape) * 250).astype(dtype)
            p = d / f"a{i:05d}{ext}"
            if ext == ".pt":
                import torch

                torch.save(torch.from_numpy(arr), p)
            else:
                np.save(p, arr)
            paths.append(p)
    return sorted(paths)


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
