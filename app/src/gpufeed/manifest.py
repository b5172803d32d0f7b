"""manifest.json: what a packed dataset holds. Written last, so its presence means complete.

Fields:
  gpufeed_manifest   1 (this file's own schema version)
  format             hdf5 | lmdb | tar | mmap
  format_version     on-disk layout version of that format
  count              samples stored
  classes            class names, label i is classes[i] (null when the source had none)
  sample             {"kind": "array", "dtype": "uint8", "shape": [3, 64, 64]} or
                     {"kind": "encoded"} (JPEG/PNG bytes decoded on read)
  files              {name: {"bytes": n, "sha256": hex}} for every data file: plain names of
                     regular files inside the pack (readers refuse anything else)
  layout             format details (dataset names, key format, shard pattern, ...)
  source             {"path": ..., "kind": imagefolder | arrays | listfile, "items": n,
                      "digest": sha256 of the listing}
  options            pack options that shaped the bytes (encode, compression, shard sizes,
                     follow_symlinks when set)
  skipped            [{"item": i, "path": ..., "error": ...}] source items left out ("item"
                     null: a folder, link or name left out while listing the source)
  created_by         "gpufeed <version>"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpufeed.formats.common import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    DataError,
    NotPackedError,
    atomic_write_json,
    pack_file,
)
from gpufeed.lock import busy_message

FORMATS = ("hdf5", "lmdb", "tar", "mmap")
MANIFEST_SCHEMA = 1


def manifest_path(dest: str | Path) -> Path:
    return Path(dest) / MANIFEST_NAME


def read_manifest(dest: str | Path) -> dict[str, Any]:
    """The manifest of a finished pack, or NotPackedError saying why DEST is not one."""
    dest = Path(dest)
    if dest.is_file() and dest.name == MANIFEST_NAME:
        dest = dest.parent
    path = manifest_path(dest)
    if not path.exists():
        if dest.name.endswith(PARTIAL_SUFFIX) or (dest / "state.json").exists():
            final = Path(str(dest).removesuffix(PARTIAL_SUFFIX))
            raise NotPackedError(
                busy_message(final, dest)
                or f"{dest}: unfinished pack (no {MANIFEST_NAME}); finish it with "
                f"`gpufeed pack SOURCE {final} --resume`"
            )
        partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
        if partial.exists():
            raise NotPackedError(
                busy_message(dest, partial)
                or f"{dest}: no {MANIFEST_NAME}; a pack into it is unfinished ({partial}); "
                f"finish it with `gpufeed pack SOURCE {dest} --resume`"
            )
        if not dest.exists():
            raise NotPackedError(f"{dest}: does not exist")
        raise NotPackedError(
            f"{dest}: no {MANIFEST_NAME}; not a gpufeed dataset (make one with `gpufeed pack`)"
        )
    try:
        manifest = json.loads(pack_file(dest, MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise DataError(f"{path}: not a gpufeed manifest (expected a JSON object with files)")
    fmt = manifest.get("format")
    if fmt not in FORMATS:
        raise DataError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version {manifest['format_version']} is newer than this gpufeed "
            f"reads ({FORMAT_VERSION}); upgrade gpufeed"
        )
    return manifest


def write_manifest(dest: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(manifest_path(dest), manifest)
