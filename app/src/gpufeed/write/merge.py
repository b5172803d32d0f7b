"""``gpufeed.merge(parts, dest)``: one pack of many, written anywhere, without copying samples.

Independent writers (processes, Slurm array tasks, Ray or Spark tasks, machines) each write
a complete pack of the same format and sample spec into a folder of their own; merge makes
one pack of them, samples in the order the parts are given. No sample byte is copied when
the parts and DEST share a file system: the merged pack's files are hard links of the
parts' files (a part's file lives on as long as either links it; parts stay usable and can
be deleted after the merge). Across file systems the files are copied instead.

How, by format (docs/packing-at-scale.md):
  tar             an ordinary tar pack: the parts' shards linked in as shard-NNNNNN.tar,
                  numbered on across parts, and one index.npz (each part's index with its
                  shard numbers shifted; offsets, sizes, labels and crc32 as they were).
                  Member keys restart at 0 in each part's shards (gpufeed reads by the index).
  hdf5/lmdb/mmap  their samples live in one file a pack (data.h5, data.mdb, samples.npy or
                  encoded.npy), which cannot be joined without copying: each part is linked
                  in whole as parts/NNNNNN/ (a complete pack) and the manifest lists them
                  (layout.parts); gpufeed.formats.multipart reads it as one pack.

Parts and DEST in object storage (s3://..., one bucket): gpufeed.write.merge_remote, the
same layout made by the store's server-side copies, the manifest written last (why copies
there: its docstring and docs/object-storage.md). Local parts with a URL, or the reverse, are
a UsageError.

Crash safety as for a pack: under the pack lock everything is built in DEST.partial/out/,
the manifest written last, then out/ is renamed to DEST. A merge stopped at any point
leaves the parts as they were and either no DEST or the complete one; merging the same
parts into DEST again redoes an unfinished merge and returns a finished one as it is (its
manifest records each part's path, count and manifest digest).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError, NotPackedError, UsageError
from gpufeed.formats import PARTS_LAYOUT, is_multipart, reader_class
from gpufeed.formats.files import fsync_dir
from gpufeed.formats.lock import PackLock
from gpufeed.formats.manifest import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    SOURCES_NAME,
    file_entry,
    pack_file,
    read_manifest,
    write_manifest,
)
from gpufeed.formats.tar.writer import INDEX_NAME
from gpufeed.storage.urls import is_remote
from gpufeed.write.assemble import swap_into_place
from gpufeed.write.merge_layout import (
    PART_DIR,
    check_agree,
    common_fields,
    index_bytes,
    renumbered_shards,
    tar_layout,
)
from gpufeed.write.ownership import (
    OUT_DIR,
    check_removable,
    clear_partial,
    occupied,
    remove_partial,
)

__all__ = ["merge"]


def merge(
    parts: Sequence[str | os.PathLike],
    dest: str | os.PathLike,
    *,
    overwrite: bool = False,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
) -> dict[str, Any]:
    """Merge finished packs ``parts`` (in this order) into one pack at ``dest``.

    Args:
        parts: the part packs' folders, each a complete pack of the same format, sample
            spec, classes and gpufeed version (a part that differs is refused, named);
            or their URLs (s3://bucket/prefix), all in DEST's bucket.
        dest: the merged pack's folder; on the parts' file system for a merge without
            copies (hard links), elsewhere the parts' files are copied. Or a URL in the
            parts' bucket: the store copies their objects (gpufeed.write.merge_remote).
        overwrite: replace a pack at ``dest`` that is not this merge of these parts.
        cache_dir, cache_limit: parts in object storage: the local cache their tar
            indexes are read through (as open_dataset's); unused for local parts.

    Returns:
        The merged pack's manifest (that of the pack already at ``dest`` when it is this
        merge of these same parts: merging again changes nothing).
    """
    if not parts:
        raise UsageError("merge: no parts given; pass the part packs to merge")
    if _where(parts, dest) == "remote":
        from gpufeed.write.merge_remote import merge_remote

        return merge_remote(
            [os.fspath(p) for p in parts], os.fspath(dest), overwrite=overwrite,
            cache_dir=cache_dir, cache_limit=cache_limit,
        )  # fmt: skip
    dest = Path(dest).absolute()
    paths = [Path(p).absolute() for p in parts]
    _check_distinct(paths)
    manifests = [_part_manifest(p, dest) for p in paths]
    check_agree(paths, manifests)
    merged_from = [_record(p, m) for p, m in zip(paths, manifests, strict=True)]
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    done = _finished(dest, merged_from)
    if done is not None:
        _clean_up(dest, partial)
        return done
    if occupied(dest) and not overwrite:
        raise UsageError(
            f"{dest}: exists and is not a merge of these parts; pass overwrite=True "
            "(--overwrite) to replace it, or choose another destination"
        )
    if occupied(dest):
        check_removable(dest, "replace it (--overwrite)")  # before anything is built
    with PackLock(dest, partial) as lock:
        clear_partial(partial, "redo an unfinished merge")
        out = partial / OUT_DIR
        out.mkdir()
        build = _merge_tar if manifests[0]["format"] == "tar" else _merge_whole
        manifest = build(paths, manifests, out)
        manifest.update(common_fields(manifests, merged_from))
        write_manifest(out, manifest)
        fsync_dir(out)
        swap_into_place(out, dest, partial, None)
        remove_partial(partial, lock)
    return manifest


def _where(parts: Sequence[str | os.PathLike], dest: str | os.PathLike) -> str:
    """ "local" or "remote": the parts and DEST all one or the other, else a UsageError (a
    merge moves no sample byte, so it cannot span a file system and a bucket)."""
    remote = [is_remote(p) for p in [*parts, dest]]
    if all(remote):
        return "remote"
    if not any(remote):
        return "local"
    first = next(str(p) for p, r in zip([*parts, dest], remote, strict=True) if r)
    local = next(str(p) for p, r in zip([*parts, dest], remote, strict=True) if not r)
    raise UsageError(
        f"merge: {first} is in object storage and {local} is local; parts and DEST must be "
        "all local or all in one bucket (upload the local ones with "
        "gpufeed.storage.upload_pack, or merge locally and upload the merged pack)"
    )


def _check_distinct(paths: list[Path]) -> None:
    """Each part given once: a part twice would be its samples twice."""
    seen: dict[str, Path] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{path}: given twice (also as {seen[real]}); give each part once")
        seen[real] = path


def _part_manifest(path: Path, dest: Path) -> dict[str, Any]:
    """A part's manifest (NotPackedError naming it when it is not a finished pack); a part
    may not hold DEST or lie inside it, nor be a merged pack of parts itself."""
    real, top = os.path.realpath(path), os.path.realpath(dest)
    if real == top or os.path.commonpath([real, top]) in (real, top):
        raise UsageError(f"{path}: a part cannot be, hold or lie inside DEST {dest}")
    try:
        manifest = read_manifest(path)
    except NotPackedError as e:
        raise NotPackedError(f"part {path}: {e}") from None
    if is_multipart(manifest):
        raise UsageError(
            f"{path}: is itself a merged pack of parts; merge its parts ({path}/parts/*) instead"
        )
    return manifest


def _record(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What names a part in the merged manifest: its path, count and its manifest's digest
    (a part re-packed since is a different part)."""
    digest = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
    return {"path": str(path), "count": manifest["count"], "manifest_sha256": digest}


def _finished(dest: Path, merged_from: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The manifest at DEST when it is the finished merge of these parts, else None."""
    try:
        manifest = read_manifest(dest)
    except (DataError, OSError):  # no pack there, or a damaged one: not this merge
        return None
    return manifest if manifest.get("merged_from") == merged_from else None


def _clean_up(dest: Path, partial: Path) -> None:
    """DEST.partial left by a merge stopped after its rename into place: removed (under the
    lock, only when it is gpufeed's own)."""
    if partial.is_dir() and not partial.is_symlink():
        with PackLock(dest, partial) as lock:
            remove_partial(partial, lock)


def _link(src: Path, dst: Path) -> None:
    """dst as a hard link of src; a copy where the file systems differ (or links are not
    allowed there)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copyfile(src, dst)


def _merge_whole(paths: list[Path], manifests: list[dict[str, Any]], out: Path) -> dict:
    """hdf5, lmdb, mmap: each part linked in whole under parts/NNNNNN/ (its manifest and
    every file it lists, checked inside the part first), read by MultiPartReader."""
    files: dict[str, Any] = {}
    entries = []
    for k, (path, manifest) in enumerate(zip(paths, manifests, strict=True)):
        _open_checked(path, manifest)
        where = PART_DIR.format(k)
        for name, entry in manifest["files"].items():
            _link(pack_file(path, name), out / where / name)
            files[f"{where}/{name}"] = entry
        _link(path / MANIFEST_NAME, out / where / MANIFEST_NAME)
        # listed too: verify checks it, and a reader of the pack uploaded to a URL fetches
        # it through the cache against this sha256 (storage/remote_parts.py)
        files[f"{where}/{MANIFEST_NAME}"] = file_entry(out, f"{where}/{MANIFEST_NAME}")
        entries.append({"path": where, "count": manifest["count"]})
    return {"files": files, "layout": {PARTS_LAYOUT: entries}}


def _open_checked(path: Path, manifest: dict[str, Any]):
    """The part's own reader: everything it checks when it opens (its index against its
    files) holds before the part becomes a piece of the merged pack."""
    reader = reader_class(manifest["format"])(path, manifest)
    reader.close()
    return reader


def _merge_tar(paths: list[Path], manifests: list[dict[str, Any]], out: Path) -> dict:
    """tar: the parts' shards linked in, numbered on; one index over them all."""
    files: dict[str, Any] = {}
    readers = [_open_checked(p, m) for p, m in zip(paths, manifests, strict=True)]
    names = renumbered_shards(readers)
    for path, manifest, reader in zip(paths, manifests, readers, strict=True):
        for old in reader.shards:
            new = names[len(files)]
            _link(path / old, out / new)
            entry = manifest["files"].get(old)
            files[new] = entry if isinstance(entry, dict) and "sha256" in entry else None
    with open(out / INDEX_NAME, "wb") as f:
        f.write(index_bytes(readers))
        f.flush()
        os.fsync(f.fileno())
    files[INDEX_NAME] = None
    if _write_sources(paths, out):
        files[SOURCES_NAME] = None
    files = {n: e or file_entry(out, n) for n, e in sorted(files.items())}
    return {"files": files, "layout": tar_layout(manifests, names)}


def _write_sources(paths: Iterable[Path], out: Path) -> bool:
    """sources.txt of the merged tar pack: the parts' in order, when every part has one."""
    lists = []
    for path in paths:
        if not (path / SOURCES_NAME).is_file():
            return False
        lists.append(pack_file(path, SOURCES_NAME).read_bytes())
    with open(out / SOURCES_NAME, "wb") as f:
        for data in lists:
            f.write(data if not data or data.endswith(b"\n") else data + b"\n")
    return True
