"""A pack wherever it lives: a local folder, or a URL read through the local cache.

`open_reader_at` and `read_manifest_at` are what the datasets, verify, inspect, bench and tune
call with a path or a URL. A remote pack's reader is the format's own reader with `source`
set to a :class:`RemoteFiles`: it names its files as today and gets pinned, verified local
copies from the cache. Its `root` is the pack's view folder in the cache
(`cache_dir/packs/s3/bucket/prefix`): the manifest, and a link per fetched file to its copy
under objects/, so the readers open `root / name` as for a local pack and messages name it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpufeed.errors import CacheFullError, DataError, UnsafePathError, UsageError
from gpufeed.formats import is_multipart, reader_class
from gpufeed.formats.base import Reader
from gpufeed.formats.files import atomic_write_bytes
from gpufeed.formats.manifest import MANIFEST_NAME, read_manifest
from gpufeed.formats.open import open_reader
from gpufeed.storage.cache import Pin
from gpufeed.storage.growing_file import Landing
from gpufeed.storage.modes import make_cache_dirs
from gpufeed.storage.remote import RemotePack, check_remote_name, open_pack
from gpufeed.storage.urls import RemoteURL, parse_location

CACHE_DIR_ENV = "GPUFEED_CACHE_DIR"
CACHE_LIMIT_ENV = "GPUFEED_CACHE_LIMIT"
VIEWS = "packs"
WARM_WORKERS = 4  # background downloads per process for map-style reads ahead
WARM_PINS = 4  # files fetched ahead and held for their read, per process


def default_cache_dir() -> Path:
    """$GPUFEED_CACHE_DIR, else ~/.cache/gpufeed (XDG_CACHE_HOME honoured)."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpufeed"


# A reader keeps files it has read pinned up to a budget (RemoteFiles.pin_budget), so that a
# cache epoch reopens (and maps anew) none of them: a share of cache_limit per process, or a
# fixed amount when the cache has no limit but the disk's.
PIN_SHARE = 16
PIN_BYTES_NO_LIMIT = 2 << 30


def default_cache_limit() -> str | None:
    return os.environ.get(CACHE_LIMIT_ENV) or None


class RemoteFiles:
    """A remote pack's files for one reader: `fetch(name)` gives the verified local copy,
    pinned until `release(name)` (or for the reader's life). Pins belong to one process:
    a forked or spawned worker pins its own."""

    def __init__(self, pack: RemotePack, root: Path):
        self.pack = pack
        self.root = root
        self._pins: dict[str, Pin] = {}
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None
        self._warming: set[str] = set()
        self._warm: dict[str, Pin] = {}  # fetched ahead, not yet read: oldest first
        self._warm_bytes = 0  # of files fetched ahead, landed or landing (within pin_budget)
        self._landings: dict[str, tuple[threading.Event, list[Landing]]] = {}  # see landing()
        self._lock = threading.Lock()
        self._links: dict[str, Path] = {}  # links this process made or checked: name -> link

    @property
    def url(self) -> RemoteURL:
        return self.pack.url

    @property
    def stats(self):
        return self.pack.stats

    def pin_budget(self) -> int:
        """Bytes of this pack's files one reading process may keep pinned (open) beyond
        what it reads now: a share of cache_limit (several workers and ranks pin theirs
        from one cache, and what is pinned cannot be evicted), or PIN_BYTES_NO_LIMIT."""
        limit = self.pack.cache.limit
        return PIN_BYTES_NO_LIMIT if limit is None else limit // PIN_SHARE

    def check_name(self, name: str) -> None:
        """UnsafePathError unless `name` names a file inside the pack (check_remote_name)."""
        check_remote_name(self.url, name)

    def _mine(self) -> dict[str, Pin]:
        if self._pid != os.getpid():  # inherited through fork: the parent's pins stay its own
            self._pins, self._pid = {}, os.getpid()
            self._pool, self._warming, self._warm, self._warm_bytes = None, set(), {}, 0
            self._lock, self._links, self._landings = threading.Lock(), {}, {}
        return self._pins

    def warm(self, names: list[str]) -> None:
        """Start fetching `names` in the background (a hint for reads to come: a failure
        surfaces when the file is read). A file already whole in the cache (landed files are
        verified) is left for its read to pin: no thread, no pin, no lock; the pool of
        fetches ahead starts on the first miss, so a process reading a cached pack (a
        DataLoader worker forked each epoch) never starts one. What is fetched ahead and not
        yet read stays within pin_budget (a share of cache_limit): a small cache fetches
        fewer files ahead, or none, rather than filling up with them."""
        self._mine()
        limited = self.pack.cache.limit is not None  # no limit: WARM_PINS bounds them
        budget = self.pin_budget()
        for name in names:
            if name in self._warming or name in self._pins or name in self._warm:
                continue
            if self.pack.cached(name):
                continue
            size = self.pack.entry(name).size
            with self._lock:
                if limited and self._warm_bytes + size > budget:
                    return  # the rest are fetched when read
                self._warm_bytes += size
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WARM_WORKERS, thread_name_prefix="gpufeed-warm")
            self._warming.add(name)
            self._landings[name] = slot = (threading.Event(), [])
            self._pool.submit(self._warm_one, name, slot)

    def _warm_one(self, name: str, slot: tuple[threading.Event, list[Landing]]) -> None:
        """Fetch `name` and keep it pinned until read (fetch adopts the pin), so eviction
        cannot take a file fetched ahead before it is read; past WARM_PINS, the oldest is
        let go. `slot`: where landing() finds this download (see there)."""
        started, landings = slot

        def on_landing(landing: Landing) -> None:
            landings.append(landing)
            started.set()

        try:
            pin = self.pack.fetch(name, on_landing)
        except Exception:  # noqa: BLE001 - a hint; the read that needs the file reports it
            with self._lock:
                self._warm_bytes -= self.pack.entry(name).size
            return
        finally:
            self._warming.discard(name)
            started.set()
            if self._landings.get(name) is slot:  # nobody asked while it ran: it is whole now
                self._landings.pop(name, None)
        with self._lock:
            self._warm[name] = pin
            while len(self._warm) > WARM_PINS:
                self._unwarm(next(iter(self._warm))).release()

    def _unwarm(self, name: str) -> Pin:
        """The pin of `name`, fetched ahead, taken off the files fetched ahead (lock held)."""
        pin = self._warm.pop(name)
        self._warm_bytes -= self.pack.entry(name).size
        return pin

    def landing(self, name: str) -> Landing | None:
        """The download of `name` in progress, when warm() started it in this process and it
        is still running: its bytes can be read before it lands (storage/growing_file.py), by a
        reader that checks them. None otherwise (fetch() gives the landed file)."""
        self._mine()
        started, landings = self._landings.pop(name, (None, None))
        if started is None:
            return None
        started.wait()  # until this process downloads it, or the file is there
        return landings[0] if landings and not landings[0].done else None

    def fetch(self, name: str) -> Path:
        """root/name: a link to the file's verified copy in the cache, pinned by this process."""
        pins = self._mine()
        pin = pins.get(name)
        if pin is None or not pin.held:
            with self._lock:
                pin = self._unwarm(name) if name in self._warm else None
            pin = pins[name] = pin if pin is not None else self._fetch_now(name)
        link = self._links.get(name)
        if link is None:  # a name's copy is named by its sha256: its link never changes
            link = self._links[name] = _link(self.root, name, pin.path, self.pack)
        return link

    def _fetch_now(self, name: str) -> Pin:
        try:
            return self.pack.fetch(name)
        except CacheFullError:  # files fetched ahead give way to the one needed now
            with self._lock:
                if not self._warm:
                    raise
                for warm in list(self._warm):
                    self._unwarm(warm).release()
            return self.pack.fetch(name)

    def release(self, name: str) -> None:
        pin = self._mine().pop(name, None)
        if pin is not None:
            pin.release()

    def close(self) -> None:
        """Release every pin, after the fetches ahead still running (none is left half-done)."""
        for name in list(self._mine()):
            self.release(name)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._warming = None, set()
        with self._lock:
            for name in list(self._warm):
                self._unwarm(name).release()

    def fetch_ahead(self, names: list[str], *, workers: int, ahead: int):
        return self.pack.fetch_ahead(names, workers=workers, ahead=ahead)

    def __getstate__(self):
        return {"pack": self.pack, "root": self.root}

    def __setstate__(self, state):
        self.__init__(state["pack"], state["root"])


def _link(root: Path, name: str, target: Path, pack: RemotePack) -> Path:
    """root/name made a symbolic link to `target` (atomically: readers of the pack's view in
    other processes see the old link or the new one, never none). The name was checked when
    the manifest was read (check_remote_name); checked again here, with where the link's
    folder really is, so that nothing but the view's own folders is ever written."""
    url = pack.url
    check_remote_name(url, name)
    link = root / name
    try:
        if os.readlink(link) == str(target):
            return link
    except OSError:
        pass
    try:
        _inside(root, link.parent, url, name)  # before mkdir, which would follow a link out
        make_cache_dirs(pack.cache.root, link.parent, pack.cache.shared)
        _inside(root, link.parent, url, name)
        tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}.link")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, link)
    except OSError as e:  # a name that is also a folder of another name ("a" and "a/b")
        raise DataError(
            f"{url.child(name)}: cannot link it into the cache's view of the pack at {link}: "
            f"{e.strerror}; the manifest's file names clash (re-upload the pack)"
        ) from None
    return link


def _inside(root: Path, folder: Path, url: RemoteURL, name: str) -> None:
    """UnsafePathError unless `folder` resolves inside `root` (a link on the way out of it)."""
    top, real = os.path.realpath(root), os.path.realpath(folder)
    if os.path.commonpath([top, real]) != top:
        raise UnsafePathError(
            url.child(name), f"would be linked outside the cache's view of the pack (in {real})"
        )


def remote_pack(
    url: RemoteURL, cache_dir: str | os.PathLike | None, cache_limit: int | str | None
) -> RemotePack:
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    cache_limit = default_cache_limit() if cache_limit is None else cache_limit
    return open_pack(str(url), cache_dir, cache_limit)


def view_root(pack: RemotePack) -> Path:
    """The pack's folder in the cache: its manifest, so local tools see a pack there."""
    url = pack.url
    root = pack.cache.root / VIEWS / url.scheme / url.bucket / url.prefix
    text = json.dumps(pack.manifest, indent=1, sort_keys=True).encode()
    path = root / MANIFEST_NAME
    try:
        if not path.exists() or path.read_bytes() != text:
            make_cache_dirs(pack.cache.root, root, pack.cache.shared)
            atomic_write_bytes(path, text, shared=True)
            if not pack.cache.shared:  # written with the umask's mode, in a 0700 folder
                os.chmod(path, pack.cache.file_mode)
    except OSError as e:
        where = f"cache_dir {pack.cache.root}"
        raise UsageError(f"{where}: cannot write {path}: {e.strerror}") from None
    return root


def read_manifest_at(
    where: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
) -> dict[str, Any]:
    loc = parse_location(where)
    if isinstance(loc, RemoteURL):
        return remote_pack(loc, cache_dir, cache_limit).manifest
    return read_manifest(loc)


def open_reader_at(
    where: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    **options: Any,
) -> Reader:
    """The reader of the pack at `where`: a local path (cache_dir/cache_limit unused) or a
    URL, whose files come through the cache under `cache_dir` (default $GPUFEED_CACHE_DIR or
    ~/.cache/gpufeed), bounded by `cache_limit` (default $GPUFEED_CACHE_LIMIT, else the
    disk's free space)."""
    loc = parse_location(where)
    if not isinstance(loc, RemoteURL):
        return open_reader(loc, **options)
    pack = remote_pack(loc, cache_dir, cache_limit)
    if is_multipart(pack.manifest):  # a merged hdf5/lmdb/mmap pack (gpufeed.merge)
        from gpufeed.storage.remote_parts import RemoteMultiPartReader as cls
    else:
        cls = reader_class(pack.manifest["format"])
    root = view_root(pack)
    return cls.with_source(RemoteFiles(pack, root), root, pack.manifest, **options)
