"""Pack into object storage: pack into a local staging folder, then upload it, manifest last.

A reader of the URL never sees a half pack: nothing is uploaded until the local pack is
finished and verified by its own manifest, and upload_pack writes manifest.json last. The
staging folder is a normal local pack, so an interrupted pack resumes there (resume=True)
and a failed upload is retried without packing again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError
from gpufeed.formats.manifest import MANIFEST_NAME, SOURCES_NAME, read_manifest, read_sources
from gpufeed.storage.modes import cache_shared, make_cache_dirs
from gpufeed.storage.packs import default_cache_dir
from gpufeed.storage.upload import check_upload_destination, upload_pack
from gpufeed.storage.urls import RemoteURL
from gpufeed.write.ownership import is_pack

STAGING = "staging"


def staging_path(url: RemoteURL, staging_dir: str | os.PathLike | None) -> Path:
    """Where a pack bound for `url` is made: `staging_dir`, else the cache folder's
    staging/<scheme>/<bucket>/<prefix> (one per URL, so --resume finds it)."""
    if staging_dir is not None:
        return Path(staging_dir).absolute()
    base = default_cache_dir() / STAGING / url.scheme / url.bucket
    return (base / (url.prefix or "_root")).absolute()


def changed_sources(staged: Path) -> tuple[int, list[str]] | None:
    """(source files checked, those changed) for the finished pack at `staged`: a file is
    changed when it is gone, or its mtime or ctime is not older than the pack's manifest (it
    was written, or its mtime set back, after the pack was finished: ctime cannot be set
    back). None when the pack did not record source files (samples from Python)."""
    try:
        finished = (staged / MANIFEST_NAME).stat().st_mtime_ns
        source = read_manifest(staged).get("source") or {}
        names = read_sources(staged / SOURCES_NAME)
    except (OSError, DataError):
        return None
    if not source.get("path") or source.get("kind") == "python":
        return None
    root = Path(source["path"])
    base = root.parent if source.get("kind") == "listfile" else root
    changed = _changed(str(root), finished) if source.get("kind") == "listfile" else []
    for name in names:
        changed += _changed(str(base / name), finished)  # an absolute name stays as it is
    return len(names), changed


def _changed(path: str, finished: int) -> list[str]:
    try:
        st = os.stat(path)
    except OSError:
        return [path]
    return [path] if max(st.st_mtime_ns, st.st_ctime_ns) >= finished else []


def _reusable(staged: Path, say: Callable[[str], None]) -> bool:
    """Whether --resume may upload the finished pack staged by an earlier run (killed while
    uploading, say) as it is; says what it found either way."""
    found = changed_sources(staged)
    if found is None:
        say(f"{staged}: reusing the staged pack as it is (it records no source files to check)")
        return True
    count, changed = found
    if changed:
        say(
            f"{staged}: {len(changed)} source file(s) changed since this pack was staged "
            f"(first: {changed[0]}); packing again instead of uploading the old bytes"
        )
        return False
    say(
        f"{staged}: reusing the staged pack: none of its {count} source files changed since "
        "it was finished (mtime and ctime)"
    )
    return True


def pack_to_store(
    pack_locally: Callable[..., dict[str, Any]],
    url: RemoteURL,
    *,
    staging_dir: str | os.PathLike | None,
    keep_staging: bool,
    resume: bool,
    overwrite: bool,
    say: Callable[[str], None],
    **options: Any,
) -> dict[str, Any]:
    """pack_locally(dest=the staging folder, **options), then upload_pack(it, url)."""
    check_upload_destination(url, overwrite=overwrite, resume=resume)  # before the work
    staged = staging_path(url, staging_dir)
    if staging_dir is None:  # in the cache folder: as private as the cache (storage/cache.py)
        make_cache_dirs(default_cache_dir().absolute(), staged.parent, cache_shared())
    else:
        staged.parent.mkdir(parents=True, exist_ok=True)
    # the staging folder is ours: a finished pack left there by an upload that failed is
    # replaced unless resuming (then it is reused, if made from the same source and settings
    # and none of its source files changed since it was finished)
    if resume and is_pack(staged) and not _reusable(staged, say):
        resume = False
    manifest = pack_locally(dest=staged, resume=resume, overwrite=not resume, **options)
    say(f"{staged}: packed; uploading to {url}")
    upload_pack(staged, str(url), overwrite=overwrite)
    if not keep_staging:
        shutil.rmtree(staged)
    return manifest
