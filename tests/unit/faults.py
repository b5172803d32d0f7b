"""Real faults for the data-safety tests: small full disks (tmpfs mounts), folders root cannot
read (root's DAC capabilities dropped), the gpufeed CLI in a subprocess, process trees."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from unit_sources import PYTHON_ENV

ROOT_USER = os.geteuid() == 0
# Root reads every folder whatever its mode: drop the two capabilities that let it, from the
# bounding set, so the command runs as root without them (CI runs as root).
DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def gpufeed_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpufeed.cli", *map(str, args)]


def run_gpufeed(*args, env=None, timeout=120, without_dac=False, **kw):
    """`gpufeed ARGS` in a subprocess (text output); without_dac: as root without the
    capabilities that bypass file permissions (as a plain user: as is)."""
    cmd = gpufeed_cmd(*args)
    if without_dac and ROOT_USER:
        assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop capabilities"
        cmd = DROP_DAC + cmd
    return subprocess.run(
        cmd,
        env={**PYTHON_ENV, **(env or {})},
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        **kw,
    )


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` mounted at `where` for the block; unmounted after. Needs root (CI
    runs as root: there a failing mount is an error, not a skip)."""
    import pytest

    if not ROOT_USER:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of `pid` (from /proc, breadth first)."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    if int(child) not in found:
                        found[int(child)] = start_time(int(child))
                        todo.append(int(child))
    return {p: t for p, t in found.items() if t}


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None when it is gone or a
    zombie: the pair (pid, start time) cannot be fooled by a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def alive(procs: dict[int, str]) -> dict[int, str]:
    return {p: t for p, t in procs.items() if start_time(p) == t}


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def tear(path: Path, how: str, marker: bytes, flip_at: int) -> None:
    """A committed file torn as a crash leaves it: "zeros" (renamed, its blocks never
    written: a power loss), "cut" (half of it), or "flipped" (one byte ``flip_at`` past the
    first ``marker`` changed: a sample's crc32, or the zip's CRC, says so)."""
    data = bytearray(path.read_bytes())
    if how == "zeros":
        data = bytearray(len(data))
    elif how == "cut":
        data = data[: len(data) // 2]
    else:
        at = data.find(marker)
        assert at >= 0, f"{marker!r} not in {path}"
        data[at + flip_at] ^= 1
    path.write_bytes(bytes(data))
