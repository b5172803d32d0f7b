"""Rows read as another user: the product's own case, measured.

The images run as uid 1000 over a dataset mounted read-only and owned by someone else. There
``mincore`` reports every page of a file cached (mm/mincore.c, can_do_mincore: no page-cache
side channel for a file the caller neither owns nor may write), so a loader that trusts it
sees a cold pack as warm; one run as the data's owner never shows it. ``--read-as UID[:GID]``
(``make bench BENCH_READ_AS=1000``) writes the packs as root, as the suite runs, and reads
them in each row's process as UID.

What only root may do for that process (tell how much of its files is cached, for the cold
checks; ``drop_caches``) is done by a helper it starts before giving up root: a small
interpreter of its own (bench/pagecache.py, no torch: the row's peak RSS counts its whole
process tree), answering over a pipe and ending with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.pagecache import drop_all_caches, resident_fraction
from bench.rowproc import child_env

__all__ = ["TASKS", "RootHelper", "check_can_read_as", "parse_user", "read_as"]

TASKS = {"resident": resident_fraction, "drop_caches": drop_all_caches}


def parse_user(text: str) -> tuple[int, int]:
    """``UID`` or ``UID:GID`` (GID defaults to UID) as numbers; a clear error otherwise."""
    uid, _, gid = text.partition(":")
    try:
        ids = int(uid), int(gid or uid)
    except ValueError:
        raise SystemExit(f"--read-as {text!r}: expected UID or UID:GID, numbers") from None
    if min(ids) < 1:
        raise SystemExit(f"--read-as {text!r}: give a user other than root (uid and gid >= 1)")
    return ids


def check_can_read_as() -> None:
    if os.geteuid() != 0:
        raise SystemExit(
            "--read-as needs the suite to run as root (it writes the packs as root and reads "
            f"them as the user given); running as uid {os.geteuid()}"
        )


class RootHelper:
    """``python -m bench.read_as``, started as the caller is (root, before ``read_as`` gives
    that up): runs ``TASKS[name](*args)`` for it, one request at a time over a pipe, and
    exits when the pipe closes (the caller and every process it forked have exited)."""

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.read_as"],
            env=child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self._proc.pid

    def __call__(self, name: str, *args):
        self._proc.stdin.write(json.dumps([name, *args]) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the root helper (pid {self.pid}) ended before answering {name}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"root helper, {name}: {answer['error']}")
        return answer["value"]

    def close(self) -> None:
        """End the helper (a row's process need not: it ends with the process)."""
        self._proc.stdin.close()
        self._proc.wait()
        self._proc.stdout.close()


def serve(tasks=TASKS, requests=sys.stdin, answers=sys.stdout) -> None:
    """The helper's loop: a JSON ``[name, *args]`` a line in, ``{"value": ...}`` or
    ``{"error": ...}`` a line out (NaN passes as NaN)."""
    for line in requests:
        name, *args = json.loads(line)
        try:
            answer = {"value": tasks[name](*args)}
        except Exception as exc:  # noqa: BLE001 - sent back to the asking side
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def read_as(uid: int, gid: int) -> RootHelper:
    """Start the root helper, then become ``uid:gid`` (no supplementary groups) for good:
    the helper is what is left of root."""
    helper = RootHelper()
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    return helper


if __name__ == "__main__":
    serve()
