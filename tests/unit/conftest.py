"""Shared fixtures for gpufeed's unit tests: small source trees built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from unit_sources import PYTHON_ENV, ROOT, write_arrays, write_images  # noqa: F401


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


@pytest.fixture(autouse=True)
def _loader_cpus_read_afresh():
    """sysinfo.process_loader_cpus reads the CPUs once per process: a test that patches the
    budget gets its own reading, and leaves none behind for the next test."""
    from gpufeed.system import sysinfo

    sysinfo._process_loader_cpus.cache_clear()
    yield
    sysinfo._process_loader_cpus.cache_clear()
