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

from gpufeed.storage.cache import cache_shared, make_cache_dirs
from gpufeed.storage.packs import default_cache_dir
from gpufeed.storage.upload import check_upload_destination, upload_pack
from gpufeed.storage.urls import RemoteURL

STAGING = "staging"


def staging_path(url: RemoteURL, staging_dir: str | os.PathLike | None) -> Path:
    """Where a pack bound for `url` is made: `staging_dir`, else the cache folder's
    staging/<scheme>/<bucket>/<prefix> (one per URL, so --resume finds it)."""
    if staging_dir is not None:
        return Path(staging_dir).absolute()
    base = default_cache_dir() / STAGING / url.scheme / url.bucket
    return (base / (url.prefix or "_root")).absolute()


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
    # replaced unless resuming (then it is reused, if made from the same source and settings)
    manifest = pack_locally(dest=staged, resume=resume, overwrite=not resume, **options)
    say(f"{staged}: packed; uploading to {url}")
    upload_pack(staged, str(url), overwrite=overwrite)
    if not keep_staging:
        shutil.rmtree(staged)
    return manifest
