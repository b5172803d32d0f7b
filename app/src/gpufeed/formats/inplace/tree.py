"""Listing a pack's source: which files, in which order, with which labels.

Sources: a folder of images, of .npy/.pt files, of .txt files or of .wav files (class
subfolders, or flat with optional NAME.cls label sidecars; one kind of file a folder; .txt
files are samples only where nothing else is: beside others they are notes), or a list file of
`path label` lines (a label is an integer class, or any number: a float target).

Nothing is dropped silently. Every folder that cannot be read, every symbolic link that is not
followed, every second way to the same file or folder and every file name sources.txt cannot
hold is a *problem*, listed with its path: pack() stops on the first ones (on_error="stop") or
leaves them out and lists them in the manifest (on_error="skip"). A class folder that had a
problem stays a class (with fewer or no samples), so later class indices never shift.

Symbolic links (the policy):
- the SOURCE path itself may be a link: it is what the user named;
- a link to a folder is not followed by default (a problem: "not followed"); with
  follow_symlinks=True it is, unless it leads to a folder already listed, by (st_dev, st_ino):
  a loop (`ln -s . cls/self`) or a second link to the same folder is a problem, never a
  second copy of its files;
- a link to a file is read as the file it points to when that is inside SOURCE (its real
  path under SOURCE's); one leading out of it (`a/key.png -> ~/.ssh/id_rsa` in a tree made by
  someone else) is a problem ("outside the source folder") and listed in Source.outside,
  unless follow_symlinks=True, which reads it wherever it is. A file reached twice (a link to a
  file that is listed already, or two links to one file) is a problem for every way but one,
  the real file's own entry kept. Hard links are separate files;
- a broken link with a sample's extension, or a FIFO/device with one, is a problem.

The same listing and policy serve a tree read in place (gpufeed.formats.inplace.imagefolder).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpufeed.errors import SourceError, UsageError

IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"})
ARRAY_EXTS = frozenset({".npy", ".pt"})
TEXT_EXTS = frozenset({".txt"})
AUDIO_EXTS = frozenset({".wav"})
SUPPORTED_EXTS = IMAGE_EXTS | ARRAY_EXTS | TEXT_EXTS | AUDIO_EXTS
# a source file's kind, by its extension; a folder holds one kind
KINDS = {"images": IMAGE_EXTS, "arrays": ARRAY_EXTS, "text": TEXT_EXTS, "audio": AUDIO_EXTS}
PACK_FIX = "Fix them, or pass --on-error skip to leave them out (listed in the manifest)"


def suffix(path: str) -> str:
    """Path(path).suffix, lower-cased, without making a Path (a listing of 100,000 files
    made 200,000 of them)."""
    name = path[path.rfind("/") + 1 :] if os.sep == "/" else Path(path).name
    i = name.rfind(".")
    return name[i:].lower() if 0 < i < len(name) - 1 else ""


def file_kind(path: str) -> str | None:
    """images | arrays | text | audio, by the file's extension; None for any other."""
    ext = suffix(path)
    return next((kind for kind, exts in KINDS.items() if ext in exts), None)


@dataclass
class Source:
    """A listing of source files: parallel lists, fixed before any is read."""

    path: Path
    kind: str  # imagefolder | arrays | text | audio | listfile
    paths: list[str]  # absolute
    rel: list[str]  # as reported (relative to the source root)
    labels: np.ndarray  # int64, -1 when unknown
    classes: list[str] | None
    # (path relative to the source root, what is wrong): left out of `paths`
    problems: list[tuple[str, str]] = field(default_factory=list)
    # real folders whose files the listing reaches through symbolic links
    linked_dirs: set[str] = field(default_factory=set)
    # float64 targets: a list file whose labels are not all integers (labels are then -1)
    targets: np.ndarray | None = None
    # (path relative to the source root, its real path): file links leading out of the
    # source, not followed (also in `problems`)
    outside: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths)

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.kind, self.classes]).encode())
        for rel, label in zip(self.rel, self.labels.tolist(), strict=True):
            h.update(f"{rel}\t{label}\n".encode("utf-8", "surrogateescape"))
        for rel, error in self.problems:
            h.update(f"!{rel}\t{error}\n".encode("utf-8", "surrogateescape"))
        if self.targets is not None:
            h.update(self.targets.astype("<f8").tobytes())
        return h.hexdigest()

    def real_dirs(self) -> set[str]:
        """Real paths of the folders that hold source files (a destination must be none of
        them and hold none of them)."""
        if self.kind == "listfile":
            dirs = {os.path.dirname(p) for p in self.paths}
        else:
            dirs = {str(self.path)}
        return {os.path.realpath(d) for d in dirs} | self.linked_dirs

    def check(self, on_error: str, fix: str = PACK_FIX) -> None:
        """on_error="stop": problems found while listing are an error naming them (and
        saying `fix`, what to do)."""
        if on_error != "stop" or not self.problems:
            return
        shown = "; ".join(f"{rel}: {error}" for rel, error in self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        raise SourceError(
            f"{self.path}: {len(self.problems)} problem(s) listing the source: {shown}{more}. {fix}"
        )


class _Walker:
    """Depth-first listing in sorted order (a folder's files, then its subfolders), as
    os.walk(topdown) with sorted names gives, with the symlink policy above."""

    def __init__(self, root: Path, follow_symlinks: bool, exts: frozenset[str]):
        self.root = root
        self.exts = exts
        self.prefix = os.path.join(str(root), "")  # every listed path starts with it
        self.follow = follow_symlinks
        self.seen_dirs: dict[tuple[int, int], str] = {}
        self.problems: list[tuple[str, str]] = []
        self.linked_dirs: set[str] = set()
        self.outside: list[tuple[str, str]] = []
        self.real_prefix = os.path.join(os.path.realpath(root), "")

    def rel(self, path: str) -> str:
        if path.startswith(self.prefix):
            return path[len(self.prefix) :]  # os.path.relpath's answer, at a tenth of its cost
        return os.path.relpath(path, self.root)

    def problem(self, path: str, error: str) -> None:
        self.problems.append((self.rel(path), error))

    def enter(self, path: str, real: str) -> bool:
        """Register a folder about to be listed; False (and a problem) if listed before."""
        try:
            st = os.stat(path)
        except OSError as e:
            self.problem(path, f"cannot read folder: {e.strerror}")
            return False
        key = (st.st_dev, st.st_ino)
        first = self.seen_dirs.setdefault(key, path)
        if first != path:
            self.problem(
                path,
                f"symbolic link to {self.rel(first)}, a folder listed already (a loop, or a "
                "second link to it): not followed again; remove the link",
            )
            return False
        return True

    def files(self, top: str, top_real: str) -> list[tuple[str, str, bool]]:
        """(path, real path, reached through a file link) of every sample file under top."""
        found: list[tuple[str, str, bool]] = []
        if not self.enter(top, top_real):
            return found
        stack = [(top, top_real)]
        while stack:
            folder, real = stack.pop()
            try:
                with os.scandir(folder) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as e:
                self.problem(folder, f"cannot read folder: {e.strerror}")
                continue
            subdirs = []
            for entry in entries:
                sub = self._entry(entry, os.path.join(real, entry.name), found)
                if sub is not None:
                    subdirs.append(sub)
            stack.extend(reversed(subdirs))
        return found

    def _entry(self, entry: os.DirEntry, real: str, found: list) -> tuple[str, str] | None:
        """Add a sample file to `found`, or return a folder to descend into."""
        sample = suffix(entry.name) in self.exts
        if entry.is_symlink():
            try:
                st = os.stat(entry.path)
            except OSError:
                if sample:
                    self.problem(entry.path, "broken symbolic link (its target is missing)")
                return None
            if stat.S_ISDIR(st.st_mode):
                return self._linked_dir(entry.path)
            real = os.path.realpath(entry.path)
            if sample and not self.follow and not real.startswith(self.real_prefix):
                self._outside(entry.path, real)
            elif sample and stat.S_ISREG(st.st_mode):
                self._add(entry.path, real, True, found)
            elif sample:
                self.problem(entry.path, "links to something that is not a regular file")
            return None
        if entry.is_dir(follow_symlinks=False):
            return (entry.path, real) if self.enter(entry.path, real) else None
        if sample and entry.is_file(follow_symlinks=False):
            self._add(entry.path, real, False, found)
        elif sample:
            self.problem(entry.path, "not a regular file (a FIFO, socket or device)")
        return None

    def _linked_dir(self, path: str) -> tuple[str, str] | None:
        if not self.follow:
            self.problem(
                path,
                "symbolic link to a folder: not followed (pass --follow-symlinks to pack "
                "what it points to)",
            )
            return None
        real = os.path.realpath(path)
        if not self.enter(path, real):
            return None
        self.linked_dirs.add(real)
        return path, real

    def _outside(self, path: str, real: str) -> None:
        self.outside.append((self.rel(path), real))
        self.problem(
            path,
            f"symbolic link to {real}, outside the source folder: not followed (pass "
            "--follow-symlinks to read what it points to)",
        )

    def _add(self, path: str, real: str, linked: bool, found: list) -> None:
        if "\n" in os.path.basename(path):
            self.problem(path, "file name holds a line break; rename the file")
            return
        if linked:
            self.linked_dirs.add(os.path.dirname(real))
        found.append((path, real, linked))

    def drop_duplicates(self, found: list[tuple[str, str, bool]]) -> list[int]:
        """Positions in `found` to keep: a file reached twice is kept once, by its own
        entry if it has one (else by its first link); every other way is a problem."""
        keeper: dict[str, int] = {}
        for i, (_, real, linked) in enumerate(found):
            j = keeper.get(real)
            if j is None or (found[j][2] and not linked):
                keeper[real] = i
        keep = []
        for i, (path, real, _) in enumerate(found):
            j = keeper[real]
            if j == i:
                keep.append(i)
            else:
                self.problem(
                    path,
                    f"reaches {self.rel(found[j][0])} again (symbolic link): listed once; "
                    "remove the link",
                )
        return keep


def scan_source(source: str | os.PathLike, follow_symlinks: bool = False) -> Source:
    """List a source: an image-folder tree (class subfolders), a folder of .npy/.pt files
    (class subfolders, or flat with optional NAME.cls label sidecars), or a list file of
    `path label` lines (relative paths resolve against the list file's folder). Problems
    (see the module's docstring) are in Source.problems; Source.check raises on them."""
    root = Path(source).absolute()
    if not root.exists():
        raise UsageError(f"{root}: source does not exist")
    if root.is_file():
        return _scan_list_file(root)
    if not root.is_dir():
        raise UsageError(f"{root}: source is not a folder or a list file")
    # .txt files are samples only in a folder of nothing else: beside images, arrays or
    # audio they are notes (README.txt, labels.txt), never listed, as they always were
    src = _scan_folder(root, follow_symlinks, SUPPORTED_EXTS - TEXT_EXTS)
    if not src.paths:
        text = _scan_folder(root, follow_symlinks, TEXT_EXTS)
        src = text if text.paths or not src.problems else src
    if not src.paths and not src.problems:
        raise UsageError(
            f"{root}: no source files found (looked for {', '.join(sorted(SUPPORTED_EXTS))})"
        )
    return src


def _scan_folder(root: Path, follow_symlinks: bool, exts: frozenset[str]) -> Source:
    """The listing of the files with these extensions (and the problems met)."""
    walker = _Walker(root, follow_symlinks, exts)
    real_root = os.path.realpath(root)
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise SourceError(f"{root}: cannot read the source folder: {e.strerror}") from None
    walker.enter(str(root), real_root)
    top: list[tuple[str, str, bool]] = []  # files at the top level
    classes: list[str] = []
    found: list[tuple[str, str, bool]] = []
    labels: list[int] = []
    for entry in entries:
        before = len(walker.problems)
        folder = walker._entry(entry, os.path.join(real_root, entry.name), top)
        files = walker.files(*folder) if folder is not None else []
        # a class folder with a problem (unreadable, a link not followed) stays a class
        had_problem = len(walker.problems) > before and (folder or _links_to_dir(entry))
        if files or had_problem:
            classes.append(entry.name)
            found += files
            labels += [len(classes) - 1] * len(files)
    if classes:  # a .txt beside class folders is a note (README.txt), as it always was
        top = [t for t in top if suffix(t[0]) not in TEXT_EXTS]
    if top and classes:
        raise UsageError(
            f"{root}: has files at the top level ({os.path.basename(top[0][0])}) and class "
            f"subfolders ({classes[0]}/); put every file in a class subfolder or none"
        )
    if classes:
        keep = walker.drop_duplicates(found)
        found, labels = [found[i] for i in keep], [labels[i] for i in keep]
    else:
        keep = walker.drop_duplicates(top)
        found = [top[i] for i in keep]
        labels = [_sidecar_label(Path(p)) for p, _, _ in found]
    paths = [p for p, _, _ in found]
    kind = _check_kinds(root, paths)
    rel = [walker.rel(p) for p in paths]
    return Source(
        root,
        kind,
        paths,
        rel,
        np.asarray(labels, dtype=np.int64),
        classes or None,
        walker.problems,
        walker.linked_dirs,
        outside=walker.outside,
    )


def _links_to_dir(entry: os.DirEntry) -> bool:
    return entry.is_symlink() and os.path.isdir(entry.path)


def _sidecar_label(path: Path) -> int:
    side = path.with_suffix(".cls")
    if not side.exists():
        return -1
    text = side.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise SourceError(f"{side}: label sidecar holds {text!r}, expected an integer") from None


def first_of_each_kind(files: list[str]) -> dict[str | None, str]:
    """kind -> the first file of that kind (None: files of no known kind)."""
    first: dict[str | None, str] = {}
    for f in files:
        first.setdefault(file_kind(f), f)
    return first


def mixed_kinds_message(where: Path, first: dict[str | None, str], base: Path) -> str:
    shown = " and ".join(
        f"{kind or 'other'} ({os.path.relpath(f, base)})" for kind, f in first.items()
    )
    hint = " or list them in a list file" if set(first) == {"images", "arrays"} else ""
    return f"{where}: mixes kinds of files: {shown}; pack each kind separately{hint}"


def _check_kinds(root: Path, files: list[str]) -> str:
    first = first_of_each_kind(files)
    if len(first) > 1:
        raise UsageError(mixed_kinds_message(root, first, root))
    kind = next(iter(first), "images")
    return "imagefolder" if kind == "images" else kind


def _scan_list_file(path: Path) -> Source:
    base = path.parent
    paths, rel, labels, lines = [], [], [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        msg = f"{path}: list file is not UTF-8 text ({e.reason} at byte {e.start})"
        raise UsageError(msg) from None
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, label = line.rpartition(" ")
        if not sep:
            name, label = label, None
        labels.append(_list_label(path, lineno, line, label))
        lines.append(lineno)
        name = name.strip()
        p = Path(name)
        paths.append(str(p if p.is_absolute() else base / p))
        rel.append(name)
    if not paths:
        raise UsageError(f"{path}: list file has no `path label` lines")
    if all(v is None or isinstance(v, int) for v in labels):
        ints = np.asarray([-1 if v is None else v for v in labels], dtype=np.int64)
        return Source(path, "listfile", paths, rel, ints, None)
    if None in labels:  # a float target for some lines, none for this one
        lineno = lines[labels.index(None)]
        raise UsageError(
            f"{path}:{lineno}: has no label, and other lines have number targets; give every "
            "line one"
        )
    targets = np.asarray(labels, dtype=np.float64)
    unknown = np.full(len(paths), -1, dtype=np.int64)
    return Source(path, "listfile", paths, rel, unknown, None, targets=targets)


def _list_label(path: Path, lineno: int, line: str, label: str | None) -> int | float | None:
    """A line's label: an int (a class), a float (a target: 0.5, 1e-3), or None (none)."""
    if label is None:
        return None
    try:
        return int(label)
    except ValueError:
        pass
    try:
        return float(label)
    except ValueError:
        raise UsageError(
            f"{path}:{lineno}: expected `path label` (an integer class or a number), found {line!r}"
        ) from None
