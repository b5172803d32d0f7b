"""Fetches for a process forked from one that used object storage (a forked DataLoader worker).

obstore runs every request on one tokio runtime per process, made on first use; a fork copies
the runtime's state but not its threads, so a forked child's requests wait for ever
(tokio-rs/tokio#4301), and the child cannot make a new runtime (obstore keeps one per
process). So a forked process hands its cache misses to a helper: a fresh interpreter
(`python -c HELPER_MAIN`, started by subprocess, so the user's script is not run
again as under multiprocessing's spawn) that fetches into the same cache with its own client.
The worker then pins the landed file as on a hit: files, locks and checksums stay the cache's
(storage/cache.py); only "fetch NAME" and "done" or the error cross the pipe.

One helper per forked process, started on its first miss and ended when that process closes
the pipe (exits); it fetches up to HELPER_THREADS files at once, for the worker's threads.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from gpufeed.errors import StorageError
from gpufeed.storage.stats import StorageStats

HELPER_THREADS = 8  # concurrent fetches per helper (the fetch-ahead pool's default width)
# -c, not -m: `python -m` of a module its package already imports warns (runpy)
HELPER_MAIN = "import sys; from gpufeed.storage.helper import main; main(int(sys.argv[1]))"


class FetchHelper:
    """The client end: `fetch(name)` returns once the helper has landed `name` in the cache.
    Safe to call from several threads; `pack` is the RemotePack whose files it fetches."""

    def __init__(self, pack):
        self.pid = os.getpid()
        self._stats = pack.stats
        self._seen = StorageStats().as_dict()  # the helper's counters already added to _stats
        self._pending: dict[int, Future] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", HELPER_MAIN, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=_helper_env(),
        )
        theirs.close()
        self._conn = Connection(mine.detach())
        self._conn.send(pack)
        threading.Thread(target=self._receive, name="gpufeed-helper-replies", daemon=True).start()

    def fetch(self, name: str) -> None:
        done: Future = Future()
        with self._lock:
            request, self._next_id = self._next_id, self._next_id + 1
            self._pending[request] = done
            try:
                self._conn.send((request, name))
            except OSError:
                self._pending.pop(request)
                raise self._died() from None
        done.result()

    def _receive(self) -> None:
        while True:
            try:
                request, error, counts = self._conn.recv()
            except (EOFError, OSError):
                break
            self._count(counts)
            done = self._pending.pop(request)
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)
        with self._lock:
            for done in self._pending.values():
                done.set_exception(self._died())
            self._pending.clear()

    def _count(self, counts: dict[str, int]) -> None:
        """Add what the helper counted since its last reply (its counters only grow)."""
        delta = {k: v - self._seen[k] for k, v in counts.items() if v != self._seen[k]}
        self._seen = counts
        if delta:
            self._stats.add(**delta)

    def _died(self) -> StorageError:
        code = self._proc.poll()
        return StorageError(
            f"the fetch helper of process {self.pid} (pid {self._proc.pid}) exited"
            f"{f' with status {code}' if code is not None else ''}; its error is above"
        )

    def close(self) -> None:
        self._conn.close()  # the helper sees EOF, finishes its fetches and exits
        self._proc.wait()


def _helper_env() -> dict[str, str]:
    """This environment (credentials, endpoint), with gpufeed importable as it is here."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def main(fd: int) -> None:
    """The helper: fetch each requested file into the pack's cache, reply (id, error, counts)."""
    conn = Connection(fd)
    pack = conn.recv()
    pack.cache.stats = StorageStats()  # replies carry this helper's own counters
    send = threading.Lock()

    def fetch(request: int, name: str) -> None:
        error = None
        try:
            pack.fetch(name).release()
        except Exception as e:  # noqa: BLE001 - the worker raises it where it asked
            error = _portable(e)
        with send:
            conn.send((request, error, pack.stats.as_dict()))

    with ThreadPoolExecutor(HELPER_THREADS, thread_name_prefix="gpufeed-helper") as pool:
        while True:
            try:
                request, name = conn.recv()
            except (EOFError, OSError):
                break
            pool.submit(fetch, request, name)


def _portable(error: Exception) -> Exception:
    """`error` if it survives pickling, else a StorageError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return StorageError(f"{type(error).__name__}: {error}")
