"""pack(): sources, bad input, refusals, determinism, and resuming after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.errors import NotPackedError, SourceError, UsageError
from gpufeed.formats.inplace.tree import scan_source

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]


def test_scan_image_folder_sorted_classes(tmp_path, make_images):
    make_images(tmp_path, {"zebra": 2, "ant": 1, "moth": 3})
    (tmp_path / "README.txt").write_text("not a sample")
    src = scan_source(tmp_path)
    assert src.kind == "imagefolder"
    assert src.classes == ["ant", "moth", "zebra"]
    assert src.labels.tolist() == [0, 1, 1, 1, 2, 2]
    assert src.rel[0] == os.path.join("ant", "img0000.png")


def test_pt_folder_flat_with_sidecar_labels(tmp_path, make_arrays):
    paths = make_arrays(tmp_path, None, count=4, shape=(2, 3), dtype=np.float32, ext=".pt")
    (paths[1].with_suffix(".cls")).write_text("7\n")
    m = gpufeed.pack(tmp_path, tmp_path.parent / "pt.mmap", format="mmap", workers=1, quiet=True)
    assert m["classes"] is None
    assert m["sample"] == {"kind": "array", "dtype": "<f4", "shape": [2, 3]}
    ds = gpufeed.open_dataset(tmp_path.parent / "pt.mmap")
    assert ds.labels.tolist() == [-1, 7, -1, -1]
    for i, p in enumerate(paths):
        assert torch.equal(ds[i][0], torch.load(p, weights_only=True))


def test_list_file_source_relative_paths(tmp_path, make_arrays):
    arrays = make_arrays(tmp_path / "data" / "deep", None, count=3)
    lst = tmp_path / "data" / "train.txt"
    lst.write_text(
        "# path label\n"
        f"deep/{arrays[2].name} 5\n\n"
        f"{arrays[0]} 3\n"  # absolute paths work too
        f"deep/{arrays[1].name} 0\n"
    )
    m = gpufeed.pack(lst, tmp_path / "out", format="hdf5", workers=1, quiet=True)
    assert m["source"]["kind"] == "listfile" and m["count"] == 3
    ds = gpufeed.open_dataset(tmp_path / "out")
    assert ds.labels.tolist() == [5, 3, 0]
    assert np.array_equal(ds[0][0].numpy(), np.load(arrays[2]))
    assert np.array_equal(ds[1][0].numpy(), np.load(arrays[0]))
    assert (tmp_path / "out" / "sources.txt").read_text().splitlines()[
        0
    ] == f"deep/{arrays[2].name}"


def test_list_file_bad_line_is_usage_error(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("a.npy notanint\n")
    with pytest.raises(UsageError, match=r"l.txt:1: expected `path label`"):
        gpufeed.pack(lst, tmp_path / "o", format="hdf5", workers=1, quiet=True)


def _corrupt_tree(tmp_path, make_images, make_arrays):
    root = tmp_path / "src"
    files = make_images(root, {"a": 3, "b": 3}, ext=".jpg")
    bad = files[1]
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    npy = make_arrays(tmp_path / "arr", {"a": 3})
    npy[2].write_bytes(b"\x93NUMPY garbage")
    return root, bad, tmp_path / "arr", npy[2]


@pytest.mark.parametrize("fmt", ["hdf5", "tar"])
def test_corrupt_source_stops_naming_file_and_stays_resumable(
    tmp_path, fmt, make_images, make_arrays
):
    root, bad, arr_root, bad_npy = _corrupt_tree(tmp_path, make_images, make_arrays)
    dest = tmp_path / "out"
    with pytest.raises(SourceError, match=str(bad)):
        gpufeed.pack(root, dest, format=fmt, workers=1, quiet=True, part_size=1)
    assert not dest.exists()
    assert (tmp_path / "out.partial" / "parts" / "part-000000.npz").exists()
    with pytest.raises(NotPackedError, match="unfinished"):
        gpufeed.open_dataset(dest)
    with pytest.raises(SourceError, match=str(bad_npy)):
        gpufeed.pack(arr_root, tmp_path / "o2", format=fmt, workers=1, quiet=True)
    # the user fixes the file, then resumes
    bad.write_bytes((root / "a" / "img0000.jpg").read_bytes())
    m = gpufeed.pack(root, dest, format=fmt, workers=1, quiet=True, part_size=1, resume=True)
    assert m["count"] == 6 and m["skipped"] == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_source_skipped_counted_and_listed(tmp_path, fmt, make_images, make_arrays):
    root, bad, _, _ = _corrupt_tree(tmp_path, make_images, make_arrays)
    dest = tmp_path / "out"
    m = gpufeed.pack(root, dest, format=fmt, workers=1, quiet=True, on_error="skip", part_size=2)
    assert m["count"] == 5
    assert len(m["skipped"]) == 1
    skip = m["skipped"][0]
    assert skip["item"] == 1 and skip["path"] == os.path.join("a", "img0001.jpg")
    assert "truncated" in skip["error"] or "OSError" in skip["error"]
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == 5 and ds.labels.tolist() == [0, 0, 1, 1, 1]
    assert (dest / "sources.txt").read_text().splitlines()[1] == os.path.join("a", "img0002.jpg")
    assert gpufeed.verify(dest).ok


def test_shape_mismatch_is_an_error_naming_the_file(tmp_path, make_arrays):
    make_arrays(tmp_path / "s", None, count=2, shape=(3, 4))
    odd = tmp_path / "s" / "zzz.npy"
    np.save(odd, np.zeros((4, 4), np.uint8))
    with pytest.raises(SourceError, match=r"zzz.npy: sample is 4x4 uint8, but earlier"):
        gpufeed.pack(tmp_path / "s", tmp_path / "o", format="mmap", workers=1, quiet=True)
    m = gpufeed.pack(
        tmp_path / "s",
        tmp_path / "o",
        format="mmap",
        workers=1,
        quiet=True,
        on_error="skip",
        overwrite=True,
    )
    assert m["count"] == 2 and m["skipped"][0]["path"] == "zzz.npy"


def test_raw_images_of_different_sizes_need_resize(tmp_path, make_images):
    make_images(tmp_path / "s", {"a": 2}, size=(10, 10))
    make_images(tmp_path / "s", {"b": 1}, size=(8, 12), seed=3)
    with pytest.raises(SourceError, match="try --encode keep or --resize"):
        gpufeed.pack(
            tmp_path / "s",
            tmp_path / "o",
            format="hdf5",
            encode="raw",
            quiet=True,
            workers=1,
        )
    m = gpufeed.pack(
        tmp_path / "s",
        tmp_path / "o2",
        format="hdf5",
        encode="raw",
        resize="6x7",
        quiet=True,
        workers=1,
    )
    assert m["sample"]["shape"] == [3, 6, 7] and m["count"] == 3


def test_refuses_existing_dest_and_partial(array_folder, tmp_path):
    dest = tmp_path / "d"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    with pytest.raises(UsageError, match="already exists; pass --overwrite"):
        gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    m = gpufeed.pack(array_folder, dest, format="lmdb", workers=1, quiet=True, overwrite=True)
    assert gpufeed.inspect(dest)["format"] == "lmdb" == m["format"]
    assert not (tmp_path / "d.old").exists()
    state = {"gpufeed": "0", "source_digest": "0"}  # an unfinished pack of another run
    (tmp_path / "e.partial").mkdir()
    (tmp_path / "e.partial" / "state.json").write_text(json.dumps(state))
    with pytest.raises(UsageError, match="pass --resume to continue it or --overwrite"):
        gpufeed.pack(array_folder, tmp_path / "e", format="mmap", workers=1, quiet=True)


def test_resume_with_other_options_is_refused(array_folder, tmp_path, make_arrays):
    src = tmp_path / "src"
    make_arrays(src, {"x": 3})
    (src / "x" / "a00001.npy").write_bytes(b"bad")
    with pytest.raises(SourceError):
        gpufeed.pack(src, tmp_path / "o", format="tar", workers=1, quiet=True, part_size=1)
    with pytest.raises(UsageError, match=r"different settings \(format: 'tar' -> 'hdf5'\)"):
        gpufeed.pack(
            src,
            tmp_path / "o",
            format="hdf5",
            workers=1,
            quiet=True,
            part_size=1,
            resume=True,
        )


def test_bad_options_are_usage_errors(array_folder, tmp_path):
    with pytest.raises(UsageError, match="compression applies to hdf5 only"):
        gpufeed.pack(array_folder, tmp_path / "o", format="tar", compression="gzip")
    with pytest.raises(UsageError, match="unknown HDF5 compression"):
        gpufeed.pack(array_folder, tmp_path / "o", format="hdf5", compression="zstd")
    with pytest.raises(UsageError, match="unknown format"):
        gpufeed.pack(array_folder, tmp_path / "o", format="parquet")
    with pytest.raises(UsageError, match="does not exist"):
        gpufeed.pack(tmp_path / "nope", tmp_path / "o", format="hdf5")
    assert not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_is_deterministic_across_part_sizes(jpeg_folder, tmp_path, fmt):
    a = gpufeed.pack(jpeg_folder, tmp_path / "a", format=fmt, workers=1, quiet=True, part_size=3)
    b = gpufeed.pack(jpeg_folder, tmp_path / "b", format=fmt, workers=1, quiet=True, part_size=5)
    assert a == b  # same manifest: same file checksums whatever the staging granularity


def _pack_cmd(src, dest, fmt, *extra):
    return [
        sys.executable,
        "-m",
        "gpufeed.cli",
        "pack",
        str(src),
        str(dest),
        "--format",
        fmt,
        "--workers",
        "1",
        "--part-size",
        "50",
        "--quiet",
        *extra,
    ]


@pytest.fixture(scope="module")
def many_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(5)
    for c in ("p", "q"):
        (root / c).mkdir()
        for i in range(1000):
            np.save(
                root / c / f"{i:04d}.npy",
                rng.integers(0, 256, (2, 3, 3), dtype=np.uint8),
            )
    return root


@pytest.mark.timeout(120)
def test_worker_pool_output_equals_in_process(many_tiny, tmp_path):
    one = gpufeed.pack(many_tiny, tmp_path / "one", format="tar", workers=1, quiet=True)
    two = gpufeed.pack(many_tiny, tmp_path / "two", format="tar", workers=2, quiet=True)
    assert one == two and one["count"] == 2000


@pytest.mark.timeout(120)
def test_default_workers_start_the_pool_only_when_the_probe_says_it_pays(many_tiny, monkeypatch):
    import concurrent.futures

    from gpufeed.write import items, pool

    pools = []

    class RecordingPool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", RecordingPool)
    paths = [str(p) for p in sorted(many_tiny.rglob("*.npy"))][:200]
    opts = items.LoadOptions()
    expected = [items.load_item(p, opts) for p in paths]

    def run():
        return list(pool.ordered_map(paths, opts, 2, measure_total=len(paths)))

    for name in ("WORKER_START_S", "FORK_START_S"):  # starting workers never pays
        monkeypatch.setattr(pool, name, 1e9)
    assert run() == expected and pools == []
    for name in ("WORKER_START_S", "FORK_START_S"):  # always pays, after one item
        monkeypatch.setattr(pool, name, 0.0)
    monkeypatch.setattr(pool, "PROBE_S", 0.0)
    assert run() == expected and pools == [(2,)]
    # an explicit worker count is obeyed without a probe
    assert list(pool.ordered_map(paths, opts, 2)) == expected and len(pools) == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kill_9_then_resume_equals_uninterrupted(many_tiny, tmp_path, python_env, fmt):
    clean = tmp_path / "clean"
    subprocess.run(_pack_cmd(many_tiny, clean, fmt), check=True, env=python_env)
    dest = tmp_path / "dest"
    parts = tmp_path / "dest.partial" / "parts"
    env = {**python_env, "GPUFEED_TEST_SLOW_MS": "1"}
    proc = subprocess.Popen(_pack_cmd(many_tiny, dest, fmt), env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(parts.glob("part-*.npz"))) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(list(parts.glob("part-*.npz")))
    assert 3 <= committed < 40, "the kill must land mid-pack"
    assert not dest.exists()
    with pytest.raises(NotPackedError):
        gpufeed.open_dataset(dest)
    r = subprocess.run(_pack_cmd(many_tiny, dest, fmt, "--resume"), env=python_env)
    assert r.returncode == 0
    a = json.loads((clean / "manifest.json").read_text())
    b = json.loads((dest / "manifest.json").read_text())
    assert a["files"] == b["files"] and a["count"] == b["count"] == 2000
    assert a == b
    assert not (tmp_path / "dest.partial").exists()
    assert gpufeed.verify(dest).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_crash_while_assembling_then_resume_is_identical(jpeg_folder, tmp_path, monkeypatch, fmt):
    from gpufeed.formats import writer_class

    clean = gpufeed.pack(jpeg_folder, tmp_path / "clean", format=fmt, workers=1, quiet=True)
    cls = writer_class(fmt)
    real_add = cls.add
    calls = []

    def dying_add(self, part):
        calls.append(1)
        if len(calls) == 2:  # half-written output in DEST.partial/out
            raise KeyboardInterrupt
        return real_add(self, part)

    monkeypatch.setattr(cls, "add", dying_add)
    dest = tmp_path / "dest"
    with pytest.raises(KeyboardInterrupt):
        gpufeed.pack(jpeg_folder, dest, format=fmt, workers=1, quiet=True, part_size=4)
    assert (tmp_path / "dest.partial" / "out").exists() and not dest.exists()
    monkeypatch.setattr(cls, "add", real_add)
    # the staging granularity differs from the clean run's too: the output must not care
    resumed = gpufeed.pack(
        jpeg_folder, dest, format=fmt, workers=1, quiet=True, part_size=4, resume=True
    )
    assert resumed == clean


def test_resume_after_finished_pack_only_cleans_up(array_folder, tmp_path):
    dest = tmp_path / "d"
    m = gpufeed.pack(array_folder, dest, format="tar", workers=1, quiet=True)
    (tmp_path / "d.partial").mkdir()  # as if killed between the rename and the cleanup
    again = gpufeed.pack(array_folder, dest, format="tar", workers=1, quiet=True, resume=True)
    assert again == m and not (tmp_path / "d.partial").exists()


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_a_source_whose_only_entry_is_skipped_makes_an_empty_pack(tmp_path, fmt, make_images):
    make_images(tmp_path / "elsewhere" / "a", {"": 1})
    (tmp_path / "src").mkdir()
    os.symlink(tmp_path / "elsewhere" / "a", tmp_path / "src" / "cls")  # not followed
    m = gpufeed.pack(tmp_path / "src", tmp_path / "p", format=fmt, on_error="skip", quiet=True)
    assert m["count"] == 0 and [s["path"] for s in m["skipped"]] == ["cls"]
    assert len(gpufeed.open_dataset(tmp_path / "p")) == 0  # tar: an IndexError while writing
    assert gpufeed.verify(tmp_path / "p").problems == []


def _pair(i):
    return {"x": np.full(2, i, dtype=np.int64), "label": i}


def test_the_old_calling_conventions_warn_naming_the_new_function(tmp_path):
    """pack(fn, inputs, DEST) and pack(samples, DEST) still pack in 0.2, as pack_map and
    pack_samples do, with a DeprecationWarning that names the function to call instead."""
    with pytest.warns(DeprecationWarning, match=r"use gpufeed\.pack_map\(fn, inputs, DEST"):
        old_fn = gpufeed.pack(_pair, range(3), tmp_path / "f", "mmap", workers=0, quiet=True)
    new_fn = gpufeed.pack_map(_pair, range(3), tmp_path / "f2", "mmap", workers=0, quiet=True)
    samples = [_pair(i) for i in range(3)]
    with pytest.warns(DeprecationWarning, match=r"use gpufeed\.pack_samples\(samples, DEST"):
        old_samples = gpufeed.pack(samples, tmp_path / "s", format="mmap", quiet=True)
    new_samples = gpufeed.pack_samples(samples, tmp_path / "s2", format="mmap", quiet=True)
    for old, new in ((old_fn, new_fn), (old_samples, new_samples)):
        assert old["count"] == new["count"] == 3 and old["layout"] == new["layout"]
    ds = gpufeed.open_dataset(tmp_path / "s2")
    assert [int(ds[i]["label"]) for i in range(3)] == [0, 1, 2]


def test_pack_of_a_path_takes_the_format_by_position_or_name(array_folder, tmp_path):
    a = gpufeed.pack(array_folder, tmp_path / "a", "tar", workers=1, quiet=True)
    b = gpufeed.pack(array_folder, tmp_path / "b", format="tar", workers=1, quiet=True)
    assert a["format"] == b["format"] == "tar" and a["count"] == b["count"]


def test_pack_says_when_the_image_sizes_vary(tmp_path, make_images):
    # said at the end of the pack, not first as a batch fails to stack (issue 38 item 3)
    make_images(tmp_path / "src", {"a": 3}, size=(82, 71), ext=".jpg")
    make_images(tmp_path / "src", {"b": 3}, size=(40, 60), ext=".png", seed=1)
    lines: list[str] = []
    gpufeed.pack(tmp_path / "src", tmp_path / "p", format="mmap", workers=1, log=lines.append)
    assert any(f"{tmp_path / 'p'}: the images differ in size" in line for line in lines), lines
    lines.clear()
    gpufeed.pack(tmp_path / "src" / "a", tmp_path / "q", format="mmap", workers=1, log=lines.append)
    assert not any("differ in size" in line for line in lines), lines
