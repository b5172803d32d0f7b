"""What gpufeed may delete, and the one function that deletes folders.

gpufeed deletes or replaces only what it made:
- a finished pack: a folder holding a gpufeed manifest.json (`pack --overwrite` replaces it);
- its own unfinished DEST.partial: a folder holding gpufeed's state.json, or nothing but the
  pieces a pack makes before that file (the lock file, parts/ of part files, out/);
- the output of a command that registered how to tell it (:func:`register_owner`): a dataset
  `gpufeed synth` made (its synth.json; a crash's PATH.partial holds only its class folders
  of JPEGs), which only `synth --overwrite` replaces.
Never, whatever it holds: a symbolic link, the current folder or a folder holding it, a folder
that is or holds the pack's source (or lies inside a source folder). Anything else is refused
with a UsageError naming the folder and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from gpufeed.errors import UsageError
from gpufeed.formats.inplace.tree import Source
from gpufeed.formats.lock import LOCK_NAME, PackLock
from gpufeed.formats.manifest import MANIFEST_NAME, PARTIAL_SUFFIX

STATE_NAME = "state.json"
PARTS_DIR = "parts"
OUT_DIR = "out"
STREAMED_DIR = "streamed"  # a resumed tar pack's first shards, read back (gpufeed.write.direct)
REPLACED_DIR = "replaced"  # the pack being replaced, moved aside until the new one is in place
PARTIAL_ENTRIES = frozenset(
    {LOCK_NAME, STATE_NAME, STATE_NAME + ".tmp", PARTS_DIR, OUT_DIR, STREAMED_DIR, REPLACED_DIR}
)
PART_FILE = re.compile(r"part-\d{6}\.npz(\.tmp)?")


def _json_with(path: Path, key: str) -> bool:
    try:
        if not path.is_file():
            return False
        return key in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def is_pack(path: Path) -> bool:
    """A folder holding a gpufeed manifest."""
    return path.is_dir() and _json_with(path / MANIFEST_NAME, "gpufeed_manifest")


def is_partial(path: Path) -> bool:
    """gpufeed's own unfinished DEST.partial: its state.json, or nothing but the entries a
    pack makes there (a state.json cut short by a crash included)."""
    if not path.name.endswith(PARTIAL_SUFFIX) or not path.is_dir() or path.is_symlink():
        return False
    if _json_with(path / STATE_NAME, "source_digest"):
        return True
    try:
        if not set(os.listdir(path)) <= PARTIAL_ENTRIES:
            return False
        parts = path / PARTS_DIR
        return not parts.is_dir() or all(PART_FILE.fullmatch(n) for n in os.listdir(parts))
    except OSError:
        return False


# what gpufeed made, by the command that may replace it: (test, what it is, for messages).
# A command that writes output of its own registers here (gpufeed.tools.synth does).
OWNERS: dict[str, tuple[Callable[[Path], bool], str]] = {
    "pack": (
        lambda p: is_pack(p) or is_partial(p),
        f"a gpufeed pack (no gpufeed {MANIFEST_NAME} in it)",
    ),
}


def register_owner(owner: str, made_by_us: Callable[[Path], bool], what: str) -> None:
    """Let ``owner``'s output be replaced by it: ``made_by_us(path)`` tells its output (a
    marker file it writes), ``what`` names it in refusals ("a dataset gpufeed synth made")."""
    OWNERS[owner] = (made_by_us, what)


def source_clash(path: Path, source: Source | None) -> str | None:
    """Why `path` must not be written or deleted for this source, or None (always for
    samples written from Python: they have no source folder)."""
    if source is None or source.path is None:
        return None
    real = os.path.realpath(path)
    inside = real + os.sep
    for folder in sorted(source.real_dirs()):
        if folder == real:
            return "it is the source"
        if folder.startswith(inside):
            return f"it holds the source ({folder})"
    if source.kind == "listfile":
        if os.path.realpath(source.path).startswith(inside):
            return f"it holds the source list {source.path}"
    elif real.startswith(os.path.realpath(source.path) + os.sep):
        return f"it lies inside the source folder {source.path}"
    return None


def holds_cwd(path: Path) -> bool:
    """Whether `path` is the current folder or one of its parents."""
    real, cwd = os.path.realpath(path), os.path.realpath(os.getcwd())
    return cwd == real or cwd.startswith(real + os.sep)


def occupied(dest: Path) -> bool:
    """Whether something is at DEST. An empty folder is not (the finished pack is renamed over
    it, which deletes nothing), unless it is the current folder or holds it."""
    if dest.is_symlink():
        return True
    if not dest.exists():
        return False
    return not (dest.is_dir() and not any(dest.iterdir()) and not holds_cwd(dest))


def why_not_removable(path: Path, source: Source | None = None, owner: str = "pack") -> str | None:
    """The reason gpufeed must not delete `path`, or None when it may (see the module)."""
    if path.is_symlink():
        return "it is a symbolic link (gpufeed replaces real folders only)"
    if not path.is_dir():
        return "it is not a folder"
    if holds_cwd(path):
        return "it is the current folder or holds it"
    clash = source_clash(path, source)
    if clash:
        return clash
    made_by_us, made = OWNERS[owner]
    if made_by_us(path):
        return None
    if owner == "pack" and path.name.endswith(PARTIAL_SUFFIX):
        return "it holds files an unfinished gpufeed pack does not make"
    return f"it is not {made}"


def check_removable(path: Path, what: str, source: Source | None = None, owner="pack") -> None:
    """UsageError unless gpufeed may delete `path`; `what` says why it would; `owner`: which
    command's output it must be (OWNERS)."""
    reason = why_not_removable(path, source, owner)
    if reason:
        raise UsageError(
            f"{path}: refusing to {what}: {reason}. gpufeed deletes only packs it made; "
            "choose another destination or move this folder away yourself"
        )


def remove_tree(path: Path, what: str, source: Source | None = None, owner="pack") -> None:
    """The one way gpufeed deletes a folder: what it made (OWNERS: a pack or its own
    DEST.partial, a synth dataset; checked here, every time), or an entry of its own
    DEST.partial (its parts, output, or the pack it replaces)."""
    parent = path.parent
    if owner == "pack" and is_partial(parent) and path.name in PARTIAL_ENTRIES:
        if path.is_symlink() or not path.is_dir():
            raise UsageError(f"{path}: refusing to {what}: expected gpufeed's own folder")
    else:
        check_removable(path, what, source, owner)
    shutil.rmtree(path)


def clear_partial(partial: Path, what: str) -> None:
    """Empty gpufeed's own DEST.partial, keeping the lock file (and so the lock) in it."""
    if not is_partial(partial):
        check_removable(partial, what)  # raises: it is not ours
    for name in os.listdir(partial):
        path = partial / name
        if name == LOCK_NAME:
            continue
        if path.is_dir() and not path.is_symlink():
            remove_tree(path, what)
        else:
            path.unlink()


def remove_partial(partial: Path, lock: PackLock) -> None:
    """Delete gpufeed's own DEST.partial at the end of a pack, its lock file last and only
    while it is still the one `lock` holds (a waiting pack may already have made a new one)."""
    clear_partial(partial, "clean up the finished pack's staging folder")
    lock.unlink_if_ours()
    with contextlib.suppress(OSError):
        os.rmdir(partial)
