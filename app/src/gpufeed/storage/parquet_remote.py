"""Parquet files and Hugging Face ``datasets`` folders in object storage, read in place.

    open_parquet_at("s3://bucket/data/train-*.parquet")   # a glob of objects
    open_parquet_at("s3://bucket/ds")                      # a folder: Hub layout, save_to_disk
    open_parquet_at("s3://bucket/data/x.parquet", cache_dir="/cache", cache_limit="50GB")

What is listed is untrusted: a glob matches the listing's names segment by segment (``**``
any number of folders), and every name read is checked by the packs' rule (unsafe_name). A
folder is read as locally (gpufeed.formats.inplace.parquet): its state.json's ``.arrow``
files, else its ``.parquet`` files (one split only).

A Parquet object is read by ranges, never whole: its footer once (the last 64 KiB, and the
rest of a larger footer), then per row group read only the chosen columns' chunks (one
ranged GET where they lie together), all through the cache (storage/parquet_ranges.py), so
one batch of a 10 GB file fetches its row groups, not the file. An ``.arrow`` file (Arrow IPC
streams, not seekable by row group) is fetched whole into the cache and mapped, as is every
object of a server that answers ranged GETs with the whole object.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import threading
from pathlib import PurePosixPath
from typing import Any

from gpufeed.errors import DataError, NotPackedError, UnsafePathError
from gpufeed.formats.inplace.parquet import ParquetReader, open_file
from gpufeed.formats.inplace.parquet_listing import (
    PARQUET_MAGIC,
    hidden,
    is_glob,
    one_split,
    state_names,
)
from gpufeed.formats.manifest import unsafe_name
from gpufeed.storage.cache import Cache, Pin
from gpufeed.storage.packs import default_cache_dir, default_cache_limit
from gpufeed.storage.parquet_ranges import (
    ObjectInfo,
    RangeIgnored,
    RemoteObjects,
    Span,
    object_errors,
)
from gpufeed.storage.retry import RetryPolicy, with_retries
from gpufeed.storage.store import ObjectStore
from gpufeed.storage.urls import RemoteURL, parse_location

__all__ = ["RemoteParquet", "open_parquet_at"]

SUFFIXES = (".parquet", ".arrow")
TAIL = 64 << 10  # the first read of a footer: most footers fit
MAX_FOOTER = 256 << 20  # a larger footer is a crafted one
MAX_RANGE = 1 << 30  # one row group's chosen columns, held in memory while decoded
GAP = 1 << 20  # column chunks closer than this are fetched in one GET


def open_parquet_at(
    where: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    **options: Any,
) -> ParquetReader:
    """The ParquetReader of `where`: a local path, or a URL (a Parquet object, a glob of
    them, a folder) read through the cache under `cache_dir` (default $GPUFEED_CACHE_DIR or
    ~/.cache/gpufeed), bounded by `cache_limit` (as open_reader_at). `options`: the reader's
    (columns, cache_row_groups, ...)."""
    loc = parse_location(where)
    if not isinstance(loc, RemoteURL):
        return ParquetReader(loc, **options)
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    cache_limit = default_cache_limit() if cache_limit is None else cache_limit
    source = RemoteParquet(loc, Cache(cache_dir, cache_limit))
    return ParquetReader.from_source(source, **options)


def _matches(name: list[str], pattern: list[str]) -> bool:
    """Whether the segments of `name` match those of a glob (`**`: any number of them)."""
    if not pattern:
        return not name
    if pattern[0] == "**":
        return any(_matches(name[k:], pattern[1:]) for k in range(len(name) + 1))
    return (
        bool(name) and fnmatch.fnmatchcase(name[0], pattern[0]) and _matches(name[1:], pattern[1:])
    )


class RemoteParquet:
    """The Parquet or Arrow objects `url` names, as ParquetReader.from_source takes them."""

    def __init__(self, url: RemoteURL, cache: Cache):
        self.url = url.url
        base, pattern = _split(url)
        listing = _list(base, cache)
        names = _select(base, listing, pattern, cache)
        self.objects = RemoteObjects(base, {n: listing[n] for n in names}, cache)
        self.names = names
        self.files = [base.child(n) for n in names]
        self.whole = False  # the server ignores ranges: objects are read whole
        self._pins: dict[str, Pin] = {}
        self._pid = os.getpid()

    def __getstate__(self):
        return {**self.__dict__, "_pins": {}, "_pid": None}

    def identity(self, k: int) -> tuple:
        info = self.objects.objects[self.names[k]]
        return (info.size, info.etag, info.modified)

    def size(self, k: int) -> int:
        return self.objects.objects[self.names[k]].size

    def open(self, k: int):
        """File k as this process reads it: a Parquet object by ranges, else its whole copy
        in the cache (pinned while this process lives: it is mapped)."""
        name = self.names[k]
        if not name.endswith(".arrow") and not self.whole:
            try:
                ranged = RangedObject(self.objects, name)
            except RangeIgnored:
                self.whole = True
            else:
                return open_file(self.files[k], remote=ranged)
        return open_file(self.files[k], local=self._whole(name).path)

    def _whole(self, name: str) -> Pin:
        if self._pid != os.getpid():  # inherited: the parent's pins stay its own
            self._pins, self._pid = {}, os.getpid()
        pin = self._pins.get(name)
        if pin is None or not pin.held:
            size = self.objects.objects[name].size
            pin = self._pins[name] = self.objects.pin(Span(name, 0, size))
        return pin


def _split(url: RemoteURL) -> tuple[RemoteURL, list[str] | None]:
    """(the folder listed, the glob's segments under it; None: the folder itself is read)."""
    parts = url.prefix.split("/") if url.prefix else []
    for i, part in enumerate(parts):
        if is_glob(part):
            return RemoteURL(url.scheme, url.bucket, "/".join(parts[:i])), parts[i:]
    if parts and parts[-1].endswith(SUFFIXES):
        return RemoteURL(url.scheme, url.bucket, "/".join(parts[:-1])), parts[-1:]
    return url, None


def _list(base: RemoteURL, cache: Cache) -> dict[str, ObjectInfo]:
    """Every object under `base` (relative name -> ObjectInfo), as the store lists them."""
    import obstore

    store = ObjectStore(base)

    def listing() -> list[dict]:
        with object_errors(base.url, ObjectInfo(base.url, 0, "", "")):
            return [m for batch in obstore.list(store.store, None) for m in batch]

    return {
        str(m["path"]): ObjectInfo(
            str(m["path"]), int(m["size"]), str(m.get("e_tag") or ""), str(m["last_modified"])
        )
        for m in with_retries(listing, RetryPolicy(), cache.stats)
    }


def _select(
    base: RemoteURL, listing: dict[str, ObjectInfo], pattern: list[str] | None, cache: Cache
) -> list[str]:
    """The names read, in order: those the glob matches, or the folder's (a save_to_disk
    folder's state.json lists them; else its .parquet objects, one split)."""
    if pattern is not None:
        names = sorted(
            n for n in listing if n.endswith(SUFFIXES) and _matches(n.split("/"), pattern)
        )
        if not names:
            raise NotPackedError(
                f"{base.child('/'.join(pattern))}: no manifest.json, and no .parquet or .arrow "
                "object matches it"
            )
    elif "dataset_dict.json" in listing:
        splits = sorted({n.split("/")[0] for n in listing if n.endswith("/state.json")})
        raise NotPackedError(
            f"{base}: a Hugging Face datasets folder holding a DatasetDict (splits "
            f"{', '.join(splits) or 'none'}); open one split's folder, e.g. "
            f"{base.child(splits[0] if splits else 'train')}"
        )
    elif "state.json" in listing:
        names = _state_files(base, listing, cache)
    else:
        names = sorted(
            n for n in listing if n.endswith(".parquet") and not hidden(PurePosixPath(n))
        )
        if not names:
            raise NotPackedError(
                f"{base}: no manifest.json, and no .parquet objects or state.json under it; "
                "not a gpufeed pack, or its upload is unfinished (the manifest is uploaded "
                "last), nor data read in place"
            )
        one_split(base, [PurePosixPath(n) for n in names], prefix=f"{base}/")
    for name in names:
        unsafe = unsafe_name(name)
        if unsafe:
            raise UnsafePathError(
                base.child(name), f"{unsafe}; it is not read (a listing is untrusted)"
            )
    return names


def _state_files(base: RemoteURL, listing: dict[str, ObjectInfo], cache: Cache) -> list[str]:
    where = base.child("state.json")
    if listing["state.json"].size > 16 << 20:
        raise DataError(
            f"{where}: {listing['state.json'].size:,} bytes; no state.json is that large"
        )
    text = with_retries(
        lambda: ObjectStore(base).read_bytes("state.json"), RetryPolicy(), cache.stats
    )
    names = state_names(text, where)
    if names is None:
        raise DataError(f"{where}: not a datasets state.json (no _data_files list)")
    missing = [n for n in names if n not in listing]
    if missing:
        raise DataError(f"{where}: lists {missing[0]!r}, which is not in the store")
    return names


class RangedObject(io.RawIOBase):
    """A Parquet object as a read-only file for pyarrow: its footer fetched when made, a row
    group's column chunks while `holding` it; a read of anything else is fetched as asked
    (through the cache too)."""

    def __init__(self, objects: RemoteObjects, name: str):
        super().__init__()
        self.objects = objects
        self.name = name
        self.where = objects.url.child(name)
        self.size = objects.objects[name].size
        self.pos = 0
        self.spans: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self.data_end = self._load_footer()

    def _load_footer(self) -> int:
        """Fetch the footer; where the data ends (the footer begins)."""
        if self.size < 12:
            raise DataError(f"{self.where}: {self.size} bytes, too short for a Parquet file")
        t = min(self.size, TAIL)
        tail = self.objects.read(self.name, self.size - t, t)
        self.spans.append((self.size - t, tail))
        if tail[-4:] != PARQUET_MAGIC:
            raise DataError(f"{self.where}: does not end with PAR1; not a Parquet file")
        footer = int.from_bytes(tail[-8:-4], "little")
        if footer + 12 > self.size or footer > MAX_FOOTER:
            raise DataError(
                f"{self.where}: its footer claims {footer:,} bytes of a {self.size:,}-byte "
                "object; the file is damaged or crafted"
            )
        if footer + 8 > t:
            start = self.size - footer - 8
            self.spans.append((start, self.objects.read(self.name, start, footer + 8 - t)))
        return self.size - footer - 8

    @contextlib.contextmanager
    def holding(self, meta, g: int, columns: list[str]):
        """Row group g's chunks of `columns` fetched (one GET per run of them) while held."""
        spans = self._spans(meta, g, columns)
        with self._lock:  # threads of one process read a file one row group at a time
            held = [(lo, self.objects.read(self.name, lo, hi - lo)) for lo, hi in spans]
            self.spans[:0] = held  # looked up first
            try:
                yield
            finally:
                del self.spans[: len(held)]

    def _spans(self, meta, g: int, columns: list[str]) -> list[tuple[int, int]]:
        """[lo, hi) of row group g's chunks of `columns`, runs closer than GAP merged; each
        checked against the object (the footer is untrusted)."""
        group = meta.row_group(g)
        chunks = []
        for j in range(group.num_columns):
            col = group.column(j)
            path = col.path_in_schema
            if not any(path == c or path.startswith(c + ".") for c in columns):
                continue
            lo = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                lo = min(lo, col.dictionary_page_offset)
            hi = lo + col.total_compressed_size
            if lo < 4 or col.total_compressed_size < 0 or hi > self.data_end:
                raise DataError(
                    f"{self.where}: row group {g} column {path!r} claims bytes {lo:,}-{hi:,}, "
                    f"outside its data (4-{self.data_end:,}); the file is damaged or crafted"
                )
            chunks.append((lo, hi))
        runs: list[list[int]] = []
        for lo, hi in sorted(chunks):
            if runs and lo - runs[-1][1] <= GAP:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        total = sum(hi - lo for lo, hi in runs)
        if total > MAX_RANGE:
            raise DataError(
                f"{self.where}: row group {g} spans {total:,} bytes in the chosen columns, more "
                f"than a remote read holds in memory ({MAX_RANGE >> 20} MiB); choose fewer "
                "columns (columns=[...]), or copy the file to a local disk"
            )
        return [(lo, hi) for lo, hi in runs]

    # -- the file interface pyarrow reads through -------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        data = self._bytes(self.pos, end) if end > self.pos else b""
        self.pos = end
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(memoryview(buf)))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def _bytes(self, lo: int, hi: int) -> bytes:
        for start, data in self.spans:
            if start <= lo and hi <= start + len(data):
                return data[lo - start : hi - start]
        if hi - lo > MAX_RANGE:
            raise DataError(f"{self.where}: a read of {hi - lo:,} bytes at {lo:,}; too large")
        return self.objects.read(self.name, lo, hi - lo)
