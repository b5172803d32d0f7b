"""An image-folder tree (class subfolders of images, torchvision's ImageFolder layout) read in
place: listed once as ``gpufeed pack`` lists it (gpufeed.formats.inplace.tree: the same
problems, the same symbolic-link policy), the list cached outside the data (the in-place index
folder, gpufeed.formats.inplace.webdataset.index_folder). Samples are ``(image, label)``, as a
pack of it gives them.

The cached list is used only while every folder it came from is the same folder: each one's
identity (device, inode, mtime_ns, ctime_ns; adding, removing or renaming a file changes its
folder's mtime and ctime, and a new tree made with the old mtimes has new inodes and ctimes).
A file read is opened as it was listed: a regular file is never read through a symbolic link
put there since, and a listed link must still lead inside the tree (unless
``follow_symlinks=True``); a file gone since is an error naming it, never another sample.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import (
    CorruptSampleError,
    GpufeedError,
    NotPackedError,
    StalePackError,
    UnsafePathError,
)
from gpufeed.formats.base import Reader
from gpufeed.formats.inplace.tree import scan_source
from gpufeed.formats.inplace.webdataset import cached_index, in_place_identity, index_folder
from gpufeed.formats.manifest import MANIFEST_NAME, PARTIAL_SUFFIX

__all__ = ["ImageFolderReader", "is_image_folder", "listing_path"]

# what to do about the listing's problems, read in place
IN_PLACE_FIX = (
    "Fix them, or pack the tree with `gpufeed pack --on-error skip`, which leaves them out "
    "and lists them in the manifest"
)
# a FIFO put where a file was listed must not block the open: O_NONBLOCK, then fstat
READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = READ | getattr(os, "O_NOFOLLOW", 0)


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


def _folders_stamp(root: Path, linked: list[str]) -> str:
    """The identities of the tree's folders (and of the folders outside it that the listing
    reached through links): what the cached list depends on."""
    h = hashlib.sha256()
    for top in (str(root), *linked):
        for dirpath, dirnames, _ in os.walk(top):
            dirnames.sort()
            try:
                ident = in_place_identity(os.stat(dirpath))
            except OSError as e:
                ident = f"unreadable {e.errno}"
            h.update(f"{dirpath}\t{ident}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def listing_path(root: Path, where: Path, follow_symlinks: bool = False) -> Path:
    """Where the listing of the tree at `root` is cached in the index folder `where`."""
    real = os.path.realpath(root) + ("\0follow" if follow_symlinks else "")
    key = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()
    return where / f"imagefolder-{key[:24]}.npz"


def _listing(root: Path, where: Path, follow_symlinks: bool) -> dict[str, Any]:
    stamp = _folders_stamp(root, [])  # before the listing: a change during it shows

    def fresh(cached: dict[str, Any]) -> bool:
        linked = json.loads(str(cached["linked"]))
        return str(cached["stamp"]) == stamp and str(cached["linked_stamp"]) == _folders_stamp(
            root, linked
        )

    def build() -> dict[str, Any]:
        listing = _list(root, follow_symlinks)
        linked = json.loads(str(listing["linked"]))
        return {**listing, "stamp": np.asarray(stamp), "linked_stamp": _folders_stamp(root, linked)}

    return cached_index(listing_path(root, where, follow_symlinks), fresh, build)


def _list(root: Path, follow_symlinks: bool) -> dict[str, Any]:
    try:
        src = scan_source(root, follow_symlinks=follow_symlinks)
        if src.kind != "imagefolder" or not src.classes:
            raise GpufeedError("its files are not images in class subfolders")
    except GpufeedError as e:
        raise NotPackedError(
            f"{root}: no {MANIFEST_NAME}, and not an image folder to read in place ({e}); "
            "make a pack with `gpufeed pack`"
        ) from None
    if src.outside:
        rel, real = src.outside[0]
        more = f" (and {len(src.outside) - 1} more)" if len(src.outside) > 1 else ""
        raise UnsafePathError(
            root / rel,
            f"symbolic link to {real}, outside {root}{more}: not read; pass "
            "follow_symlinks=True to read what the tree's links point to",
        )
    src.check("stop", fix=IN_PLACE_FIX)
    return {
        "rel": np.asarray(src.rel, dtype=str),
        "labels": src.labels,
        "classes": np.asarray(json.dumps(src.classes)),
        "linked": np.asarray(json.dumps(sorted(_outside(root, src.linked_dirs)))),
    }


def _outside(root: Path, dirs: set[str]) -> list[str]:
    """The folders not inside the tree (those inside are in its own stamp already)."""
    prefix = os.path.join(os.path.realpath(root), "")
    return [d for d in dirs if not os.path.join(d, "").startswith(prefix)]


class ImageFolderReader(Reader):
    """Encoded images read from their files: the (image, label) packs' reading, in place.

    follow_symlinks: as ``gpufeed pack``'s (gpufeed.formats.inplace.tree): read the files that the
    tree's symbolic links lead to outside it, and follow links to folders (loops and second
    links to one folder are still refused). Off by default: a link out of the tree is an
    UnsafePathError naming it (a tree from elsewhere may link ``a/key.png`` to
    ``~/.ssh/id_rsa``), and a link to a folder, like an unreadable folder or a broken link, is
    one of the listing's problems, a SourceError naming each, as ``gpufeed pack`` refuses them.
    """

    format_name = "imagefolder"
    checksums = False

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        index_dir: str | os.PathLike | None = None,
        follow_symlinks: bool = False,
    ):
        root = Path(path).absolute()
        listing = _listing(root, index_folder(index_dir), bool(follow_symlinks))
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
        self.follow_symlinks = bool(follow_symlinks)
        self.real_prefix = os.path.join(os.path.realpath(root), "")
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
        return [self._read(i) for i in indices.tolist()]

    def _read(self, i: int) -> bytes:
        path = self.location(i)
        try:
            fd = self._open_file(path)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise StalePackError(
                    f"{path}: sample {i}: gone since the tree was listed; open it again (it "
                    "is listed anew)"
                ) from None
            raise CorruptSampleError(path, i, f"unreadable: {e.strerror}") from None
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptSampleError(path, i, "not a regular file since it was listed")
            return f.read()

    def _open_file(self, path: str) -> int:
        """A descriptor of the listed file: not through a link, or through one that leads
        inside the tree (anywhere with follow_symlinks)."""
        try:
            return os.open(path, NOFOLLOW)
        except OSError as e:
            if e.errno != errno.ELOOP:  # ELOOP: the last component is a link
                raise
        real = os.path.realpath(path)
        if not self.follow_symlinks and not real.startswith(self.real_prefix):
            raise UnsafePathError(
                path,
                f"now a symbolic link to {real}, outside {self.root}: not read; pass "
                "follow_symlinks=True to read what the tree's links point to",
            )
        return os.open(real, READ)
