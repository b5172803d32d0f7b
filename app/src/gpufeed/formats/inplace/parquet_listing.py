"""Which Parquet or Arrow files a path names (a file, a glob, a folder in the Hub's layout, a
``save_to_disk`` folder), without pyarrow: what ``open_dataset`` asks before it reads them
(gpufeed.formats.inplace.parquet); storage/parquet_remote.py applies the same rules to a
listing of objects (state_names, hidden, one_split)."""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path, PurePath

from gpufeed.errors import DataError, NotPackedError, UsageError

__all__ = [
    "PARQUET_MAGIC",
    "glob_files",
    "has_magic",
    "hidden",
    "is_glob",
    "is_parquet",
    "one_split",
    "parquet_files",
    "state_names",
]

PARQUET_MAGIC = b"PAR1"
HUB_SHARD = re.compile(r"(.+)-\d+-of-\d+$")  # data/train-00000-of-00012.parquet
SPLIT_FOLDERS = {"train", "test", "validation", "valid", "val", "dev"}


def is_glob(path: str) -> bool:
    """Whether a path (or one segment of a URL's) is a glob pattern."""
    return any(c in path for c in "*?[")


def glob_files(pattern: str) -> list[Path]:
    """The files a glob matches (``**`` spans folders), sorted."""
    return [Path(p) for p in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(p)]


def _hf_files(folder: Path) -> list[Path] | None:
    """The .arrow files a save_to_disk folder's state.json lists (plain names in it)."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise NotPackedError(
            f"{folder}: a Hugging Face datasets folder holding a DatasetDict (splits "
            f"{', '.join(splits) or 'none'}); open one split's folder, e.g. "
            f"{folder / (splits[0] if splits else 'train')}"
        )
    try:
        text = (folder / "state.json").read_bytes()
    except OSError:
        return None
    names = state_names(text, folder / "state.json")
    return None if names is None else [folder / name for name in names]


def state_names(text: bytes, where) -> list[str] | None:
    """The file names a save_to_disk folder's state.json (`text`, read from `where`) lists,
    each a plain name in the folder (else a DataError naming `where`); None: not such a file."""
    try:
        names = [str(d["filename"]) for d in json.loads(text)["_data_files"]]
    except (ValueError, KeyError, TypeError):
        return None
    for name in names:
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise DataError(f"{where}: lists {name!r}, not a file in the folder")
    return names


def parquet_files(path: str | os.PathLike) -> list[Path] | None:
    """The Parquet or Arrow files `path` names (module docstring), in order; None when it
    names none (no pyarrow needed to tell)."""
    text = os.fspath(path)
    if is_glob(text):
        files = glob_files(text)
        files = [p for p in files if p.suffix in (".parquet", ".arrow")]
        return files or None
    p = Path(text)
    if p.is_file():
        return [p] if p.suffix in (".parquet", ".arrow") or has_magic(p) else None
    if not p.is_dir():
        return None
    if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
        listed = _hf_files(p)
        if listed is not None:
            return listed
    files = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not hidden(f.relative_to(p)))
    if files:
        one_split(p, files)
    return files or None


def has_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def hidden(rel: PurePath) -> bool:
    return any(part.startswith((".", "_")) for part in rel.parts)


def one_split(folder, files: list[PurePath], prefix: str = "") -> None:
    """A folder holding several splits (train-*, test-*; or train/, test/) is refused: read
    together they would mix them. `prefix` + each file is what open_dataset takes."""
    splits: dict[str, str] = {}
    for f in files:
        m = HUB_SHARD.fullmatch(f.stem)
        if m:
            splits.setdefault(m.group(1), prefix + str(f.parent / f"{m.group(1)}-*.parquet"))
        elif f.parent.name in SPLIT_FOLDERS:
            splits.setdefault(f.parent.name, prefix + str(f.parent / "*.parquet"))
    if len(splits) > 1:
        raise UsageError(
            f"{folder}: holds the splits {', '.join(sorted(splits))}; read one, e.g. "
            f"open_dataset({next(iter(splits.values()))!r})"
        )


def is_parquet(path: str | os.PathLike) -> bool:
    try:
        return parquet_files(path) is not None
    except (UsageError, DataError):
        return True  # its reader says why it cannot be read
