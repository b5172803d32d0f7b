"""Free space on a filesystem. It imports nothing of gpufeed: errors.DiskFullError says what
is free where with it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["free_bytes"]


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or its
    nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
