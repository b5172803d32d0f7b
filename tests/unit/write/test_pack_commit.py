"""A source folder's streamed parts (gpufeed.write.staging): a fresh tar or LMDB pack writes
each sample once, into its shards or data.mdb, and its parts keep only where the samples are,
not fsynced; a resume checks every kept part against them by crc32 and reads a torn one
again, on its own (a folder's parts are fixed ranges of items), and the pack it finishes is
byte for byte the one a fresh pack makes. JPEG folders too (their check, a decode, kept)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from faults import tear

import gpufeed
from gpufeed.errors import SourceError
from gpufeed.formats.parts import Part

N, BAD = 40, 30  # 40 arrays in two classes; item 30 (b/010.npy) unreadable at first


def _array(i: int) -> np.ndarray:
    return np.frombuffer((f"sample-{i:03d}-" * 4).encode(), np.uint8)


def _source(root: Path) -> Path:
    for i in range(N):
        folder = root / "ab"[i // 20]
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i % 20:03d}.npy", _array(i))
    return root


def _files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir()) if p.name != "manifest.json"}


def _stopped(src: Path, dest: Path, fmt: str, resume: bool = False) -> Path:
    """A pack of src in parts of 4 stopped by a bad file at item BAD: its partial folder
    (parts 0-6 committed, streamed into out/)."""
    bad = src / "b" / f"{BAD - 20:03d}.npy"
    good = bad.read_bytes()
    bad.write_bytes(b"not an array")
    with pytest.raises(SourceError, match="010.npy"):
        gpufeed.pack(src, dest, format=fmt, part_size=4, workers=0, quiet=True, resume=resume)
    bad.write_bytes(good)
    partial = dest.with_name(dest.name + ".partial")
    assert len(list((partial / "parts").glob("part-*.npz"))) == BAD // 4
    return partial


@pytest.mark.parametrize("how", ["zeros", "cut", "flipped"])
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_torn_part_is_read_again_and_the_pack_is_a_fresh_ones(tmp_path, fmt, how):
    src = _source(tmp_path / "src")
    dest = tmp_path / "p"
    partial = _stopped(src, dest, fmt)
    parts = partial / "parts"
    part = Part.load(parts / "part-000002.npz")  # items 8-11
    assert part.where is not None and len(part.payload) == 0  # the samples are in out/ only
    if how == "flipped":
        _torn(partial / "out" / ("shard-000000.tar" if fmt == "tar" else "data.mdb"), how)
    else:
        _torn(parts / "part-000002.npz", how)
    said: list[str] = []
    gpufeed.pack(src, dest, format=fmt, part_size=4, workers=0, resume=True, log=said.append)
    assert any("part-000002.npz: torn" in line for line in said), said
    assert not any("more" in line for line in said if "torn" in line)  # that part alone
    fresh = tmp_path / "fresh"
    gpufeed.pack(src, fresh, format=fmt, part_size=4, workers=0, quiet=True)
    assert _files(dest) == _files(fresh)
    assert gpufeed.verify(dest).ok


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_resume_twice_and_a_changed_file_are_a_fresh_pack(tmp_path, fmt):
    """Resumed once (its streamed files kept aside), stopped again, resumed again; a file of
    a kept part changed in between is read again, not taken from the streamed files."""
    src = _source(tmp_path / "src")
    dest = tmp_path / "p"
    partial = _stopped(src, dest, fmt)
    np.save(src / "a" / "005.npy", _array(105))  # in part 1, committed
    _stopped(src, dest, fmt, resume=True)  # resumed, stopped at the same bad file again
    assert (partial / "streamed").is_dir()
    said: list[str] = []
    gpufeed.pack(src, dest, format=fmt, part_size=4, workers=0, resume=True, log=said.append)
    assert not any("torn" in line for line in said), said
    fresh = tmp_path / "fresh"
    gpufeed.pack(src, fresh, format=fmt, part_size=4, workers=0, quiet=True)
    assert _files(dest) == _files(fresh)


def test_a_jpeg_folder_streamed_with_workers_resumes_to_a_fresh_pack(tmp_path):
    from PIL import Image

    src = tmp_path / "src"
    for i in range(24):
        folder = src / f"c{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (i * 10, 50, 200 - i)).save(buf, "JPEG")
        (folder / f"{i:03d}.jpg").write_bytes(buf.getvalue())
    bad = src / "c2" / "023.jpg"
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # cut short: the decode check fails the pack
    dest = tmp_path / "p"
    with pytest.raises(SourceError, match="023.jpg"):
        gpufeed.pack(src, dest, format="tar", part_size=4, workers=2, quiet=True)
    bad.write_bytes(good)
    parts = dest.with_name("p.partial") / "parts"
    assert Part.load(parts / "part-000000.npz").where is not None
    _torn(parts / "part-000001.npz", "zeros")
    gpufeed.pack(src, dest, format="tar", part_size=4, workers=2, resume=True, quiet=True)
    fresh = tmp_path / "fresh"
    gpufeed.pack(src, fresh, format="tar", part_size=4, workers=2, quiet=True)
    assert _files(dest) == _files(fresh)


def _torn(path: Path, how: str) -> None:
    tear(path, how, b"sample-009-", 3)
