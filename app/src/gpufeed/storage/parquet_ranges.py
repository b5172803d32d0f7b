"""Byte ranges of objects in storage, fetched through the local cache (storage/cache.py).

The cache holds verified files named by the sha256 of their bytes; an object read in place
(no manifest) comes with no sha256. So each range is known by its identity: the object's
URL, size, ETag and modification time (the listing's), its offset and its length. The first
fetch of a range downloads it (a ranged GET, If-Match the listed ETag: an object replaced
since it was listed is a StalePackError, never its new bytes under the old index), hashes
it and lands it in the cache as any pack file; ``cache_dir/ranges/<identity>`` then records
its sha256, so every later read (another worker, rank or run) is a cache hit, and eviction
and cache_limit apply to ranges as to pack files.

A process forked from one that used the store fetches through a helper (storage/helper.py),
as pack files are: the helper lands the range, the worker pins it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpufeed.errors import CacheFullError, DataError, StalePackError, StorageError
from gpufeed.formats.files import atomic_write_bytes
from gpufeed.storage.cache import Cache, FileEntry, Pin
from gpufeed.storage.helper import FetchHelper
from gpufeed.storage.modes import make_cache_dirs
from gpufeed.storage.remote import HELPER_TRIES
from gpufeed.storage.retry import RetryPolicy
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import (
    STREAM_CHUNK,
    ObjectStore,
    RangeIgnoredError,
    TransientError,
    forked_from_a_client,
    translate,
)
from gpufeed.storage.urls import RemoteURL

RANGES = "ranges"  # cache_dir/ranges/ab/<identity>: "<sha256> <length>" of a landed range
# a range's bytes are held in memory up to this size while landed, on disk past it
SPOOL = 64 << 20


@dataclass(frozen=True)
class ObjectInfo:
    """An object as the listing gave it: what its cached ranges are keyed by."""

    name: str
    size: int
    etag: str
    modified: str


@dataclass(frozen=True)
class Span:
    """Bytes [start, start + length) of object `name`."""

    name: str
    start: int
    length: int

    def request(self) -> str:
        """The span as the helper's one string (json: names may hold any character)."""
        return json.dumps([self.name, self.start, self.length])

    @classmethod
    def parse(cls, request: str) -> Span:
        name, start, length = json.loads(request)
        return cls(str(name), int(start), int(length))


class RangeIgnored(StorageError):
    """The server answered a ranged GET with the whole object: read the object whole."""


class RemoteObjects:
    """The objects `objects` (name -> ObjectInfo) under `url`, read by ranges through
    `cache`. Pickles (a spawned worker; the helper of a forked one)."""

    def __init__(
        self,
        url: RemoteURL,
        objects: dict[str, ObjectInfo],
        cache: Cache,
        retry: RetryPolicy | None = None,
    ):
        self.url = url
        self.objects = objects
        self.cache = cache
        self.store = ObjectStore(url)
        self.retry = retry or RetryPolicy()
        self._helper: FetchHelper | None = None

    def __getstate__(self):
        return {**self.__dict__, "_helper": None}

    @property
    def stats(self) -> StorageStats:
        return self.cache.stats

    def read(self, name: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of object `name`, from the cache or fetched."""
        with self.pin(Span(name, start, length)) as pin, open(pin.path, "rb") as f:
            data = f.read()
        if len(data) != length:  # the cache verified it: only a damaged disk gets here
            raise StorageError(f"{pin.path}: {len(data)} bytes in the cache, {length} expected")
        return data

    def pin(self, span: Span) -> Pin:
        """The span's bytes as a pinned file of the cache (a whole object: span 0..size)."""
        if forked_from_a_client():
            return self._pin_via_helper(span)
        return self._land(span)

    def fetch(self, request: str) -> Pin:
        """The helper's call (storage/helper.py main): land one span, given as Span.request."""
        return self._land(Span.parse(request))

    # -- the cache ------------------------------------------------------------------------
    def _entry(self, span: Span, sha256: str) -> FileEntry:
        where = f"{self.url.child(span.name)} bytes {span.start}-{span.start + span.length}"
        return FileEntry(span.name, span.length, sha256, where)

    def _index_path(self, span: Span) -> Path:
        info = self.objects[span.name]
        key = [self.url.child(span.name), info.size, info.etag, info.modified]
        digest = hashlib.sha256(json.dumps(key + [span.start, span.length]).encode()).hexdigest()
        return self.cache.root / RANGES / digest[:2] / digest

    def _known(self, span: Span) -> str | None:
        """The sha256 of the span's bytes when a fetch recorded it (a record that does not
        read as one, or is of another length, is none)."""
        try:
            sha, length = self._index_path(span).read_text(encoding="ascii").split()
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        ok = len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
        return sha if ok and length == str(span.length) else None

    def _record(self, span: Span, sha256: str) -> None:
        path = self._index_path(span)
        make_cache_dirs(self.cache.root, path.parent, self.cache.shared)
        atomic_write_bytes(path, f"{sha256} {span.length}\n".encode(), shared=True)
        if not self.cache.shared:  # written with the umask's mode, in a 0700 folder
            os.chmod(path, self.cache.file_mode)

    def _land(self, span: Span) -> Pin:
        known = self._known(span)
        if known is not None:  # a miss here (evicted) fetches it again, checked by its sha256
            return self.cache.get(self._entry(span, known), lambda e, out: self._get(span, out))
        with tempfile.SpooledTemporaryFile(SPOOL, dir=self.cache.root) as tmp:
            sha = self._get(span, tmp)
            self._record(span, sha)

            def copy(entry: FileEntry, out: BinaryIO) -> None:
                tmp.seek(0)
                while chunk := tmp.read(1 << 20):
                    out.write(chunk)

            return self.cache.get(self._entry(span, sha), copy)

    def _pin_via_helper(self, span: Span) -> Pin:
        for _ in range(HELPER_TRIES):
            known = self._known(span)
            pin = self.cache.pin(self._entry(span, known)) if known else None
            if pin is not None:
                self.stats.add(hits=1)
                return pin
            if self._helper is None or self._helper.pid != os.getpid():
                self._helper = FetchHelper(self)
            self._helper.fetch(span.request())
        raise CacheFullError(
            f"cache_dir {self.cache.root}: {self.url.child(span.name)} bytes {span.start}-"
            f"{span.start + span.length} were evicted {HELPER_TRIES} times between their "
            "download and their first read; raise cache_limit"
        )

    # -- the store ------------------------------------------------------------------------
    def _get(self, span: Span, out: BinaryIO) -> str:
        """Download the span into `out` (from its start), retried after transient failures
        (from where it stopped); its sha256."""
        attempt, got = 0, 0
        digest = hashlib.sha256()
        while True:
            try:
                for chunk in self._stream(span, got):
                    got += len(chunk)
                    if got > span.length:
                        raise StorageError(
                            f"{self.url.child(span.name)}: more bytes than the {span.length} "
                            f"asked for at {span.start}"
                        )
                    digest.update(chunk)
                    out.write(chunk)
                    self.stats.add(bytes_fetched=len(chunk))
                break
            except TransientError as e:
                attempt += 1
                self.retry.after_failure(e, attempt, self.stats)
        if got != span.length:
            raise StorageError(
                f"{self.url.child(span.name)}: {got} bytes at {span.start}, {span.length} "
                "asked for: the object is shorter than its listing said"
            )
        return digest.hexdigest()

    def _stream(self, span: Span, got: int):
        import obstore

        info = self.objects[span.name]
        where = self.url.child(span.name)
        options: dict = {}
        if info.etag:
            options["if_match"] = info.etag
        if span.start + got or span.length != info.size:
            options["range"] = (span.start + got, span.start + span.length)
        with object_errors(where, info):
            result = obstore.get(self.store.store, span.name, options=options or None)
            chunks = result.stream(min_chunk_size=STREAM_CHUNK)
        while True:
            with object_errors(where, info):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield memoryview(chunk)


@contextlib.contextmanager
def object_errors(where: str, info: ObjectInfo):
    """The store's exceptions as gpufeed's: a failed If-Match is a StalePackError, a range
    answered whole a RangeIgnored (no retry: the caller reads the object whole)."""
    from obstore import exceptions as ox

    try:
        yield
    except StorageError:
        raise
    except ox.PreconditionError:
        raise StalePackError(
            f"{where}: changed in the store since this dataset was opened (its ETag is no "
            f"longer {info.etag}); open the dataset again"
        ) from None
    except Exception as e:
        if "invalid path" in str(e):  # a listed name obstore refuses ("a//b", "a/../b")
            raise DataError(
                f"{where}: the store lists an object whose name is not a plain path "
                f"({str(e).splitlines()[0]}); it is not read (a listing is untrusted)"
            ) from None
        mapped = translate(e, where)
        if isinstance(mapped, RangeIgnoredError):
            raise RangeIgnored(str(mapped)) from None
        if mapped is None:
            raise
        raise mapped from e
