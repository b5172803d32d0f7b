"""Fixtures for the preflight tests: one sandbox per session (see preflight_harness).

/dev/shm sizes come from the real df on real tmpfs mounts (64 MiB and 4 GiB; tmpfs only
reserves what is written). Mounting needs root; without it the small-shm scenarios are
skipped with the reason and the big one falls back to the sandbox's own filesystem.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from preflight_harness import Sandbox  # noqa: E402


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode == 0


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    # Not pytest's tmp_path: that is mode 0700, and one test runs the preflight as nobody.
    root = Path(tempfile.mkdtemp(prefix="gpufeed-preflight-"))
    root.chmod(0o755)
    mounted: list[Path] = []
    small = root / "shm-64m"
    big = root / "shm-4g"
    if shutil.which("mount") and _mount_tmpfs(small, "64m"):
        mounted.append(small)
    if shutil.which("mount") and _mount_tmpfs(big, "4g"):
        mounted.append(big)
    try:
        yield Sandbox.create(
            root,
            shm_path=big if big in mounted else root,
            small_shm_path=small if small in mounted else None,
        )
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], check=False)
        shutil.rmtree(root, ignore_errors=True)
