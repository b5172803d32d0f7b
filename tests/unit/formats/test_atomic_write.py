"""Atomic writes: a shared file (a cache several ranks fill) written by two writers at once
lands whole from one of them, and neither fails."""

from __future__ import annotations

import os

import pytest

from gpufeed.formats import files
from gpufeed.formats.files import atomic_write_bytes


def _another_writer_between_write_and_rename(monkeypatch, path, shared):
    """os.fsync of the first write runs a second, whole write of the same file: the moment
    another rank lands its copy while this one is between its write and its rename."""
    real_fsync, fired = os.fsync, []

    def fsync(fd):
        real_fsync(fd)
        if not fired:
            fired.append(True)
            atomic_write_bytes(path, b"second", shared=shared)

    monkeypatch.setattr(files.os, "fsync", fsync)


def test_two_writers_of_a_shared_file_both_land(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    _another_writer_between_write_and_rename(monkeypatch, path, shared=True)
    atomic_write_bytes(path, b"first", shared=True)
    assert path.read_bytes() == b"first"  # the last rename wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left


def test_a_locked_file_keeps_its_fixed_temporary_name(tmp_path, monkeypatch):
    """Without `shared`, the caller holds the lock: one fixed name a resumed pack knows; two
    writers at once are the caller's bug and fail loudly rather than interleave."""
    path = tmp_path / "state.json"
    _another_writer_between_write_and_rename(monkeypatch, path, shared=False)
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(path, b"first")
    assert path.read_bytes() == b"second"
