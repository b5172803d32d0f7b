"""A pack in object storage, read through the local cache: its manifest, then its files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, BinaryIO

from gpufeed.errors import (
    BucketNotFoundError,
    CacheFullError,
    DataError,
    NotPackedError,
    ObjectNotFoundError,
    UnsafePathError,
    UsageError,
)
from gpufeed.formats.manifest import MANIFEST_NAME, check_manifest, unsafe_name
from gpufeed.storage.cache import Cache, FileEntry, OnLanding, Pin
from gpufeed.storage.download import download
from gpufeed.storage.fetch_ahead import DEFAULT_AHEAD, DEFAULT_WORKERS, FetchAhead
from gpufeed.storage.helper import FetchHelper
from gpufeed.storage.retry import RetryPolicy, with_retries
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import ObjectStore, forked_from_a_client
from gpufeed.storage.urls import RemoteURL, parse_location

# a file fetched by a forked process's helper is pinned right after it lands; only a cache too
# small for the files in use evicts it in between, so a few tries tell that apart
HELPER_TRIES = 3


class RemotePack:
    """The pack at `url`: `manifest`, and its data files as pinned local paths."""

    def __init__(
        self,
        url: RemoteURL,
        cache: Cache,
        *,
        store: ObjectStore | None = None,
        retry: RetryPolicy | None = None,
    ):
        self.url = url
        self.cache = cache
        self.store = store or ObjectStore(url)
        self.retry = retry or RetryPolicy()
        self.manifest = self._read_manifest()
        self.entries = _entries(self.manifest, url)
        self._helper: FetchHelper | None = None  # this process's, when forked (storage/helper)

    def __getstate__(self):
        return {**self.__dict__, "_helper": None}

    @property
    def stats(self) -> StorageStats:
        return self.cache.stats

    def _read_manifest(self) -> dict[str, Any]:
        where = self.url.child(MANIFEST_NAME)
        try:
            raw = with_retries(lambda: self.store.read_bytes(MANIFEST_NAME), self.retry, self.stats)
        except ObjectNotFoundError as e:
            if isinstance(e, BucketNotFoundError):
                raise
            raise NotPackedError(
                f"{self.url}: no {MANIFEST_NAME}; not a gpufeed pack, or its upload is unfinished "
                "(the manifest is uploaded last)"
            ) from None
        try:
            manifest = json.loads(raw)
        except ValueError as e:
            raise DataError(f"{where}: unreadable manifest: {e}") from None
        return check_manifest(manifest, where)  # the structure a local manifest has

    def entry(self, name: str) -> FileEntry:
        try:
            return self.entries[name]
        except KeyError:
            check_remote_name(self.url, name)  # a layout naming a path out of the pack
            raise UsageError(f"{self.url}: the manifest lists no file {name!r}") from None

    def cached(self, name: str) -> bool:
        """Whether `name` is in the cache now, whole and verified (it may be evicted after)."""
        return self.cache.holds(self.entry(name))

    def fetch(self, name: str, on_landing: OnLanding | None = None) -> Pin:
        """The pack's file `name` as a pinned local file (fetched on a miss). on_landing: see
        Cache.get (not called in a forked process, whose helper downloads)."""
        return self._get(self.entry(name), on_landing)

    def _get(self, entry: FileEntry, on_landing: OnLanding | None = None) -> Pin:
        if not forked_from_a_client():
            return self.cache.get(entry, self._download, on_landing)
        for _ in range(HELPER_TRIES):
            # a download in progress (the parent's, say: an mmap pack's sample file, read
            # early there) is waited for: starting a helper costs its imports
            # (docs/performance/object-storage-fetch.md)
            pin = self.cache.pin(entry) or self.cache.pin_after_download(entry)
            if pin is not None:
                self.stats.add(hits=1)
                return pin
            self._forked_helper().fetch(entry.name)  # lands it in the cache, counts the miss
        raise CacheFullError(
            f"cache_dir {self.cache.root}: {entry.label} was evicted {HELPER_TRIES} times "
            "between its download and its first read; raise cache_limit"
        )

    def _forked_helper(self) -> FetchHelper:
        if self._helper is None or self._helper.pid != os.getpid():
            self._helper = FetchHelper(self)
        return self._helper

    def fetch_ahead(
        self, names: Iterable[str], *, workers: int = DEFAULT_WORKERS, ahead: int = DEFAULT_AHEAD
    ) -> FetchAhead:
        """Pins of `names` in that order, fetched ahead by a bounded pool (see FetchAhead)."""
        entries = [self.entry(n) for n in names]
        return FetchAhead(self._get, entries, workers=workers, ahead=ahead)

    def _download(self, entry: FileEntry, out: BinaryIO) -> None:
        download(self.store, entry.name, out, entry.size, retry=self.retry, stats=self.stats)


def check_remote_name(url: RemoteURL, name: str) -> str:
    """`name` when it names a file inside the pack at `url` by local packs' rule (unsafe_name),
    else UnsafePathError naming the object: a remote manifest's names become paths in the
    cache's view of the pack, so an absolute or ".." name is refused before any fetch or link."""
    unsafe = unsafe_name(name)
    if unsafe:
        raise UnsafePathError(
            url.child(str(name)), f"{unsafe}; it is not fetched (the manifest is not trusted)"
        )
    return name


def _entries(manifest: dict[str, Any], url: RemoteURL) -> dict[str, FileEntry]:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DataError(f"{url.child(MANIFEST_NAME)}: lists no files")
    for name in files:
        check_remote_name(url, name)
    try:
        return {
            n: FileEntry(n, int(f["bytes"]), str(f["sha256"]), url.child(n))
            for n, f in files.items()
        }
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(
            f"{url.child(MANIFEST_NAME)}: a files entry lacks bytes/sha256: {e}"
        ) from None


def open_pack(
    url: str,
    cache_dir: str | os.PathLike,
    cache_limit: int | str | None = None,
    *,
    retry: RetryPolicy | None = None,
    stats: StorageStats | None = None,
    shared: bool | None = None,
) -> RemotePack:
    """The pack at `url` (s3://bucket/prefix, ...), its files cached under `cache_dir`
    (private to this user unless `shared`, default $GPUFEED_CACHE_SHARED: storage/cache.py)."""
    loc = parse_location(url)
    if not isinstance(loc, RemoteURL):
        raise UsageError(f"{url}: open_pack reads object storage (s3://, gs://, az://, https://)")
    return RemotePack(loc, Cache(cache_dir, cache_limit, stats=stats, shared=shared), retry=retry)
