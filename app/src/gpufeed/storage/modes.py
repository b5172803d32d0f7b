"""Who may read the cache (storage/cache.py): folders 0700 and files 0600, unless the cache is
shared between users on purpose (shared=True, or $GPUFEED_CACHE_SHARED=1): modes then follow
the umask (a group-writable umask and a setgid group folder let a group share one cache)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gpufeed.errors import UsageError

CACHE_SHARED_ENV = "GPUFEED_CACHE_SHARED"
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
SHARED_DIR, SHARED_FILE = 0o777, 0o666  # less the umask


def cache_shared(shared: bool | None = None) -> bool:
    """`shared`, else whether $GPUFEED_CACHE_SHARED asks for a cache other users may read."""
    if shared is not None:
        return bool(shared)
    value = os.environ.get(CACHE_SHARED_ENV, "").strip().lower()
    if value in ("", "0", "no", "false", "off"):
        return False
    if value in ("1", "yes", "true", "on"):
        return True
    raise UsageError(f"${CACHE_SHARED_ENV}={value!r}: expected 1 (a shared cache) or 0")


def make_cache_dirs(root: Path, path: Path, shared: bool) -> None:
    """`path` (root itself or a folder under it) and the folders between, made 0700 (0777
    less the umask when `shared`); a private cache's first folder under root, when an older
    gpufeed left it open to others, is closed (what is inside is then out of their reach)."""
    mode = SHARED_DIR if shared else PRIVATE_DIR
    if not root.is_dir():
        os.makedirs(root, mode=mode, exist_ok=True)
    cur = root
    for i, part in enumerate(path.relative_to(root).parts):
        cur = cur / part
        try:
            os.mkdir(cur, mode)
        except FileExistsError:
            if i == 0 and not shared:
                _close_to_others(cur)


def _close_to_others(path: Path) -> None:
    """chmod 0700 a folder of ours that others may enter (made by an older gpufeed)."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, PRIVATE_DIR)
