"""An image-folder tree read in place (class subfolders of images, torchvision's ImageFolder
layout): listed once as ``gpufeed pack`` lists it (gpufeed.write.scan), the list cached
outside the data (the in-place index folder, gpufeed.formats.webdataset.index_folder), and
read again only when the tree's folders changed (their mtimes: adding, removing or renaming
a file changes its folder's). Samples are ``(image, label)``, as a pack of it gives them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import CorruptSampleError, GpufeedError, NotPackedError
from gpufeed.formats.base import Reader
from gpufeed.formats.manifest import MANIFEST_NAME, PARTIAL_SUFFIX
from gpufeed.formats.webdataset import cached_index, index_folder
from gpufeed.write.scan import scan_source

__all__ = ["ImageFolderReader", "is_image_folder"]


def is_image_folder(path: str | os.PathLike) -> bool:
    """A folder of class subfolders (no manifest, not a pack's staging folder)."""
    p = Path(path)
    if not p.is_dir() or p.name.endswith(PARTIAL_SUFFIX) or (p / MANIFEST_NAME).exists():
        return False
    if (p / "state.json").exists():
        return False
    try:
        return any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(p))
    except OSError:
        return False


def _folders_stamp(root: Path) -> str:
    """The tree's folders and their mtimes: what the cached list depends on."""
    h = hashlib.sha256()
    for dirpath, dirnames, _ in os.walk(root):
        dirnames.sort()
        h.update(f"{dirpath}\t{os.stat(dirpath).st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _listing(root: Path, where: Path) -> dict[str, Any]:
    key = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()
    stamp = _folders_stamp(root)
    return cached_index(
        where / f"imagefolder-{key[:24]}.npz",
        lambda cached: str(cached["stamp"]) == stamp,
        lambda: {**_list(root), "stamp": np.asarray(stamp)},
    )


def _list(root: Path) -> dict[str, Any]:
    try:
        src = scan_source(root)
        if src.kind != "imagefolder" or not src.classes:
            raise GpufeedError("its files are not images in class subfolders")
    except GpufeedError as e:
        raise NotPackedError(
            f"{root}: no {MANIFEST_NAME}, and not an image folder to read in place ({e}); "
            "make a pack with `gpufeed pack`"
        ) from None
    return {
        "rel": np.asarray(src.rel, dtype=str),
        "labels": src.labels,
        "classes": np.asarray(json.dumps(src.classes)),
    }


class ImageFolderReader(Reader):
    """Encoded images read from their files: the (image, label) packs' reading, in place."""

    format_name = "imagefolder"
    checksums = False

    def __init__(self, path: str | os.PathLike, *, index_dir: str | os.PathLike | None = None):
        root = Path(path).absolute()
        listing = _listing(root, index_folder(index_dir))
        classes = json.loads(str(listing["classes"]))
        count = len(listing["rel"])
        manifest = {
            "format": "imagefolder",
            "format_version": 1,
            "count": count,
            "classes": classes,
            "sample": {"kind": "encoded"},
            "files": {},
            "layout": {"root": str(root)},
        }
        super().__init__(root, manifest)
        self.rel = listing["rel"]
        self.labels = np.asarray(listing["labels"], dtype=np.int64)
        self.crc32 = np.zeros(count, dtype=np.uint32)

    def _open(self):
        return None

    def location(self, index: int) -> str:
        return str(self.root / str(self.rel[index]))

    def sources(self) -> list[str]:
        return [str(r) for r in self.rel]

    def data_files(self) -> list[str]:
        return []

    def read_batch(self, indices: np.ndarray):
        out = []
        for i in indices.tolist():
            try:
                out.append((self.root / str(self.rel[i])).read_bytes())
            except OSError as e:
                raise CorruptSampleError(self.location(i), i, f"unreadable: {e.strerror}") from None
        return out
