"""The pack lock: one writer per destination.

A pack holds an exclusive advisory lock (flock) on DEST.partial/.lock from before it reads
DEST.partial's state until after DEST.partial is gone, the final rename into DEST included.
A second `gpufeed pack` into the same DEST (a --resume started twice, a retry while the first
run still works) is refused at once with the holder's pid, instead of two writers racing over
the same parts. The lock is advisory: only gpufeed processes honour it, and it is released by
the kernel when its holder dies (kill -9 included), so a crash never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from gpufeed.errors import UsageError

LOCK_NAME = ".lock"
_RETRIES = 20


def lock_holder(lock_path: Path) -> int | None:
    """The pid holding a flock on `lock_path` (from /proc/locks), or None when none does (or
    the system does not say). Only reads: taking even a shared lock to ask could make a
    starting pack think it is not alone."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a waiter)
        if "->" not in fields and "FLOCK" in fields and inode in fields:
            return int(fields[fields.index(inode) - 1])
    return None


def busy_message(dest: Path, partial: Path) -> str | None:
    """What to tell someone about to act on DEST while a pack writes it, or None."""
    pid = lock_holder(partial / LOCK_NAME)
    if pid is None:
        return None
    return (
        f"{dest}: a gpufeed pack (pid {pid}) is writing it now (it holds the lock on "
        f"{partial / LOCK_NAME}); wait for that process to finish, or stop it first"
    )


class PackLock:
    """`with PackLock(dest, partial):` creates DEST.partial if needed and holds its lock.

    The lock file lives inside DEST.partial, which the pack deletes when it is done: a
    process that opened the old lock file and wins it after the holder finished finds the
    path gone or a new file there (inode check) and starts over on the new one, so two
    holders of "the" lock can never both believe they own DEST.partial.
    """

    def __init__(self, dest: Path, partial: Path):
        self.dest, self.partial = dest, partial
        self.path = partial / LOCK_NAME
        self.fd: int | None = None
        self.created = False
        self.created_file = False

    def __enter__(self) -> PackLock:
        self.partial.parent.mkdir(parents=True, exist_ok=True)  # DEST's folder, as mkdir -p
        for _ in range(_RETRIES):
            try:
                self.partial.mkdir()
                self.created = True
            except FileExistsError:
                pass
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                self.created_file = True
            except FileExistsError:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                self.created_file = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UsageError(
                    busy_message(self.dest, self.partial)
                    or f"{self.dest}: another gpufeed pack holds the lock on {self.path}; "
                    "wait for it to finish, or stop it first"
                ) from None
            if self._still_there(fd):
                self.fd = fd
                return self
            os.close(fd)  # removed (and perhaps re-made) while we waited: try the new one
        raise UsageError(f"{self.path}: could not take the pack lock; is another pack looping?")

    def _still_there(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)

    def unlink_if_ours(self) -> None:
        """Remove the lock file while it is still the one this lock holds."""
        if self.fd is not None and self._still_there(self.fd):
            os.unlink(self.path)

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        if exc[0] is not None:
            self._remove_if_unused()
        os.close(self.fd)  # releases the lock
        self.fd = None

    def _remove_if_unused(self) -> None:
        """After a refusal or an error: a DEST.partial holding nothing but the lock file (no
        state was written) goes again, no empty DEST.partial litter; in a folder that
        holds more, only the lock file this run made goes."""
        with contextlib.suppress(OSError):
            names = os.listdir(self.partial)
            if names == [LOCK_NAME] or self.created_file:
                self.unlink_if_ours()
            if names == [LOCK_NAME]:
                os.rmdir(self.partial)
