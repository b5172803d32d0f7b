"""Memory maps kept across readers in one process.

A new map of a file starts with no page-table entries: every page of a warm pass is a minor
fault again (docs/performance/page-cache-read-ahead.md, "Maps kept across passes"). Training
reopens a pack more often than it looks (a loader per epoch, a dataset per evaluation, the
suite's pass per loader), so the readers take their maps from here: the same file (path and
identity: device, inode, size, mtime) mapped the same way gets the map this process already
has, with its pages already mapped. At most ``KEEP_MAPS`` are kept (least recently used
dropped first); a map of a file that was replaced since is dropped when the new one is asked
for, so no reader sees old bytes. A kept map keeps its file open: disk space freed by
deleting a pack returns when the map is dropped (``forget_maps``; gpufeed's own replacement
of a pack, ``pack --overwrite`` or a Writer's ``overwrite=True``, does that) or the process
ends.

Maps inherited through fork stay valid in the child (read-only, shared file mappings), so a
forked DataLoader worker reuses them too.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

__all__ = ["KEEP_MAPS", "covers", "forget_maps", "kept_map", "kept_maps", "on_forget"]

KEEP_MAPS = 8
_MAPS: OrderedDict[tuple, Any] = OrderedDict()
_LOCK = threading.Lock()
# readers that keep maps of their own (LMDB's environments) register how to drop the idle ones
_FORGETTERS: list[Callable[[str | None], None]] = []


def on_forget(forget: Callable[[str | None], None]) -> None:
    """Have :func:`forget_maps` also call ``forget(path or None)`` (a file or a folder: see
    :func:`covers`)."""
    _FORGETTERS.append(forget)


def kept_map(path: Path, identity: Hashable, how: Hashable, make: Callable[[], Any]) -> Any:
    """The map of ``path`` (whose file identity is ``identity``) made by ``make()`` and
    described by ``how`` (dtype, offset, shape: whatever tells two maps of one file apart):
    the kept one when this process has it, else a new one, kept."""
    path = str(path)
    key = (path, identity, how)
    with _LOCK:
        found = _MAPS.get(key)
        if found is not None:
            _MAPS.move_to_end(key)
            return found
        for stale in [k for k in _MAPS if k[0] == path and k[1] != identity]:
            del _MAPS[stale]  # that file was replaced: its map must not be handed out again
    made = make()
    with _LOCK:
        made = _MAPS.setdefault(key, made)
        _MAPS.move_to_end(key)
        while len(_MAPS) > KEEP_MAPS:
            _MAPS.popitem(last=False)
    return made


def kept_maps() -> list[str]:
    """The paths of the maps kept now, least recently used first."""
    with _LOCK:
        return [k[0] for k in _MAPS]


def covers(path: str | Path, forgotten: str | Path | None) -> bool:
    """Whether forgetting ``forgotten`` (a file, a pack folder, or None: everything) drops
    what is kept of ``path``."""
    if forgotten is None:
        return True
    path, forgotten = os.path.realpath(path), os.path.realpath(forgotten)
    return path == forgotten or path.startswith(forgotten.rstrip(os.sep) + os.sep)


def forget_maps(path: str | Path | None = None) -> None:
    """Drop the kept maps (of the file ``path``, or of every file in the folder ``path``,
    when given): their files close once no array over them is left. Pages a process maps
    cannot be evicted (posix_fadvise DONTNEED skips them): a benchmark's cold pass forgets
    the maps first; a pack about to be replaced or deleted forgets its folder, so its disk
    space is not held."""
    with _LOCK:
        for key in [k for k in _MAPS if covers(k[0], path)]:
            del _MAPS[key]
    for forget in _FORGETTERS:
        forget(None if path is None else str(path))
