"""Upload a finished local pack to object storage, the manifest last."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpufeed.errors import StorageError, UsageError
from gpufeed.formats.manifest import MANIFEST_NAME, manifest_path, read_manifest
from gpufeed.storage.retry import RetryPolicy, with_retries
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import ObjectStore
from gpufeed.storage.urls import RemoteURL, parse_location, require_local


def upload_pack(
    src: str | os.PathLike,
    url: str,
    *,
    overwrite: bool = False,
    retry: RetryPolicy | None = None,
    stats: StorageStats | None = None,
) -> dict[str, Any]:
    """Upload the finished pack `src` to `url`; returns its manifest.

    Readers never see a partial pack as complete: the data files go first (multipart when
    large), their sizes are checked in a listing, and manifest.json is written last. Replacing
    a pack (overwrite=True) removes its manifest first and its stale files last. A prefix that
    holds objects but no manifest is not ours, and is refused."""
    root = require_local(src, "upload_pack's SRC is the local pack folder")
    manifest = read_manifest(root)  # a finished pack, or NotPackedError saying why not
    loc = parse_location(url)
    if not isinstance(loc, RemoteURL):
        raise UsageError(f"{url}: upload_pack writes to object storage (s3://bucket/prefix)")
    store = ObjectStore(loc)
    retry, stats = retry or RetryPolicy(), stats or StorageStats()

    def again(call):
        return with_retries(call, retry, stats)

    existing = again(store.list)
    names = _pack_files(root)
    check_destination(loc, existing, overwrite, ours=frozenset(names))
    if MANIFEST_NAME in existing:
        again(lambda: store.delete(MANIFEST_NAME))
    for name in names:
        again(lambda name=name: store.put_file(name, root / name))
    sizes = {name: (root / name).stat().st_size for name in names}
    check_listed_sizes(loc, sizes, again(store.list), "upload")
    again(lambda: store.put_bytes(MANIFEST_NAME, manifest_path(root).read_bytes()))
    for stale in sorted(set(existing) - set(names) - {MANIFEST_NAME}):
        again(lambda stale=stale: store.delete(stale))
    return manifest


def check_upload_destination(
    url: RemoteURL, *, overwrite: bool = False, resume: bool = False
) -> None:
    """Refuse now what upload_pack would refuse at the end (a foreign prefix, a pack there
    without overwrite), so a long pack into `url` does not fail after its work is done.
    resume: objects without a manifest may be this pack's own interrupted upload (upload_pack
    tells, by their names)."""
    listed = with_retries(ObjectStore(url).list, RetryPolicy(), StorageStats())
    if listed and MANIFEST_NAME not in listed:
        if resume:
            return
        # what the pack would upload is not known yet: both readings, and what to do in each
        raise UsageError(
            f"{url}: holds {len(listed)} objects and no {MANIFEST_NAME}: an unfinished upload "
            "(the manifest is uploaded last), or objects that are not a gpufeed pack. If it "
            "is an interrupted upload of this pack, rerun with --resume (resume=True) to "
            "finish it; otherwise delete those objects, or pack to an empty prefix"
        )
    check_destination(url, listed, overwrite)


def check_destination(
    loc: RemoteURL, existing: dict[str, int], overwrite: bool, ours: frozenset[str] = frozenset()
) -> None:
    """A prefix may be written when empty, when it holds a pack (overwrite), or when it holds
    only files named as the pack's own (`ours`: an upload of it that was cut short)."""
    if not existing:
        return
    if MANIFEST_NAME not in existing:
        if set(existing) <= ours:
            return
        raise UsageError(
            f"{loc}: holds {len(existing)} objects and no {MANIFEST_NAME}: not a gpufeed pack, "
            "so gpufeed will not write into it; upload to an empty prefix"
        )
    if not overwrite:
        raise UsageError(
            f"{loc}: already holds a pack; pass overwrite=True (--overwrite) to replace it"
        )


def _pack_files(root: Path) -> list[str]:
    """Every file of the pack folder but the manifest, as /-separated relative names."""
    names = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            rel = (Path(dirpath) / f).relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                names.append(rel)
    return sorted(names)


def check_listed_sizes(loc: RemoteURL, sizes: dict[str, int], listed: dict, after: str) -> None:
    """Every object the manifest will name is listed at its size before the manifest is
    written (an upload or a merge in the bucket, `after` saying which): a StorageError
    naming the first that is not, and what to run again."""
    for name, want in sizes.items():
        found = listed.get(name)
        if found != want:
            raise StorageError(
                f"{loc.child(name)}: the store lists {found} bytes after the {after}, "
                f"{want:,} expected; the manifest was not written: {after} again"
            )
