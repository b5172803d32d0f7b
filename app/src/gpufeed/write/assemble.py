"""Assembling the pack: every committed part through the format's writer into
DEST.partial/out/, the manifest written last, then out/ renamed to DEST."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed._version import __version__
from gpufeed.errors import DiskFullError
from gpufeed.formats import writer_class
from gpufeed.formats.files import fsync_dir, is_disk_full, no_space_is_an_error
from gpufeed.formats.inplace.tree import Source
from gpufeed.formats.manifest import (
    MANIFEST_SCHEMA,
    SOURCES_NAME,
    file_entry,
    write_manifest,
    write_sources,
)
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec
from gpufeed.pagecache.maps import forget_maps
from gpufeed.write import progress
from gpufeed.write.direct import keep_streamed, load_part
from gpufeed.write.options import MANIFEST_OPTIONS
from gpufeed.write.ownership import (
    OUT_DIR,
    PARTS_DIR,
    REPLACED_DIR,
    STREAMED_DIR,
    check_removable,
    occupied,
    remove_tree,
)
from gpufeed.write.sources import names_of
from gpufeed.write.staging import part_path

__all__ = ["STREAMED_FORMATS", "Stream", "assemble", "streams"]

# formats whose writer takes the samples in order without knowing their totals: a fresh pack
# feeds it each part as the part is committed (Stream), so the format's files are written
# while the workers read, not in a second pass over every part after them (mmap: its .npy
# container, a .pt file is written from the whole array at the end; HDF5: uncompressed, a
# compressed dataset's chunks are written from the parts)
STREAMED_FORMATS = frozenset({"tar", "lmdb", "mmap", "hdf5"})


def streams(state: dict) -> bool:
    """Whether a fresh pack of these settings is written as its parts are committed."""
    if state["format"] == "mmap":
        return (state.get("container") or "npy") == "npy"
    if state["format"] == "hdf5":
        return (state.get("compression") or "none") == "none"
    return state["format"] in STREAMED_FORMATS


@dataclass
class PartIndex:
    """What assembling needs of a committed part besides its samples: their sizes and
    inputs, the inputs it skipped, its sample spec."""

    spec: SampleSpec | None
    sizes: np.ndarray
    items: np.ndarray
    skip_items: np.ndarray
    skip_errors: np.ndarray

    @classmethod
    def of(cls, part: Part) -> PartIndex:
        sizes = np.diff(part.offsets)
        return cls(part.spec, sizes, part.items, part.skip_items, part.skip_errors)

    @classmethod
    def read(cls, path: Path) -> PartIndex:
        """The index of the part file at ``path`` (its payload is not read)."""
        with np.load(path) as z:
            spec = json.loads(str(z["spec"]))
            return cls(
                SampleSpec.from_json(spec) if spec else None,
                np.diff(z["offsets"]),
                z["items"],
                z["skip_items"],
                z["skip_errors"],
            )


class Stream:
    """The format's files written from each part as it is committed (a fresh pack in a
    format of STREAMED_FORMATS), into DEST.partial/out/. The committed parts stay what a
    resume trusts: a crash leaves out/ half written, and the resumed pack assembles out/
    again from the parts (assemble). Anything else (another format, a part out of order)
    turns the stream off, and assemble writes out/ after the last part as before."""

    def __init__(self, partial: Path, state: dict, classes: list[str] | None, on: bool = True):
        self.out = partial / OUT_DIR
        self.state = state
        self.classes = classes
        self.on = on and streams(state)
        self.writer = None
        self.fed = 0  # parts written, in order
        self.seen: list[PartIndex] = []  # their index, what assemble needs of them

    def feed(self, index: int, part: Part) -> np.ndarray | None:
        """Write the part's samples; returns where they are in the files of a writer that
        says so (Part.where: TarWriter.placed, LmdbWriter.placed, ContiguousWriter.placed),
        else None."""
        if not self.on:
            return None
        if index != self.fed:
            self.stop()
            if self.fed:  # parts name samples in out/: kept where a resume reads them
                self._move_aside()
            return None
        if self.writer is None and part.spec is not None:
            self._open(part.spec)
        if self.writer is not None:
            try:
                with _format_errors(self.writer):  # closes the writer's files on a failure
                    self.writer.add(part)
            except BaseException:
                self.on, self.writer = False, None
                raise
        self.fed += 1
        self.seen.append(PartIndex.of(part))
        placed = getattr(self.writer, "placed", None)
        return placed(len(part)) if placed is not None and len(part) else None

    def _open(self, spec) -> None:
        """The format's writer, in an empty out/ (its total count unknown: None)."""
        if self.out.exists():
            remove_tree(self.out, "redo the unfinished output")
        self.out.mkdir()
        options = _writer_options(self.state, self.classes)
        self.writer = writer_class(self.state["format"])(self.out, spec, None, 0, options)

    def finished_writer(self, nparts: int):
        """The writer that has every one of the nparts parts, else None (stream stopped, or
        its writer must write the pack again from the parts: Writer.needs_rewrite, and the
        writer cannot cut its files again: recut)."""
        if self.on and self.writer is not None and self.fed == nparts:
            if not self.writer.needs_rewrite():
                return self.writer
            recut = getattr(self.writer, "recut", None)
            if recut is not None:
                return self._recut(self.writer)
            self.stop()
            self._move_aside()
        self.stop()
        return None

    def _recut(self, writer):
        """The writer's files moved aside as a resume keeps them (the parts name their
        samples there), then cut again into a new out/ (TarWriter.recut). A crash at any
        point leaves streamed/ and the parts that name it, and perhaps a partial out/: what
        a resume assembles the pack from (gpufeed.write.direct); a failure here as well."""
        self.on, self.writer = False, None
        with _format_errors(writer):
            writer.end_shards()
            kept = self._move_aside()
            self.out.mkdir()
            writer.recut(kept)
        return writer

    def _move_aside(self) -> Path:
        """out/ moved to streamed/, where the parts' samples are read back from (a streamed/
        there already is an earlier run's that no part names: a stream runs only when no
        part was kept)."""
        kept = self.out.parent / STREAMED_DIR
        if kept.exists():
            remove_tree(kept, "drop output no part names")
        keep_streamed(self.out.parent)
        return kept

    def stop(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        self.on, self.writer = False, None


def _writer_options(state: dict, classes) -> dict[str, Any]:
    return {
        "classes": classes,
        "compression": state["compression"],
        "shard_size": state["shard_size"],
        "shard_bytes": state["shard_bytes"],
        "items": state.get("items"),  # what a streamed writer's default cut goes by
        "container": state["container"],
    }


def assemble(
    src: Source,
    dest: Path,
    partial: Path,
    nparts: int,
    state: dict,
    quiet: bool,
    stream: Stream | None = None,
):
    parts_dir = partial / PARTS_DIR
    paths = [part_path(parts_dir, p) for p in range(nparts)]
    writer = stream.finished_writer(nparts) if stream is not None else None
    # the parts' index: as the stream saw them (no part read again), or read from the files
    index = stream.seen if writer is not None else [PartIndex.read(path) for path in paths]
    spec = next((i.spec for i in index if i.spec is not None), None)
    sizes = [i.sizes for i in index]
    sizes_all = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    items = [i.items for i in index]
    items_all = np.concatenate(items) if items else np.zeros(0, dtype=np.int64)
    count = len(sizes_all)
    skipped = [{"item": None, "path": rel, "error": err} for rel, err in src.problems]
    for i in index:
        for it, err in zip(i.skip_items.tolist(), i.skip_errors.tolist(), strict=True):
            skipped.append({"item": it, "path": src.rel[it], "error": err})
    out = partial / OUT_DIR
    fmt = state["format"]
    if writer is not None:
        with _format_errors(writer):
            info = writer.finish()
    else:
        if out.exists():
            remove_tree(out, "redo the unfinished output")
        out.mkdir()
        options = _writer_options(state, src.classes)
        writer = writer_class(fmt)(out, spec, count, int(sizes_all.sum()), options)
        info = _write_parts(writer, paths, partial, quiet, fmt)
    lines = names_of(src.rel, items_all)
    if lines is not None:
        with no_space_is_an_error(out / SOURCES_NAME):
            write_sources(out / SOURCES_NAME, lines)
    known = info.get("sha256", {})  # a value may be a future: the file hashed in a thread
    names = sorted([*info["files"], *([SOURCES_NAME] if lines is not None else [])])
    files = {n: file_entry(out, n, _result(known.get(n), out / n)) for n in names}
    manifest = {
        "gpufeed_manifest": MANIFEST_SCHEMA,
        "format": fmt,
        "format_version": (spec or SampleSpec("encoded")).format_version,
        "count": count,
        "classes": src.classes,
        "sample": (spec or SampleSpec("encoded")).to_json(),
        "files": files,
        "layout": info["layout"],
        "source": {
            "path": None if src.path is None else str(src.path),
            "kind": src.kind,
            "items": len(src),
            "digest": state["source_digest"],
        },
        "options": {k: state[k] for k in MANIFEST_OPTIONS if k in state},
        "skipped": skipped,
        "created_by": f"gpufeed {__version__}",
    }
    for name in os.listdir(out):
        if name not in files:
            os.unlink(out / name)  # leftovers such as lock.mdb: the manifest lists everything
    write_manifest(out, manifest)
    fsync_dir(out)
    swap_into_place(out, dest, partial, src)
    return manifest


def _result(value, path: Path) -> str | None:
    """A writer's sha256 of ``path``: made already, or by a thread that also fsyncs the file
    (a Future, waited for here: a full disk then is a DiskFullError naming the file)."""
    if not hasattr(value, "result"):
        return value
    with no_space_is_an_error(path):
        return value.result()


def _write_parts(writer, paths: list[Path], partial: Path, quiet: bool, fmt: str) -> dict[str, Any]:
    """Every committed part through the format writer; a full disk is a DiskFullError naming
    the file being written, and the writer's files are closed quietly on any failure."""
    bar = progress.progress_bar(len(paths), 0, quiet, f"write {fmt}", unit="part")
    try:
        with _format_errors(writer):
            for path in paths:
                writer.add(load_part(path, partial))
                bar.update(1)
            return writer.finish()
    finally:
        bar.close()


@contextlib.contextmanager
def _format_errors(writer) -> Iterator[None]:
    """A full disk is a DiskFullError naming the file being written, and the writer's files
    are closed quietly on any failure."""
    try:
        yield
    except BaseException as e:
        writer.abort()
        where = writer.current_file or writer.out
        if isinstance(e, (OSError, RuntimeError)) and is_disk_full(e, where):
            raise DiskFullError(where) from None
        raise


def swap_into_place(out: Path, dest: Path, partial: Path, src: Source) -> None:
    """out/ becomes DEST. A DEST there (a pack gpufeed made: checked again now) is first moved
    into DEST.partial, which is deleted with it afterwards: a crash in between leaves either
    the old pack or the new one at DEST, and a resumable DEST.partial. This process's kept
    maps of the old pack are dropped first, so its files' space is freed with them."""
    if occupied(dest):
        check_removable(dest, "replace it (--overwrite)", src)
        forget_maps(dest)
        replaced = partial / REPLACED_DIR
        if replaced.exists():
            remove_tree(replaced, "drop a pack replaced by an earlier run")
        os.rename(dest, replaced)
    os.rename(out, dest)
    fsync_dir(dest.parent)
