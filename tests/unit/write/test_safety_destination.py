"""Data safety at the destination: --overwrite replaces only packs gpufeed made (never the
source, the working folder or anything else), one packer per destination (the lock), and
resuming a pack whose last run was cut short at any point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from faults import gpufeed_cmd, run_gpufeed, wait_for
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import SourceError, UsageError


def tree(root):
    """Every file under root with its bytes: what must survive a refused overwrite."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture()
def victim(tmp_path, make_images):
    """A folder of JPEGs in classes plus an unrelated README: someone's data."""
    root = tmp_path / "victim"
    make_images(root, {"cat": 3, "dog": 2}, ext=".jpg")
    (root / "README").write_text("my notes\n")
    return root


def test_overwrite_refuses_the_source_itself(victim):
    before = tree(victim)
    r = run_gpufeed("pack", victim, victim, "-f", "tar", "--overwrite", "-j", "1")
    assert r.returncode == 2, r.stderr
    assert "it is the source" in r.stderr and "packed" not in r.stdout
    assert tree(victim) == before


def test_overwrite_refuses_the_working_folder(victim, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")
    r = run_gpufeed("pack", victim, ".", "-f", "tar", "--overwrite", "-j", "1", cwd=work)
    assert r.returncode == 2, r.stderr
    assert "current folder" in r.stderr
    assert tree(work) == {"train.py": b"print('hi')\n"}


@pytest.mark.parametrize("where", ["unrelated", "holds_source", "inside_source"])
def test_overwrite_refuses_what_is_not_a_pack_of_ours(victim, tmp_path, where):
    dest = {
        "unrelated": tmp_path / "photos",
        "holds_source": tmp_path,
        "inside_source": victim / "cat",
    }[where]
    if where == "unrelated":
        dest.mkdir()
        (dest / "holiday.jpg").write_bytes(b"not ours")
    before = tree(tmp_path)
    with pytest.raises(UsageError, match="refusing to replace it|cannot pack into it") as e:
        gpufeed.pack(victim, dest, format="tar", workers=1, quiet=True, overwrite=True)
    reason = {
        "unrelated": "not a gpufeed pack",
        "holds_source": "holds the source",
        "inside_source": "inside the source folder",
    }[where]
    assert str(dest) in str(e.value) and reason in str(e.value)
    assert tree(tmp_path) == before
    assert not (dest.parent / (dest.name + ".partial")).exists()


def test_a_pack_inside_its_source_is_refused_even_without_overwrite(victim):
    with pytest.raises(UsageError, match="inside the source folder"):
        gpufeed.pack(victim, victim / "packed", format="mmap", workers=1, quiet=True)
    assert not (victim / "packed").exists() and not (victim / "packed.partial").exists()


def test_overwrite_replaces_our_pack_and_nothing_beside_it(victim, tmp_path):
    dest = tmp_path / "d"
    gpufeed.pack(victim, dest, format="tar", workers=1, quiet=True)
    (tmp_path / "d.old").mkdir()  # a user's folder that happens to have the old name
    (tmp_path / "d.old" / "keep.txt").write_text("mine")
    m = gpufeed.pack(victim, dest, format="mmap", workers=1, quiet=True, overwrite=True)
    assert m["format"] == "mmap" == gpufeed.inspect(dest)["format"]
    assert (tmp_path / "d.old" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "d.old", "victim"]


def test_overwrite_refuses_a_foreign_partial_and_a_symlinked_dest(victim, tmp_path):
    (tmp_path / "d.partial").mkdir()
    (tmp_path / "d.partial" / "thesis.tex").write_text("years of work")
    with pytest.raises(UsageError, match=r"d.partial: refusing to start the pack over"):
        gpufeed.pack(victim, tmp_path / "d", format="tar", workers=1, quiet=True, overwrite=True)
    assert (tmp_path / "d.partial" / "thesis.tex").read_text() == "years of work"
    assert sorted(os.listdir(tmp_path / "d.partial")) == ["thesis.tex"]  # no lock file left
    ours = tmp_path / "ours"
    gpufeed.pack(victim, ours, format="tar", workers=1, quiet=True)
    (tmp_path / "link").symlink_to(ours)
    with pytest.raises(UsageError, match="symbolic link"):
        gpufeed.pack(victim, tmp_path / "link", format="tar", workers=1, overwrite=True)
    assert gpufeed.verify(ours).ok


def test_existing_foreign_dest_is_named_as_not_ours(victim, tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"mine")
    with pytest.raises(UsageError, match="already exists and is not a gpufeed pack"):
        gpufeed.pack(victim, tmp_path / "photos", format="tar", workers=1, quiet=True)
    with pytest.raises(UsageError, match="already exists and is not a gpufeed pack"):
        gpufeed.pack(victim, tmp_path / "photos", format="tar", workers=1, resume=True)
    assert os.listdir(tmp_path / "photos") == ["a.jpg"]
    assert not (tmp_path / "photos.partial").exists()


def test_an_empty_dest_folder_is_packed_into(victim, tmp_path):
    (tmp_path / "made_by_hand").mkdir()
    m = gpufeed.pack(victim, tmp_path / "made_by_hand", format="tar", workers=1, quiet=True)
    assert gpufeed.inspect(tmp_path / "made_by_hand")["count"] == m["count"] == 5


# ------------------------------------------------------------------------------ the lock
@pytest.fixture()
def slow_source(tmp_path, make_arrays):
    make_arrays(tmp_path / "src", {"a": 30, "b": 30}, shape=(64,))
    return tmp_path / "src"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_packer_into_the_same_dest_is_refused(slow_source, tmp_path):
    dest = tmp_path / "d"
    parts = tmp_path / "d.partial" / "parts"
    args = ["pack", slow_source, dest, "-f", "lmdb", "-j", "1", "--part-size", "4"]
    env = {**PYTHON_ENV, "GPUFEED_TEST_SLOW_MS": "20"}
    first = subprocess.Popen(
        gpufeed_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert wait_for(lambda: list(parts.glob("part-*.npz")), 60), "no part committed"
        first.send_signal(signal.SIGSTOP)  # mid-pack for as long as the checks take
        for extra in (["--resume"], [], ["--overwrite"]):
            second = run_gpufeed(*args, *extra)
            assert second.returncode == 2, second.stderr
            assert f"(pid {first.pid}) is writing it now" in second.stderr
            assert "--resume" not in second.stderr  # no invitation to race
        busy = run_gpufeed("verify", dest)
        assert busy.returncode == 1 and "is writing it now" in busy.stderr
        assert "--resume" not in busy.stderr
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=90)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert gpufeed.verify(dest).ok and gpufeed.inspect(dest)["count"] == 60
    assert not (tmp_path / "d.partial").exists()


def test_a_dest_in_a_folder_not_made_yet_is_made(array_folder, tmp_path):
    m = gpufeed.pack(array_folder, tmp_path / "new" / "deeper" / "d", format="tar", workers=1)
    assert m["count"] == 17 and sorted(os.listdir(tmp_path / "new" / "deeper")) == ["d"]


def test_the_lock_is_taken_in_process_too(array_folder, tmp_path):
    from gpufeed.formats.lock import PackLock

    dest = tmp_path / "d"
    partial = tmp_path / "d.partial"
    with PackLock(dest, partial):
        with pytest.raises(UsageError, match=f"pid {os.getpid()}"):
            with PackLock(dest, partial):
                pass
    m = gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    assert m["count"] == 17 and not partial.exists()


# ------------------------------------------------------------------------------ resume
def test_resume_after_only_dest_is_left_reports_it_finished(array_folder, tmp_path):
    dest = tmp_path / "d"
    m = gpufeed.pack(array_folder, dest, format="hdf5", workers=1, quiet=True)
    # killed after the rename and after deleting DEST.partial, before saying "packed"
    r = run_gpufeed("pack", array_folder, dest, "-f", "hdf5", "--resume", "-j", "1")
    assert r.returncode == 0, r.stderr
    assert "already complete" in r.stderr and "packed 17 samples" in r.stdout
    assert json.loads((dest / "manifest.json").read_text()) == m
    r = run_gpufeed("pack", array_folder, dest, "-f", "tar", "--resume", "-j", "1")
    assert r.returncode == 2 and "other settings" in r.stderr


def test_a_source_file_changed_before_resume_is_read_again(tmp_path, make_arrays):
    src = tmp_path / "src"
    paths = make_arrays(src, {"a": 6}, shape=(8,))
    paths[5].write_bytes(b"broken")  # the last part stops the first run
    with pytest.raises(SourceError):
        gpufeed.pack(src, tmp_path / "d", format="mmap", workers=1, quiet=True, part_size=2)
    assert len(list((tmp_path / "d.partial" / "parts").glob("*.npz"))) == 2
    time.sleep(0.01)  # a new mtime even on coarse clocks
    np.save(paths[0], np.full(8, 7, dtype=np.uint8))  # in part 0, committed already
    np.save(paths[5], np.zeros(8, dtype=np.uint8))
    lines = []
    gpufeed.pack(
        src, tmp_path / "d", format="mmap", workers=1, part_size=2, resume=True, log=lines.append
    )
    ds = gpufeed.open_dataset(tmp_path / "d")
    assert ds[0][0].tolist() == [7] * 8
    assert any("a00000.npy: changed since it was read" in line for line in lines), lines


# ------------------------------------------------------------------------------ synth
def test_synth_overwrite_replaces_only_what_synth_made(tmp_path):
    from gpufeed.tools.synth import synth_image_folder

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "holiday.jpg").write_bytes(b"mine")
    with pytest.raises(UsageError, match="photos: refusing to replace it.*gpufeed synth made"):
        synth_image_folder(photos, count=4, classes=2, size=16, workers=1, overwrite=True)
    assert tree(photos) == {"holiday.jpg": b"mine"}
    made = tmp_path / "made"
    synth_image_folder(made, count=4, classes=2, size=16, workers=1)
    again = synth_image_folder(made, count=6, classes=3, size=16, workers=1, overwrite=True)
    assert again["count"] == len(list(made.rglob("*.jpg"))) == 6


def test_synth_clears_only_its_own_leftover_partial(tmp_path):
    from gpufeed.tools.synth import CLASS_NAMES, synth_image_folder

    (tmp_path / "a.partial").mkdir()
    (tmp_path / "a.partial" / "notes.txt").write_text("not synth's")
    with pytest.raises(UsageError, match="a.partial: refusing to start over"):
        synth_image_folder(tmp_path / "a", count=4, classes=2, size=16, workers=1)
    assert (tmp_path / "a.partial" / "notes.txt").read_text() == "not synth's"
    crashed = tmp_path / "b.partial" / CLASS_NAMES[0]  # what a crash mid-synth leaves
    crashed.mkdir(parents=True)
    (crashed / "000000.jpg").write_bytes(b"half")
    info = synth_image_folder(tmp_path / "b", count=4, classes=2, size=16, workers=1)
    assert info["count"] == 4 and not (tmp_path / "b.partial").exists()
