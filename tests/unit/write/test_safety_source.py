"""Data safety at the source: folders that cannot be read, symbolic links (loops, second ways
to the same files), file names sources.txt must hold, and 16-bit images. Nothing is dropped,
duplicated or changed silently: an error naming the path, or a listed skip."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from faults import run_gpufeed
from PIL import Image

import gpufeed
from gpufeed.errors import SourceError


def manifest(dest):
    return json.loads((dest / "manifest.json").read_text())


# ------------------------------------------------------------------------ unreadable folders
@pytest.fixture()
def locked_source(tmp_path, make_images):
    """Classes a, b, c (2 images each) and a/deeper (1): b and a/deeper unreadable."""
    src = tmp_path / "src"
    make_images(src, {"a": 2, "b": 2, "c": 2, "a/deeper": 1})
    locked = [src / "b", src / "a" / "deeper"]
    for d in locked:
        d.chmod(0)
    yield src
    for d in locked:
        d.chmod(0o755)


def test_an_unreadable_folder_is_an_error_naming_it(locked_source, tmp_path):
    r = run_gpufeed("pack", locked_source, tmp_path / "d", "-f", "tar", "-j", "1", without_dac=True)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "2 problem(s) listing the source" in r.stderr
    assert "b: cannot read folder: Permission denied" in r.stderr
    assert f"a{os.sep}deeper: cannot read folder" in r.stderr
    assert not (tmp_path / "d").exists()


def test_unreadable_folders_skipped_are_listed_and_keep_class_indices(locked_source, tmp_path):
    dest = tmp_path / "d"
    r = run_gpufeed(
        "pack", locked_source, dest, "-f", "tar", "-j", "1", "--on-error", "skip",
        without_dac=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = manifest(dest)
    assert m["classes"] == ["a", "b", "c"]  # b stays a class: c is still label 2
    assert m["count"] == 4
    assert sorted(s["path"] for s in m["skipped"]) == [os.path.join("a", "deeper"), "b"]
    assert all(s["item"] is None for s in m["skipped"])
    assert gpufeed.open_dataset(dest, map_style=True).labels.tolist() == [0, 0, 2, 2]
    assert "skipped 2" in r.stdout


# ------------------------------------------------------------------------ symbolic links
@pytest.fixture()
def linked_source(tmp_path, make_images):
    src = tmp_path / "src"
    make_images(src, {"cls": 3, "other": 2})
    (src / "cls" / "self").symlink_to(".")  # a loop: cls/self/self/...
    return src


def test_a_link_to_a_folder_is_not_followed_by_default(linked_source, tmp_path):
    with pytest.raises(SourceError, match=r"cls/self: symbolic link to a folder: not followed"):
        gpufeed.pack(linked_source, tmp_path / "d", format="tar", workers=1, quiet=True)
    m = gpufeed.pack(
        linked_source, tmp_path / "d", format="tar", workers=1, quiet=True, on_error="skip"
    )
    assert m["count"] == 5  # not 5x duplicated
    assert [s["path"] for s in m["skipped"]] == [os.path.join("cls", "self")]


def test_following_links_detects_loops_and_second_links(linked_source, tmp_path):
    (linked_source / "other" / "again").symlink_to(linked_source / "cls")
    with pytest.raises(SourceError, match="a folder listed already") as e:
        gpufeed.pack(linked_source, tmp_path / "d", format="tar", workers=1, follow_symlinks=True)
    assert "cls/self" in str(e.value) and "other/again" in str(e.value)
    m = gpufeed.pack(
        linked_source,
        tmp_path / "d",
        format="tar",
        workers=1,
        quiet=True,
        on_error="skip",
        follow_symlinks=True,
    )
    assert m["count"] == 5 and len(m["skipped"]) == 2
    assert m["options"]["follow_symlinks"] is True


@pytest.mark.timeout(60)
def test_two_links_forming_a_loop_end_at_once(tmp_path, make_images):
    src = tmp_path / "src"
    make_images(src, {"a": 1, "b": 1})
    (src / "a" / "to_b").symlink_to(src / "b")
    (src / "b" / "to_a").symlink_to(src / "a")
    r = run_gpufeed("pack", src, tmp_path / "d", "-f", "tar", "-j", "1", timeout=30)
    assert r.returncode == 1 and "a/to_b: symbolic link to a folder: not followed" in r.stderr
    r = run_gpufeed(
        "pack", src, tmp_path / "d", "-f", "tar", "-j", "1", "--follow-symlinks",
        "--on-error", "skip", timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = manifest(tmp_path / "d")
    assert m["count"] == 2 and len(m["skipped"]) == 2


def test_a_followed_link_to_a_folder_packs_its_files_once(tmp_path, make_images):
    elsewhere = tmp_path / "elsewhere"
    make_images(elsewhere, {"x": 2})
    src = tmp_path / "src"
    make_images(src, {"a": 1})
    (src / "linked").symlink_to(elsewhere / "x")
    m = gpufeed.pack(src, tmp_path / "d", format="tar", workers=1, follow_symlinks=True)
    assert m["classes"] == ["a", "linked"] and m["count"] == 3 and m["skipped"] == []


def test_a_second_way_to_a_file_is_reported_once_kept_once(tmp_path, make_images):
    src = tmp_path / "src"
    make_images(src, {"a": 2})
    (src / "a" / "dup.png").symlink_to(src / "a" / "img0001.png")
    with pytest.raises(SourceError, match=r"a/dup.png: reaches a/img0001.png again"):
        gpufeed.pack(src, tmp_path / "d", format="tar", workers=1)
    m = gpufeed.pack(src, tmp_path / "d", format="tar", workers=1, quiet=True, on_error="skip")
    assert m["count"] == 2 and [s["path"] for s in m["skipped"]] == ["a/dup.png"]


# ------------------------------------------------------------------------ file names
def test_a_name_that_is_not_utf8_is_kept_byte_for_byte(tmp_path, make_images):
    src = tmp_path / "src"
    make_images(src, {"a": 2})
    odd = os.fsdecode(b"caf\xe9.png")  # Latin-1, not UTF-8
    os.rename(src / "a" / "img0001.png", src / "a" / odd)
    dest = tmp_path / "d"
    r = run_gpufeed("pack", src, dest, "-f", "hdf5", "-j", "1")
    assert r.returncode == 0, r.stderr
    assert (dest / "sources.txt").read_bytes().splitlines()[0] == b"a/caf\xe9.png"
    reader = gpufeed.open_dataset(dest).reader
    assert reader.sources() == [os.path.join("a", odd), os.path.join("a", "img0000.png")]
    assert gpufeed.verify(dest).ok


def test_a_name_with_a_line_break_is_refused_up_front(tmp_path, make_images):
    src = tmp_path / "src"
    make_images(src, {"a": 3})
    os.rename(src / "a" / "img0001.png", src / "a" / "two\nlines.png")
    with pytest.raises(SourceError, match="file name holds a line break"):
        gpufeed.pack(src, tmp_path / "d", format="tar", workers=1)
    assert not (tmp_path / "d.partial").exists()  # refused before anything was read
    m = gpufeed.pack(src, tmp_path / "d", format="tar", workers=1, quiet=True, on_error="skip")
    lines = (tmp_path / "d" / "sources.txt").read_text().splitlines()
    assert len(lines) == m["count"] == 2 and m["skipped"][0]["path"] == "a/two\nlines.png"


# ------------------------------------------------------------------------ 16-bit images
def png16(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(values.astype(np.uint16)).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I;16")
    return buf.getvalue()


@pytest.fixture()
def deep_png(tmp_path):
    """A 16-bit grey gradient (0..65535) and an 8-bit RGB image of the same size."""
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    ramp = np.linspace(0, 65535, 32 * 32).round().reshape(32, 32)
    (src / "deep.png").write_bytes(png16(ramp))
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(src / "flat.png")
    expected = np.round(ramp * 255 / 65535).astype(np.uint8)
    return tmp_path / "src", expected


def test_16bit_png_raw_is_scaled_not_clipped(deep_png, tmp_path):
    src, expected = deep_png
    gpufeed.pack(src, tmp_path / "d", format="mmap", encode="raw", workers=1, quiet=True)
    stored = gpufeed.open_dataset(tmp_path / "d")[0][0].numpy()
    assert stored.dtype == np.uint8 and stored.shape == (3, 32, 32)
    assert np.abs(stored[0].astype(int) - expected).max() <= 1
    assert (stored == 255).mean() < 0.01  # clipping made 99.6% of the pixels white


def test_16bit_png_kept_decodes_to_uint8_and_batches_stack(deep_png, tmp_path):
    src, expected = deep_png
    gpufeed.pack(src, tmp_path / "d", format="hdf5", workers=1, quiet=True)
    samples = gpufeed.open_dataset(tmp_path / "d").get_batch([0, 1]).samples
    assert not isinstance(samples, list), "mixed dtypes made the batch a list"
    assert samples.dtype == torch.uint8 and samples.shape == (2, 3, 32, 32)
    assert np.abs(samples[0, 0].numpy().astype(int) - expected).max() <= 1


def test_pixels_with_no_8bit_reading_are_refused_naming_the_file(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    Image.fromarray(np.full((4, 4), 1e6, np.float32)).save(src / "float.tif")
    with pytest.raises(SourceError, match=r"float.tif: ValueError: floating-point pixels"):
        gpufeed.pack(tmp_path / "src", tmp_path / "d", format="tar", encode="raw", workers=1)


def test_uint16_tensors_from_torchvision_are_scaled_to_uint8():
    from gpufeed.pixels import tensor_to_uint8

    decoded = torch.tensor([[0, 128, 257, 32896, 65535]], dtype=torch.uint16)  # decode_png's
    assert tensor_to_uint8(decoded).tolist() == [[0, 0, 1, 128, 255]]
    assert tensor_to_uint8(decoded).dtype == torch.uint8
