"""The local cache of fetched files: atomic landing, checksums, LRU eviction, shared by processes.

Layout (cache_dir):
  objects/ab/<sha256>            a verified file, named by its content: a pack replaced in the
                                 store gets new names, and nothing stale is ever read
  objects/ab/<sha256>.<id>.part  a download in progress (never read; removed if its process died)
  locks/<sha256>.lock            held while that file is downloaded or landed (never deleted:
                                 deleting a lock file others may hold breaks the lock)
  cache.lock                     held while space is reserved and files are evicted

Who may read it: the cache holds other people's training data, so its folders are made 0700
and its files 0600 (folders of an older, world-readable cache are closed on open), unless
the cache is shared between users on purpose: shared=True (Cache, open_pack) or
$GPUFEED_CACHE_SHARED=1; modes then follow the umask (a group-writable umask and a setgid
group folder let a group share one cache).

How processes share one cache without double downloads or corruption (flock, so the kernel
drops a dead process's locks):
  - A file in use is pinned: an open descriptor with a shared lock on it. Eviction takes an
    exclusive lock without waiting, so it skips every pinned file.
  - A miss takes the file's download lock; whoever waited on it finds the file landed.
  - A download goes to a .part file, preallocated to its full size (a full disk fails at once,
    and the reservation counts against cache_limit), is checked against the caller's size and
    sha256, fsynced, and renamed into place. A reader never sees a half-written file, with
    one exception that checks what it reads: the downloading process may hand its download
    in progress to a reader that checks each sample's crc32 (on_landing, storage/growing_file.py).
  - Recently used = most recent mtime: every pin touches the file.
  - A forked child closes its copies of this process's lock descriptors at once (a flock
    belongs to the open file, so a copy would hold it until the child exits: a forked worker
    that inherited the cache lock would block every download on the node). Each Pin or lock
    is closed only by the process that took it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpufeed.errors import CacheFullError, ChecksumError, UsageError
from gpufeed.formats.files import fsync_dir
from gpufeed.storage.growing_file import Landing
from gpufeed.storage.modes import (
    PRIVATE_FILE,
    SHARED_FILE,
    cache_shared,
    make_cache_dirs,
)
from gpufeed.storage.stats import StorageStats
from gpufeed.system.sizes import format_size, parse_size

OBJECTS = "objects"
LOCKS = "locks"
CACHE_LOCK = "cache.lock"
PART = ".part"
# a download in progress is readable (storage/growing_file.py) in these steps
LANDING_STEP = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    """A file the cache may hold: its name, size and sha256 (the manifest's); `origin` (its URL)
    names it in messages."""

    name: str
    size: int
    sha256: str
    origin: str = ""

    @property
    def label(self) -> str:
        return self.origin or self.name

    def __post_init__(self):
        digest = self.sha256.lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise UsageError(f"{self.name}: sha256 {self.sha256!r} is not 64 hex digits")


class Pin:
    """A cached file held against eviction until release() (or the end of a `with`)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd
        self._pid = os.getpid()

    def release(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            _close(self._fd)  # closing drops the shared lock
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0 and self._pid == os.getpid()

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


Fetch = Callable[[FileEntry, BinaryIO], None]
OnLanding = Callable[[Landing], None]


class Cache:
    """Files fetched from object storage, kept under `cache_dir` up to `cache_limit` bytes
    ("50GB", "50GiB" or an int; None: no limit but the disk's)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        cache_limit: int | str | None = None,
        *,
        stats: StorageStats | None = None,
        shared: bool | None = None,
    ):
        self.root = Path(cache_dir).absolute()
        self.limit = parse_size(cache_limit, "cache_limit")
        self.stats = stats or StorageStats()
        self.shared = cache_shared(shared)
        self.file_mode = SHARED_FILE if self.shared else PRIVATE_FILE
        # sha256 -> its path, joined once (docs/performance/object-storage-fetch.md)
        self._paths: dict[str, Path] = {}
        for sub in (OBJECTS, LOCKS):
            self.make_dirs(self.root / sub)

    def make_dirs(self, path: Path) -> None:
        """`path`, a folder under the cache, made with the cache's modes (make_cache_dirs)."""
        try:
            make_cache_dirs(self.root, path, self.shared)
        except OSError as e:
            raise UsageError(f"cache_dir {self.root}: cannot create {path}: {e.strerror}") from None

    # ------------------------------------------------------------------ paths
    def path(self, entry: FileEntry) -> Path:
        path = self._paths.get(entry.sha256)
        if path is None:
            digest = entry.sha256.lower()
            path = self._paths[entry.sha256] = self.root / OBJECTS / digest[:2] / digest
        return path

    def _lock_path(self, entry: FileEntry) -> Path:
        return self.root / LOCKS / f"{entry.sha256.lower()}.lock"

    # ------------------------------------------------------------------ look-ups
    def pin(self, entry: FileEntry) -> Pin | None:
        """The cached file, pinned, or None when it is not in the cache."""
        path = self.path(entry)
        try:
            fd = _open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if not _same_file(fd, path):  # evicted between open and lock
                _close(fd)
                return None
        except OSError:
            _close(fd)
            raise
        with contextlib.suppress(PermissionError):  # another user's file: LRU order only
            os.utime(fd)  # most recently used
        return Pin(path, fd)

    def pin_after_download(self, entry: FileEntry) -> Pin | None:
        """pin(entry) once a download of it in progress (any process's) has ended: its
        download lock, taken and let go at once; None when it did not land."""
        with _Flock(self._lock_path(entry), mode=self.file_mode):
            return self.pin(entry)

    def holds(self, entry: FileEntry) -> bool:
        """Whether the verified file is in the cache now (one stat: no pin, no lock; only a
        pin keeps it from being evicted after)."""
        return os.path.exists(self.path(entry))

    def get(self, entry: FileEntry, fetch: Fetch, on_landing: OnLanding | None = None) -> Pin:
        """The file pinned, from the cache or, on a miss, fetched by `fetch(entry, out)` (which
        writes its bytes to `out`; a ChecksumError or any other error leaves nothing behind).
        on_landing(landing), on a miss this call downloads: the download in progress, for a
        reader that checks what it reads to read it before it lands (storage/growing_file.py)."""
        pin = self.pin(entry)
        if pin is not None:
            self.stats.add(hits=1)
            return pin
        with _Flock(self._lock_path(entry), mode=self.file_mode):
            pin = self.pin(entry)  # another process or thread fetched it while we waited
            if pin is not None:
                self.stats.add(hits=1)
                return pin
            self.stats.add(misses=1)
            return self._fetch_locked(entry, fetch, on_landing)

    def _fetch_locked(self, entry: FileEntry, fetch: Fetch, on_landing: OnLanding | None) -> Pin:
        final = self.path(entry)
        part_fd, part = self._reserve(entry)
        landing = Landing(part_fd, entry.size) if on_landing is not None else None
        try:
            with os.fdopen(part_fd, "r+b", buffering=1 << 20, closefd=False) as f:
                out = _HashingWriter(f, landing)
                if landing is not None:
                    on_landing(landing)
                fetch(entry, out)
                f.flush()
                _verify(entry, out)
                os.fsync(f.fileno())
            os.rename(part, final)
            fsync_dir(final.parent)
        except OSError as e:
            _unlink(part)
            full = self._full(entry, e)
            if full is e:
                raise
            raise full from None
        except BaseException:
            _unlink(part)
            raise
        finally:
            if landing is not None:
                landing.finish()  # before the descriptor its reads use is closed
            _close(part_fd)
        pin = self.pin(entry)
        if pin is None:  # only the download lock (held) lets a fresh file be evicted
            raise AssertionError(f"{final}: vanished right after landing")
        return pin

    # ------------------------------------------------------------------ space
    def _reserve(self, entry: FileEntry) -> tuple[int, Path]:
        """Make room for `entry` (evicting the least recently used unpinned files) and create
        its .part file at full size, all under the cache lock."""
        final = self.path(entry)
        if not final.parent.is_dir():
            self.make_dirs(final.parent)
        part = final.with_name(f"{final.name}.{os.getpid()}-{threading.get_ident()}{PART}")
        with _Flock(self.root / CACHE_LOCK, mode=self.file_mode):
            files = self._scan()  # also sweeps .part files left by dead downloads
            if self.limit is not None:
                self._make_room(entry, files)
            fd = _open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, self.file_mode)
            fcntl.flock(fd, fcntl.LOCK_EX)  # marks it live for the orphan sweep
            try:
                if entry.size:
                    os.posix_fallocate(fd, 0, entry.size)
            except OSError as e:
                _close(fd)
                _unlink(part)
                raise self._full(entry, e) from None
        return fd, part

    def _make_room(self, entry: FileEntry, files: list[_CachedFile]) -> None:
        used = sum(f.size for f in files)
        for f in sorted((f for f in files if not f.part), key=lambda f: f.mtime):
            if used + entry.size <= self.limit:
                break
            if self._evict(f.path):
                used -= f.size
        if used + entry.size > self.limit:
            raise CacheFullError(
                f"cache_dir {self.root}: cache_limit {format_size(self.limit)} cannot hold "
                f"{entry.label} ({format_size(entry.size)}): {format_size(used)} is in files "
                "in use or being downloaded; raise cache_limit or fetch fewer files ahead"
            )

    def _scan(self) -> list[_CachedFile]:
        """Every file under objects/, after removing .part files whose download died."""
        found = []
        for sub in os.scandir(self.root / OBJECTS):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                part = f.name.endswith(PART)
                if part and _unlink_unpinned(Path(f.path)):
                    continue  # nobody holds it: its download died
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                found.append(_CachedFile(Path(f.path), st.st_size, st.st_mtime, part))
        return found

    def _evict(self, path: Path) -> bool:
        """Remove `path` unless it is pinned or being landed; True when removed."""
        lock = _Flock(self.root / LOCKS / f"{path.name}.lock", wait=False, mode=self.file_mode)
        if not lock.acquire():
            return False
        try:
            removed = _unlink_unpinned(path)
        finally:
            lock.release()
        if removed:
            self.stats.add(evictions=1)
        return removed

    def usage(self) -> int:
        """Bytes held: verified files and downloads in progress."""
        return sum(f.size for f in self._scan())

    def _full(self, entry: FileEntry, e: OSError) -> CacheFullError | OSError:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return e
        limit = format_size(self.limit) if self.limit is not None else "none"
        return CacheFullError(
            f"cache_dir {self.root}: no space left on its disk for {entry.label} "
            f"({format_size(entry.size)}); free space there, move cache_dir to a larger disk, "
            f"or set cache_limit (now {limit}) below the disk's free space"
        )


class _HashingWriter:
    """The file a fetch writes to, hashing what it writes; seek(0) starts over. With a
    `landing`, each write reaches the file at once and advances it (readers wait on it)."""

    def __init__(self, f: BinaryIO, landing: Landing | None = None):
        self._f = f
        self._landing = landing
        self.digest = hashlib.sha256()
        self.written = 0
        self._advanced = 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.written += len(data)
        n = self._f.write(data)
        if self._landing is not None and self.written - self._advanced >= LANDING_STEP:
            self._f.flush()
            self._landing.advance(self.written)
            self._advanced = self.written
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        if (offset, whence) != (0, 0):
            raise ValueError("a fetch may only start over (seek(0))")
        self.digest = hashlib.sha256()
        self.written = 0
        pos = self._f.seek(0)
        self._advanced = 0
        if self._landing is not None:
            self._landing.advance(0)
        return pos

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self._f.flush()


def _verify(entry: FileEntry, out: _HashingWriter) -> None:
    digest = out.digest.hexdigest()
    if out.written != entry.size or digest != entry.sha256.lower():
        raise ChecksumError(
            f"{entry.label}: fetched {out.written} bytes with sha256 {digest}; the manifest "
            f"says {entry.size} bytes, sha256 {entry.sha256}: the object changed after the pack "
            "was made, or its upload is incomplete: upload the pack again"
        )


@dataclass(frozen=True)
class _CachedFile:
    path: Path
    size: int
    mtime: float
    part: bool


def _unlink_unpinned(path: Path) -> bool:
    """Unlink `path` unless someone holds a lock on it (a pin, or a live download's .part);
    True when unlinked."""
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_file(fd, path):
            return False
        path.unlink()
        return True
    except (BlockingIOError, FileNotFoundError):
        return False
    finally:
        _close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class _Flock:
    """An exclusive flock on a lock file, as a context manager (wait=False: try once)."""

    def __init__(self, path: Path, wait: bool = True, mode: int = PRIVATE_FILE):
        self.path = path
        self.wait = wait
        self.mode = mode
        self.fd = -1
        self._pid = os.getpid()

    def acquire(self) -> bool:
        self._pid = os.getpid()
        self.fd = _open(self.path, os.O_RDWR | os.O_CREAT, self.mode)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            _close(self.fd)
            self.fd = -1
            return False
        return True

    def release(self) -> None:
        if self.fd >= 0 and self._pid == os.getpid():
            _close(self.fd)
        self.fd = -1

    def __enter__(self) -> _Flock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# Descriptors this process holds flocks through (see the module's doc: closed in a fork child)
_lock_fds: set[int] = set()
_lock_fds_guard = threading.Lock()


def _open(path: Path, flags: int, mode: int = PRIVATE_FILE) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, mode)
    with _lock_fds_guard:
        _lock_fds.add(fd)
    return fd


def _close(fd: int) -> None:
    with _lock_fds_guard:
        _lock_fds.discard(fd)
    os.close(fd)


def _close_inherited_locks() -> None:
    global _lock_fds_guard
    _lock_fds_guard = threading.Lock()  # a parent thread may have held it at the fork
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)
