"""manifest.json: what a packed dataset holds. Written last, so its presence means complete.

Fields:
  gpufeed_manifest   1 (this file's own schema version)
  format             hdf5 | lmdb | tar | mmap
  format_version     on-disk layout version: 1 for array/encoded samples, 2 for fields
  count              samples stored
  classes            class names, label i is classes[i] (null when the source had none)
  sample             {"kind": "array", "dtype": "uint8", "shape": [3, 64, 64]} or
                     {"kind": "encoded"} (JPEG/PNG bytes decoded on read) or
                     {"kind": "fields", "fields": [...]} (multi-field samples: formats/schema.py)
  files              {name: {"bytes": n, "sha256": hex}} for every data file: plain names of
                     regular files inside the pack (readers refuse anything else)
  layout             format details (dataset names, key format, shard pattern, ...)
  source             {"path": ..., "kind": imagefolder | arrays | listfile | python, "items": n,
                      "digest": sha256 of the listing}
  options            pack options that shaped the bytes (encode, compression, shard sizes,
                     follow_symlinks when set)
  skipped            [{"item": i, "path": ..., "error": ...}] source items left out ("item"
                     null: a folder, link or name left out while listing the source)
  created_by         "gpufeed <version>"
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError, NotPackedError, UnsafePathError
from gpufeed.formats import FORMATS
from gpufeed.formats.checksums import sha256_file
from gpufeed.formats.files import atomic_write_json
from gpufeed.formats.inplace import hdf5_needs_datasets, is_hdf5_file
from gpufeed.formats.lock import busy_message
from gpufeed.formats.spec import FORMAT_VERSION, MANIFEST_NAME, SampleSpec

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "check_manifest",
    "PARTIAL_SUFFIX",
    "SOURCES_NAME",
    "file_entry",
    "is_hugging_face_folder",
    "manifest_path",
    "pack_file",
    "read_manifest",
    "read_sources",
    "unsafe_name",
    "write_manifest",
    "write_sources",
]

SOURCES_NAME = "sources.txt"
# An unfinished pack of DEST is written in DEST.partial (gpufeed.write.pack)
PARTIAL_SUFFIX = ".partial"
MANIFEST_SCHEMA = 1


def unsafe_name(name: str) -> str | None:
    """Why `name` cannot be a file inside a pack, by the name alone (absolute, "..", empty or
    "." parts, a NUL or a backslash), or None: pack_file's rule, also applied to a remote
    pack's names before anything is fetched or linked (storage/remote.py)."""
    name = str(name)
    parts = name.split("/")
    if os.path.isabs(name) or ".." in parts:
        return "leads outside the pack"
    if any(part in ("", ".") for part in parts) or "\0" in name or "\\" in name:
        return "is not a plain file name inside the pack"
    return None


def pack_file(root: str | os.PathLike, name: str) -> Path:
    """root/name for a file a manifest names, refusing names that leave the pack (absolute,
    "..", a symlink out of it) and anything but a regular file: a reader never follows a
    manifest out of the pack or opens a device or FIFO. A missing file is returned (its
    reader reports it when it opens it)."""
    root = Path(root)
    path = root / str(name)
    unsafe = unsafe_name(name)
    if unsafe:
        raise UnsafePathError(path, f"{unsafe}; it is not read")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if "/" in name or stat.S_ISLNK(st.st_mode):  # a link on the way: where does it lead?
        real, top = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise UnsafePathError(path, f"leads outside the pack (to {real}); it is not read")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return path
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(path, "is not a regular file (a pack holds regular files only)")
    return path


def read_sources(path: Path) -> list[str]:
    """sources.txt: one source path per line, "\\n" only (names holding a newline are refused
    when packing); names that are not UTF-8 are kept byte for byte (surrogateescape)."""
    lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def write_sources(path: Path, names: Iterable[str]) -> None:
    """One name a line, written in runs of lines (millions of names: bounded memory)."""
    names = iter(names)
    with open(path, "wb") as f:
        while run := list(itertools.islice(names, 65536)):
            f.write(("\n".join(run) + "\n").encode("utf-8", "surrogateescape"))


def file_entry(root: Path, name: str, sha256: str | None = None) -> dict[str, Any]:
    """The manifest's entry for file `name`: its size and sha256 (read from the file, unless
    its writer made it from the bytes it wrote)."""
    p = root / name
    return {"bytes": p.stat().st_size, "sha256": sha256 or sha256_file(p)}


def manifest_path(dest: str | Path) -> Path:
    return Path(dest) / MANIFEST_NAME


def _not_a_pack(dest: Path) -> str:
    if is_hdf5_file(dest):  # someone else's HDF5 file, or a file inside a pack
        return hdf5_needs_datasets(dest)
    return f"{dest}: no {MANIFEST_NAME}; not a gpufeed dataset (make one with `gpufeed pack`)"


def read_manifest(dest: str | Path) -> dict[str, Any]:
    """The manifest of a finished pack, or NotPackedError saying why DEST is not one."""
    dest = Path(dest)
    if dest.is_file() and dest.name == MANIFEST_NAME:
        dest = dest.parent
    path = manifest_path(dest)
    if not path.exists():
        if is_hugging_face_folder(dest):
            raise NotPackedError(_hugging_face_message(dest))
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
                + _how_to_finish(partial, dest)
            )
        if not dest.exists():
            raise NotPackedError(f"{dest}: does not exist")
        raise NotPackedError(_not_a_pack(dest))
    try:
        manifest = json.loads(pack_file(dest, MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from None
    return check_manifest(manifest, path)


def check_manifest(manifest: Any, where: str | os.PathLike) -> dict[str, Any]:
    """The manifest's structure, checked once where it is read (`where`: its file or URL) so
    that no reader meets a field of the wrong type: every field a reader, verify or inspect
    reads has its JSON type, counts and sizes are non-negative ints, the format is known and
    its layout has what its reader needs. A DataError names the field and what was expected.
    File names are checked for type here; whether they stay inside the pack is pack_file's
    (verify reports such names instead of refusing the pack)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise DataError(f"{where}: not a gpufeed manifest (expected a JSON object with files)")
    fmt = manifest.get("format")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise DataError(f"{where}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    _expect(where, manifest, "gpufeed_manifest", _COUNT, optional=True)
    _expect(where, manifest, "format_version", _COUNT, optional=True)
    if (manifest.get("format_version") or 0) > FORMAT_VERSION:
        raise DataError(
            f"{where}: format_version {manifest['format_version']} is newer than this gpufeed "
            f"reads ({FORMAT_VERSION}); upgrade gpufeed"
        )
    _expect(where, manifest, "count", _COUNT)
    try:
        SampleSpec.from_json(manifest.get("sample"))
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    _expect(where, manifest, "classes", _NAMES, optional=True)  # class_to_idx needs them distinct
    for name, entry in manifest.get("files", {}).items():
        field = f"files[{name!r}]"
        if not name or not isinstance(entry, dict):
            _bad(where, field, entry, "an object with bytes and sha256 under a non-empty name")
        _expect(where, entry, "bytes", _COUNT, optional=True, field=f"{field}.bytes")
        _expect(where, entry, "sha256", _TEXT, optional=True, field=f"{field}.sha256")
    _expect(where, manifest, "layout", _OBJECT, optional=True)
    layout = manifest.get("layout") or {}
    for key, kind, optional in LAYOUT_FIELDS.get(fmt, ()):
        _expect(where, layout, key, kind, optional=optional, field=f"layout.{key}")
    for key, kind in (("source", _OBJECT), ("options", _OBJECT), ("skipped", _LIST)):
        _expect(where, manifest, key, kind, optional=True)
    _expect(where, manifest, "created_by", _TEXT, optional=True)
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_list_of(test) -> Any:
    return lambda value: isinstance(value, list) and all(test(x) for x in value)


# what a field must be: (its test, what the message says was expected)
_COUNT = (_is_count, "a non-negative int")
_TEXT = (lambda value: isinstance(value, str), "a string")
_OBJECT = (lambda value: isinstance(value, dict), "an object")
_LIST = (lambda value: isinstance(value, list), "a list")
_STRINGS = (_is_list_of(_TEXT[0]), "a list of strings")
_NAMES = (lambda v: _STRINGS[0](v) and len(set(v)) == len(v), "a list of distinct strings")
_COUNTS = (_is_list_of(_is_count), "a list of non-negative ints")

# the layout fields each format's reader reads, and whether they may be left out (an mmap
# pack written before containers is npy); the others are informative (inspect shows them)
LAYOUT_FIELDS: dict[str, tuple[tuple[str, tuple, bool], ...]] = {
    "tar": (("shards", _STRINGS, False), ("shard_counts", _COUNTS, False)),
    "mmap": (("container", _TEXT, True),),
}


def _expect(where, obj: dict, key: str, kind: tuple, *, optional=False, field=None) -> None:
    """obj[key] is of `kind` (null or absent allowed where optional), else a DataError."""
    value = obj.get(key)
    if value is None and optional:
        return
    test, expected = kind
    if not test(value):
        _bad(where, field or key, value, expected)


def _bad(where, field: str, value: Any, expected: str) -> None:
    found = "missing" if value is None else f"{type(value).__name__} {repr(value)[:60]}"
    raise DataError(
        f"{where}: field {field} is {found}, expected {expected}; the manifest is damaged or "
        "was not written by gpufeed (re-pack the dataset, or restore its manifest.json)"
    )


def is_hugging_face_folder(dest: Path) -> bool:
    """A folder made by Hugging Face datasets' save_to_disk: a Dataset (state.json listing
    its "_data_files", beside dataset_info.json and the .arrow files) or a DatasetDict
    (dataset_dict.json over one such folder per split). Its state.json is not our
    unfinished pack's."""
    if (dest / "dataset_dict.json").is_file():
        return True
    if not (dest / "dataset_info.json").is_file():
        return False
    try:
        state = json.loads((dest / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = None
    return (isinstance(state, dict) and "_data_files" in state) or any(dest.glob("*.arrow"))


def _hugging_face_message(dest: Path) -> str:
    return (
        f"{dest}: a Hugging Face datasets folder (save_to_disk's Arrow files), not a gpufeed "
        "pack: gpufeed.open_dataset(PATH) reads it in place (a DatasetDict: one split's "
        "folder), `gpufeed pack PATH DEST -f lmdb` converts it; both need pyarrow: "
        "pip install 'gpufeed[parquet]'"
    )


def _how_to_finish(partial: Path, dest: Path) -> str:
    """A pack of a source (a folder, a list file) is finished by `gpufeed pack --resume`;
    one written from Python by the call that wrote it, with resume=True."""
    try:
        state = json.loads((partial / "state.json").read_text())
        writer, source = state.get("writer"), state.get("source")
    except (OSError, ValueError, AttributeError):
        writer, source = False, None
    if writer and not source:
        return (
            "it was written from Python and not finished (the writer stopped or crashed): "
            f"continue it with gpufeed.pack(fn, inputs, {str(dest)!r}, resume=True) or "
            f"gpufeed.Writer({str(dest)!r}, ..., resume=True) (write from sample `written` on), "
            "or start over with overwrite=True"
        )
    return f"finish it with `gpufeed pack {source or 'SOURCE'} {dest} --resume`"


def write_manifest(dest: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(manifest_path(dest), manifest)
