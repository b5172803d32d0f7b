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


# Slow tests in files that other work had open when the marker came in: marked here until their
# files carry @pytest.mark.slow themselves (make test-quick leaves them out either way).
SLOW_ELSEWHERE = {
    "tests/unit/data/test_mixture.py::test_the_plain_dataloader_sees_set_epoch",
    "tests/unit/data/test_tokens.py::test_the_tutorial_dataloader",
    "tests/unit/formats/test_parquet.py::test_dataloader_every_row_once",
    "tests/unit/formats/test_warm_epoch.py::test_a_reader_looks_warm_once_read_and_cold_once_evicted",
    "tests/unit/formats/test_warm_epoch.py::test_make_loader_announces_blocks_only_in_epochs_that_are_not_warm",
    "tests/unit/integrations/test_ray.py::test_pack_sink_writes_every_row_once_in_order",
    "tests/unit/loading/test_loader.py::test_plan_is_readable_and_round_trips_as_settings",
    "tests/unit/loading/test_loader_gpufeed.py::test_map_style_packs_with_auto_workers_and_resume",
    "tests/unit/data/test_mixture.py::test_a_mixture_of_token_windows_through_make_loader",
    "tests/unit/formats/test_parquet.py::test_arrow_offsets_past_their_buffer_are_an_error",
    "tests/unit/integrations/test_ray.py::test_a_retried_write_task_leaves_no_duplicate_or_missing_sample",
    "tests/unit/loading/test_loader.py::test_plan_measured_once_per_pack_read_the_same_way",
    "tests/unit/loading/test_loader_gpufeed.py::test_tar_shards_split_over_workers_every_sample_once_and_resume",
    "tests/unit/test_deploy_pack_array.py::test_array_tasks_pack_their_slices_and_the_last_step_merges",
    "tests/unit/write/test_pack.py::test_kill_9_then_resume_equals_uninterrupted",
    "tests/unit/write/test_pack_samples.py::test_a_generator_of_large_samples_is_packed_in_bounded_memory",
    "tests/unit/loading/test_loader.py::test_tar_stream_plan_measured_once_per_pack_not_per_seed",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)


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
