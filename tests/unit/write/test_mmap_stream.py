"""A fresh mmap (.npy) or uncompressed HDF5 pack is written as its parts are committed
(assemble.Stream): each part's bytes appended by pwrite to encoded.npy or samples.npy (the
.npy header rewritten in place for the final count when it closes), or to data.h5 at the
offset of its dataset's storage (the metadata copied around them when it closes); the part
saved without them (Part.where:
marker, file offset, size). The files are those the pack assembled from its parts has, byte
for byte; a kill at any point resumes to a pack that verifies; a part naming bytes outside
the file is redone; a full disk is an error naming the file."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import gpufeed
import gpufeed.write.assemble as assemble_module
from gpufeed.errors import DiskFullError
from gpufeed.formats.appended import STREAMED_HDF5
from gpufeed.formats.manifest import read_manifest
from gpufeed.formats.mmap.writer import STREAMED_MMAP
from gpufeed.formats.parts import Part
from gpufeed.tools.verify import verify
from gpufeed.write.direct import check_part, keep_streamed, load_part

SCHEMA = {"x": "uint8[-1]", "label": "int"}
OPTS = {"format": "mmap", "schema": SCHEMA, "part_size": 16}
N = 100
# the file each format streams into, in DEST.partial/out/ (streamed/ once kept aside)
STREAMED = {"mmap": "out/encoded.npy", "hdf5": "out/data.h5"}
KEPT = {"mmap": "streamed/encoded.npy", "hdf5": "streamed/data.h5"}
MARKER = {"mmap": STREAMED_MMAP, "hdf5": STREAMED_HDF5}


@pytest.fixture(params=["mmap", "hdf5"])
def fmt(request, monkeypatch):
    """Each streamed contiguous format, made OPTS's (and the child processes')."""
    monkeypatch.setitem(OPTS, "format", request.param)
    return request.param


def sample(i: int) -> dict:
    return {"x": (np.arange(i % 37, dtype=np.uint8) + i).astype(np.uint8), "label": i}


def _write(dest: Path, n: int = N) -> dict:
    with gpufeed.Writer(dest, **OPTS) as w:
        for i in range(n):
            w.write(sample(i))
    return w.manifest


def _files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.name != "manifest.json"}


def _manifest(dest: Path) -> dict:
    m = read_manifest(dest)
    m.pop("created_by", None)
    return m


def _check(dest: Path, n: int = N) -> None:
    """The pack verifies and holds every sample once, in order."""
    report = verify(dest)
    assert report.ok, report.problems
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == n
    for i in range(n):
        np.testing.assert_array_equal(ds[i]["x"].numpy(), sample(i)["x"])
    np.testing.assert_array_equal(ds.labels, np.arange(n))


@pytest.fixture()
def assembled(monkeypatch):
    """Packs made the old way: no stream, every part assembled into a memmap at close."""

    def make(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(assemble_module, "streams", lambda state: False)
            return fn(*args, **kwargs)

    return make


def test_a_streamed_writer_pack_is_the_assembled_one(tmp_path, fmt, assembled, monkeypatch):
    old = tmp_path / "old"
    assembled(_write, old)

    def refused(*args, **kwargs):
        raise AssertionError("a streamed pack read a part back")

    monkeypatch.setattr(assemble_module, "load_part", refused)
    saved, save = [], Part.save

    def kept(self, *args, **kwargs):
        saved.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Part, "save", kept)
    import gpufeed.formats.hdf5 as hdf5

    copied, copy = [], hdf5.copy_range
    monkeypatch.setattr(hdf5, "copy_range", lambda *a: (copied.append(a[2]), copy(*a))[1])
    new = tmp_path / "new"
    _write(new)
    assert OPTS["format"] == fmt
    # HDF5: only the metadata copied around the samples (their storage was where predicted)
    assert len(copied) == (2 if fmt == "hdf5" else 0)
    if fmt == "hdf5":
        with h5py.File(new / "data.h5") as f:
            samples = f["encoded"].shape[0]
        assert sum(copied) == os.path.getsize(new / "data.h5") - samples
    # every part but the last (close's flush keeps its payload) names its bytes in the file
    assert len(saved) == 7 and saved[-1].where is None
    assert all(p.where is not None and p.where[0, 0] == MARKER[fmt] for p in saved[:-1])
    assert all(len(p.arrays()["payload"]) == 0 for p in saved[:-1])
    assert _files(new) == _files(old)
    assert _manifest(new) == _manifest(old)
    assert sorted(os.listdir(new)) == sorted(os.listdir(old))  # no probe or file made aside
    if fmt == "mmap":
        data = np.load(new / "encoded.npy", mmap_mode="r")  # the header written for the end
        assert data.shape == (int(np.load(new / "offsets.npy")[-1]),)
        assert data.offset + data.shape[0] == os.path.getsize(new / "encoded.npy") > 4096
    _check(new)


def test_a_streamed_array_pack_is_the_assembled_one(tmp_path, fmt, assembled):
    from unit_sources import write_arrays

    src = tmp_path / "src"
    write_arrays(src, {"a": 30, "b": 25}, shape=(3, 5), dtype=np.float32)
    opts = {"format": fmt, "quiet": True, "workers": 0, "part_size": 8}
    assembled(gpufeed.pack, src, tmp_path / "old", **opts)
    gpufeed.pack(src, tmp_path / "new", **opts)
    assert _files(tmp_path / "new") == _files(tmp_path / "old")
    assert _manifest(tmp_path / "new") == _manifest(tmp_path / "old")
    ds = gpufeed.open_dataset(tmp_path / "new", map_style=True)
    assert len(ds) == 55 and tuple(ds[54][0].shape) == (3, 5)
    if fmt == "mmap":
        samples = np.load(tmp_path / "new" / "samples.npy")
        assert samples.shape == (55, 3, 5) and samples.dtype == np.float32
    assert verify(tmp_path / "new").ok


def test_a_flushed_part_keeps_its_payload(tmp_path):
    dest = tmp_path / "p"
    with gpufeed.Writer(dest, **OPTS) as w:
        for i in range(5):
            w.write(sample(i))
        w.flush()  # durable: the part holds its bytes, whatever the stream holds
        part = Part.load(dest.with_name("p.partial") / "parts" / "part-000000.npz")
        assert part.where is None and len(part.payload) == int(part.offsets[-1]) > 0
    _check(dest, 5)


def _stopped(dest: Path, n: int) -> Path:
    """A Writer of ``n`` samples in parts of 16, left by an error: DEST.partial, its
    streamed file kept aside as a resume keeps it."""
    with pytest.raises(RuntimeError), gpufeed.Writer(dest, **OPTS) as w:
        for i in range(n):
            w.write(sample(i))
        raise RuntimeError("stopped")
    partial = dest.with_name(dest.name + ".partial")
    keep_streamed(partial)
    return partial


@pytest.mark.parametrize(
    "crafted", ["past the end", "before the data", "a negative size", "a start that wraps"]
)
def test_a_part_naming_bytes_outside_the_file_is_refused_and_redone(tmp_path, fmt, crafted):
    dest = tmp_path / "p"
    partial = _stopped(dest, 64)
    path = partial / "parts" / "part-000002.npz"
    part = Part.load(path)
    size = os.path.getsize(partial / KEPT[fmt])
    if crafted == "past the end":  # its last byte one past the file's end
        part.where[1, 1] = size - part.where[1, 2] + 1
    elif crafted == "before the data":  # mmap: inside the .npy header
        part.where[0, 1] = 10 if fmt == "mmap" else -1
    elif crafted == "a start that wraps":  # start + size past int64: negative, if summed
        part.where[1, 1] = np.iinfo(np.int64).max - int(part.where[1, 2]) + 2
    else:
        part.where[0, 2] = -1
    part.save(path)
    with pytest.raises(ValueError, match=KEPT[fmt]):
        load_part(path, partial)
    assert check_part(path, partial) is None
    assert check_part(partial / "parts" / "part-000001.npz", partial) is not None
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        assert w.written == 32  # the crafted part and those after it written again
        for i in range(w.written, N):
            w.write(sample(i))
    _check(dest)


def test_flipped_bytes_in_the_streamed_file_redo_the_part(tmp_path, fmt):
    dest = tmp_path / "p"
    partial = _stopped(dest, 64)
    part = Part.load(partial / "parts" / "part-000001.npz")
    with open(partial / KEPT[fmt], "r+b") as f:
        f.seek(int(part.where[3, 1]))
        f.write(b"\xff")
    assert check_part(partial / "parts" / "part-000001.npz", partial) is None
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        assert w.written == 16
        for i in range(w.written, N):
            w.write(sample(i))
    _check(dest)


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import gpufeed
import gpufeed.write.assemble as A
import gpufeed.formats.hdf5 as H
from gpufeed.formats.appended import AppendedFile
from gpufeed.formats.parts import Part
from test_mmap_stream import OPTS, sample
OPTS["format"] = {fmt!r}

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

where = {where!r}
if where == "part":  # the fourth part's bytes in encoded.npy, the part not saved
    save, saved = Part.save, []
    def counted(self, *a, **k):
        saved.append(1)
        if len(saved) == 4:
            die()
        save(self, *a, **k)
    Part.save = counted
elif where == "finish":  # the header rewritten and the file cut to its size, not fsynced
    finish = AppendedFile.finish
    def killed(self, head, hashed=True):
        os.pwrite(self.fd, head, 0)
        os.ftruncate(self.fd, self.end)
        die()
    AppendedFile.finish = killed
    H.copy_range = die  # HDF5: the file made aside and closed, its metadata not yet copied
elif where == "swap":  # every file and the manifest written, not renamed into place
    A.swap_into_place = die
with gpufeed.Writer({dest!r}, **OPTS) as w:
    for i in range({n}):
        w.write(sample(i))
"""


@pytest.mark.parametrize("where", ["part", "finish", "swap"])
def test_a_killed_writer_resumes_to_a_pack_that_verifies(
    tmp_path, python_env, fmt, assembled, where
):
    dest = tmp_path / "p"
    tests = str(Path(__file__).parent)
    script = KILLED.format(tests=tests, dest=str(dest), where=where, n=N, fmt=fmt)
    proc = subprocess.run([sys.executable, "-c", script], env=python_env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists()
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        assert w.written == (48 if where == "part" else N)
        for i in range(w.written, N):
            w.write(sample(i))
    _check(dest)
    assert not dest.with_name("p.partial").exists()
    assembled(_write, tmp_path / "ref")
    assert _files(dest) == _files(tmp_path / "ref")


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("call", ["preallocate", "pwrite"])
def test_a_full_disk_is_an_error_naming_the_file_and_the_pack_resumes(
    tmp_path, fmt, monkeypatch, call
):
    """The third reservation (room reserved a part at a time) or the third write of the
    streamed file (the room kept for the .npy header or HDF5's metadata, then a part's each)
    finds the disk full."""
    import gpufeed.formats.appended as appended

    dest, calls = tmp_path / "p", []
    real = getattr(appended if call == "preallocate" else appended.os, call)

    def full_from_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            return real(*args, **kwargs)
        if call == "pwrite":
            return _no_space()
        with monkeypatch.context() as m:  # the real preallocate, on a disk with no room
            m.setattr(os, "posix_fallocate", _no_space)
            return real(*args, **kwargs)

    with monkeypatch.context() as m:
        if call == "preallocate":
            m.setattr(appended, "RESERVE_STEP", 1)
            m.setattr(appended, "preallocate", full_from_the_third)
        else:
            m.setattr(appended.os, "pwrite", full_from_the_third)
        named = r"p\.partial/" + STREAMED[fmt].replace(".", r"\.")
        with pytest.raises(DiskFullError, match=named):
            _write(dest)
    with gpufeed.Writer(dest, resume=True, **OPTS) as w:
        # the parts in the file before the disk filled
        assert w.written == 16
        for i in range(w.written, N):
            w.write(sample(i))
    _check(dest)


def test_streamed_packs_merge(tmp_path, fmt):
    _write(tmp_path / "a", n=40)
    with gpufeed.Writer(tmp_path / "b", **OPTS) as w:
        for i in range(40, N):
            w.write(sample(i))
    gpufeed.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    _check(tmp_path / "m")


def test_a_part_out_of_order_stops_the_stream_and_the_parts_fed_are_read_back(tmp_path, fmt):
    """A stream stopped after some parts (one came out of order) keeps its file where the
    parts that name it are read back from, and the pack is assembled from the parts."""
    from gpufeed.write.assemble import Stream

    dest = tmp_path / "p"
    partial = _stopped(dest, 32)  # two parts that name their samples in the streamed file
    parts = partial / "parts"
    os.rename(partial / "streamed", partial / "out")  # as the stream left it
    stream = Stream(partial, {"format": fmt, "compression": None, "container": None}, None)
    stream.fed = 2
    assert stream.feed(5, Part.load(parts / "part-000000.npz")) is None
    assert not stream.on and not (partial / "out").exists()
    assert check_part(parts / "part-000001.npz", partial) is not None


@pytest.mark.parametrize("how", ["missing", "refused"])
def test_a_range_is_copied_the_same_without_copy_file_range(tmp_path, monkeypatch, how):
    import errno

    from gpufeed.formats.appended import copy_range

    data = os.urandom(3 << 20)
    (tmp_path / "src").write_bytes(data)
    (tmp_path / "dst").write_bytes(b"\0" * 16)
    if how == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:

        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    src, dst = os.open(tmp_path / "src", os.O_RDONLY), os.open(tmp_path / "dst", os.O_RDWR)
    try:
        copy_range(src, dst, len(data) - 100, 100, 8)
        assert (tmp_path / "dst").read_bytes() == b"\0" * 8 + data[100:]
        with pytest.raises(OSError, match="cut short"):  # the source ends 100 bytes sooner
            copy_range(src, dst, 200, len(data) - 100, len(data))
    finally:
        os.close(src)
        os.close(dst)
