"""A tar pack whose count was not known while its shards were written (a Writer's samples,
a folder's skipped files) is cut again when it closes by copying its samples' bytes into the
default cut (TarWriter.recut): no sample is read back from its part or encoded again, the
files are those of a pack made knowing the count (a resumed Writer's, assembled from its
parts; a folder's without the skipped files), and a crash at any point of the re-cut leaves
a pack that resumes to the same files."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import gpufeed
import gpufeed.write.assemble as assemble_module
import gpufeed.write.direct as direct_module
from gpufeed.formats.tar.fields import PartMembers

sys.path.insert(0, str(Path(__file__).parent))
from test_tar_bytes import SCHEMA, _files, make  # noqa: E402

OPTS = {"format": "tar", "schema": SCHEMA, "part_size": 64}
N = 400


def _resumed(dest: Path, n: int, **opts) -> dict[str, bytes]:
    """A Writer stopped after three parts and resumed: its pack assembled from its parts,
    cut knowing the count (what a pack cut again must be, byte for byte)."""
    with pytest.raises(RuntimeError), gpufeed.Writer(dest, **opts) as w:
        for i in range(3 * opts["part_size"]):
            w.write(make(i) if opts["schema"] is SCHEMA else _small(i))
        raise RuntimeError("stopped after three committed parts")
    with gpufeed.Writer(dest, resume=True, **opts) as w:
        assert w.written == 3 * opts["part_size"]
        for i in range(w.written, n):
            w.write(make(i) if opts["schema"] is SCHEMA else _small(i))
    return _files(dest)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    return _resumed(tmp_path_factory.mktemp("ref") / "p", N, **OPTS)


@pytest.fixture()
def built(monkeypatch) -> list[int]:
    """Samples whose tar members were built (encoded), one entry a run; reading a sample
    back from the streamed shards (what writing the pack again from its parts does) fails."""
    runs: list[int] = []
    build = PartMembers.build

    def counted(self, a, b, first_key):
        runs.append(b - a)
        return build(self, a, b, first_key)

    def refused(*args, **kwargs):
        raise AssertionError("a sample was read back from the streamed shards")

    monkeypatch.setattr(PartMembers, "build", counted)
    monkeypatch.setattr(direct_module, "_from_shards", refused)
    monkeypatch.setattr(assemble_module, "load_part", refused)
    return runs


def test_a_writer_pack_is_cut_again_encoding_each_sample_once(tmp_path, reference, built):
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, **OPTS) as w:
        for i in range(N):
            w.write(make(i))
    assert sum(built) == N  # each sample's members built once: while it was written
    assert w.manifest["layout"]["shard_counts"] == [64] * 6 + [16]  # not the stream's [400]
    assert w.manifest["layout"]["shard_size"] == 64
    assert _files(dest) == reference
    assert not (tmp_path / "p.partial").exists()
    assert gpufeed.verify(dest).ok  # the manifest's sha256 are the shards' (made as copied)
    ds = gpufeed.open_dataset(dest, map_style=True)
    for i in (0, 63, 64, 200, 399):
        assert ds[i]["text"] == make(i)["text"] and ds[i]["label"] == i - 50
        np.testing.assert_array_equal(ds[i]["tokens"], make(i)["tokens"])


@pytest.mark.parametrize("how", ["missing", "refused", "half"])
def test_shards_are_copied_the_same_without_copy_file_range(tmp_path, reference, monkeypatch, how):
    """Where copy_file_range is missing or refuses (another system or file system), or copies
    part of a range and then refuses, the rest is written from the bytes read for the hash."""
    calls: list[int] = []
    real = os.copy_file_range

    def half(src, dst, count, offset_src):
        calls.append(count)
        if len(calls) % 2:
            return real(src, dst, count // 2, offset_src)
        raise OSError(errno.EXDEV, "cross-device")

    if how == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        refuse = OSError(errno.ENOSYS, "no copy_file_range")
        monkeypatch.setattr(os, "copy_file_range", half if how == "half" else _raise(refuse))
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, **OPTS) as w:
        for i in range(N):
            w.write(make(i))
    assert _files(dest) == reference
    assert how != "half" or len(calls) >= 2 * 7  # every new shard's ranges went through it


def _raise(error: OSError):
    def refuse(*args, **kwargs):
        raise error

    return refuse


def test_a_failed_copy_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """copy_file_range failing for the disk (not for the files) fails the close, not falls
    back to writing; the parts and the shards they name stay for a resume, which this
    process can start at once (the failed close released the lock)."""
    monkeypatch.setattr(os, "copy_file_range", _raise(OSError(errno.EIO, "I/O error")))
    dest = tmp_path / "p"
    with pytest.raises(OSError, match="I/O error"), gpufeed.Writer(dest, **OPTS) as w:
        for i in range(N):
            w.write(make(i))
    # a close that failed released the pack's lock: the resume below, in this process, goes on
    assert os.listdir(tmp_path / "p.partial" / "streamed") == ["shard-000000.tar"]
    monkeypatch.undo()
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        assert w.written == N
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == N and ds[399]["text"] == make(399)["text"]


SMALL = {"raw": "bytes", "label": "int"}


def _small(i: int) -> dict:
    """1 KiB samples (2.5 KiB in a shard), every 150th one 80 KiB: shards of 75 samples that
    shard_bytes cuts short where a large one falls."""
    return {"raw": bytes([i % 251]) * (80_000 if i % 150 == 5 else 1024), "label": i}


def test_the_byte_bound_cuts_the_same_when_cut_again(tmp_path, built, monkeypatch):
    opts = {"format": "tar", "schema": SMALL, "part_size": 100, "shard_bytes": 250_000}
    n = 1200
    fresh = tmp_path / "fresh"
    with gpufeed.Writer(fresh, **opts) as w:
        for i in range(n):
            w.write(_small(i))
    assert sum(built) == n
    counts = w.manifest["layout"]["shard_counts"]
    assert max(counts) == 75  # ceil(1200 / 16), and some shards cut short by their bytes
    assert min(counts[:-1]) < 75 and sum(counts) == n
    monkeypatch.undo()  # the resumed pack reads its samples back from its parts
    assert _files(fresh) == _resumed(tmp_path / "resumed", n, **opts)


def _image(ext: str, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((6, 5, 3), shade, np.uint8)).save(buf, format=ext)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["images", "arrays"])
def test_a_folder_pack_with_skipped_files_is_that_of_the_folder_without_them(
    tmp_path, kind, built, monkeypatch
):
    """1,100 files, 100 of them broken and skipped: the stream cut for 1,100 (69 a shard),
    the pack is cut again for 1,000 (64 a shard): the files of a pack of the good ones."""
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    for i in range(1100):
        cls = f"c{i % 3}"
        name = f"{i:05d}.npy" if kind == "arrays" else f"{i:05d}.{('jpg', 'png')[i // 50 % 2]}"
        if kind == "arrays":
            buf = io.BytesIO()
            np.save(buf, np.full(4, i % 256, np.uint8))
            data = buf.getvalue() if i % 11 != 5 else buf.getvalue()[:40]  # cut short
        else:
            data = _image(("JPEG", "PNG")[i // 50 % 2], i % 256)
            data = data if i % 11 != 5 else b"not an image"
        for root in (broken, *([clean] if i % 11 != 5 else [])):
            (root / cls).mkdir(parents=True, exist_ok=True)
            (root / cls / name).write_bytes(data)
    opts = {"format": "tar", "workers": 1, "quiet": True, "on_error": "skip"}
    m = gpufeed.pack(broken, tmp_path / "a", **opts)
    assert m["count"] == 1000 and len(m["skipped"]) == 100
    assert m["layout"]["shard_counts"] == [64] * 15 + [40]
    assert sum(built) == 1000  # no sample encoded twice
    monkeypatch.undo()
    gpufeed.pack(clean, tmp_path / "b", **opts)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import gpufeed
import gpufeed.write.assemble as A
from gpufeed.formats.tar.writer import TarWriter
from test_tar_bytes import SCHEMA, make

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

where = {where!r}
if where == "recut":  # out/ moved to streamed/, the new out/ made, nothing copied
    TarWriter.recut = die
elif where == "copying":  # in the middle of the copy: three new shards started
    start = TarWriter._start_shard
    def counted(self):
        if getattr(self, "recutting", False) and len(self.names) == 3:
            die()
        start(self)
    recut = TarWriter.recut
    def marked(self, written):
        self.recutting = True
        recut(self, written)
    TarWriter._start_shard, TarWriter.recut = counted, marked
elif where == "swap":  # every file of the new cut and the manifest written, not renamed
    A.swap_into_place = die
with gpufeed.Writer({dest!r}, format="tar", schema=SCHEMA, part_size=64) as w:
    for i in range({n}):
        w.write(make(i))
"""


@pytest.mark.parametrize("where", ["recut", "copying", "swap"])
def test_a_writer_killed_while_cutting_again_resumes_to_the_same_files(
    tmp_path, python_env, reference, where
):
    dest = tmp_path / "p"
    script = KILLED.format(tests=str(Path(__file__).parent), dest=str(dest), where=where, n=N)
    proc = subprocess.run([sys.executable, "-c", script], env=python_env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    partial = tmp_path / "p.partial"
    assert not dest.exists()
    # the stream's one shard of 400 samples, kept aside for the parts
    assert os.listdir(partial / "streamed") == ["shard-000000.tar"]
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        assert w.written == N  # every committed part kept
    assert _files(dest) == reference
    assert not partial.exists()
