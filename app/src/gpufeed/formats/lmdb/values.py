"""Where each record's value lies in an LMDB pack's data.mdb (``values.npy``), written when
the pack is, so that packs of records of varying sizes (encoded images, fields) are read
ahead by block as fixed-size ones are by their line (lmdb.line_spans).

Records of varying sizes lie on no line, and LMDB's API gives a value's place only through
a lookup, which faults in the B-tree's pages: a block's bytes could not be found without
reading them. The writer finds them while the file is still in memory: int64 ``[N, 2]``,
each record's (offset in data.mdb, size). A cold pass over a JPEG pack then waits on no
fault (docs/performance/lmdb-reads.md, "JPEG blocks read ahead by a table of value offsets").
It reads them from the B-tree's pages in numpy (:func:`paged_table`, lmdb.pages: ~0.3 s for
a million records where a lookup each took ~3.7 s, a third of the pack's close), checks
them against what it wrote (every key, every size) and three against LMDB's own lookups,
and looks every record up (:func:`value_table`) only where they do not match.

The table is a hint, checked before use: the sha256 the manifest records for it (a table
edited since is not used), its shape, its bytes inside data.mdb (a read past the end of a
mapped file is a SIGBUS), and three records' places against LMDB's own answer. A pack whose
table is missing or does not match reads the same, without it.

**Records read by their place** (:class:`PlacedRecords`). Lookups (``txn.get``: a Python call
and the B-tree's pages each) were two fifths of a warm batch's read of raw records
(docs/performance/lmdb-reads.md, "Records read by their place"). The
writer also records which committed B-tree its table describes (:func:`snapshot`: LMDB's
last transaction id and last page, in the manifest's layout). Every write to an environment
commits a new transaction, and a compacting copy (``mdb_copy -c``) starts over at
transaction 1 where gpufeed's writer always commits at least two; a plain copy keeps every
page where it was. So where the environment is still at that snapshot, the table is where
the records are, and the reader copies them out of its own map of data.mdb by the table,
without a lookup; anywhere else it looks them up, as before.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from gpufeed.formats.base import check_spans, span_views
from gpufeed.formats.checksums import sha256_file
from gpufeed.formats.files import atomic_write_bytes, file_identity
from gpufeed.formats.lmdb.keys import KEY_BYTES, KEY_PLACES
from gpufeed.formats.lmdb.pages import Layout, gather, leaf_values
from gpufeed.formats.npy import npy_bytes
from gpufeed.pagecache.advise import address
from gpufeed.pagecache.probe import map_delta

__all__ = [
    "SNAPSHOT",
    "VALUES_FILE",
    "PlacedRecords",
    "fitted_delta",
    "load_value_table",
    "paged_table",
    "snapshot",
    "table_spans",
    "value_table",
    "write_value_table",
]

VALUES_FILE = "values.npy"
SNAPSHOT = "value_table_snapshot"  # the manifest layout's record of snapshot()
# a block's span is cut where the next record lies before it or this far past its end
# (LMDB put it in pages freed by an earlier transaction: up to 32 MiB away in a JPEG pack)
SPAN_GAP = 1 << 20


def value_table(txn, count: int, keys_of, chunk: int = 1 << 16) -> np.ndarray | None:
    """int64 [count, 2]: records 0..count-1's (offset in the file, size), from a read
    transaction of an environment this process maps (``keys_of``: indices to their keys,
    lmdb.keys); None where a record or the map is not found."""
    table = np.empty((count, 2), dtype=np.int64)
    for lo in range(0, count, chunk):
        placed = _places(txn, keys_of(np.arange(lo, min(lo + chunk, count))))
        if placed is None:
            return None
        table[lo : lo + len(placed[0])] = placed[0]
    return table


def paged_table(data: np.ndarray, psize: int, txnid: int, sizes: np.ndarray) -> np.ndarray | None:
    """value_table from the file's pages (``data``, a map of data.mdb as of transaction
    ``txnid``: lmdb.pages), without a lookup: where the first records of the B-tree are
    records 0..len(sizes)-1, under their keys (lmdb.keys.key) and of ``sizes`` bytes (what the
    writer put); None otherwise (the writer looks them up instead)."""
    count = len(sizes)
    table = np.empty((count, 2), dtype=np.int64)
    at = 0
    try:
        for block in leaf_values(data, psize, txnid):
            rows = block[: count - at]
            if len(rows) and not _written(data, rows, at, sizes):
                return None
            table[at : at + len(rows)] = rows[:, 2:]
            at += len(rows)
    except Layout:
        return None
    return table if at == count else None


def _written(data: np.ndarray, rows: np.ndarray, at: int, sizes: np.ndarray) -> bool:
    """Whether leaf rows (key offset, key size, value offset, value size) are records at,
    at+1, ...: their keys and the sizes they were written with."""
    if np.any(rows[:, 1] != KEY_BYTES) or np.any(rows[:, 3] != sizes[at : at + len(rows)]):
        return False
    digits = gather(data, rows[:, 0], KEY_BYTES) - np.uint8(ord("0"))  # 0..9, else wrapped
    if len(digits) and int(digits.max()) > 9:
        return False
    return bool(np.array_equal(digits @ KEY_PLACES, np.arange(at, at + len(rows))))


def _places(txn, keys) -> tuple[np.ndarray, int] | None:
    """(int64 [len(keys), 2] of the records' (offset in the file, size), file offset minus
    address in this map), or None where a record or the map is not found."""
    values = [txn.get(k) for k in keys]
    if not values or any(v is None for v in values):
        return None
    delta = map_delta(address(values[0]))
    if delta is None:
        return None
    return np.array([(address(v) + delta, len(v)) for v in values], dtype=np.int64), delta


def write_value_table(path: Path, table: np.ndarray) -> str:
    """Write the table; its file's sha256."""
    data = npy_bytes(table)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def load_value_table(
    path: Path, count: int, file_bytes: int, entry: dict | None = None
) -> np.ndarray | None:
    """The table at ``path`` when it fits: the file the manifest's ``entry`` records (its
    sha256: a table edited since, two rows swapped say, is not used: its rows would serve
    other records as the samples), ``[count, 2]`` int64, every value inside ``file_bytes``;
    None otherwise (the pack reads without it)."""
    want = entry.get("sha256") if isinstance(entry, dict) else None
    try:
        before = file_identity(os.stat(path))
        if not isinstance(want, str) or sha256_file(path) != want:
            return None
        table = np.load(path, mmap_mode="r", allow_pickle=False)
        if file_identity(os.stat(path)) != before:  # replaced while it was hashed
            return None
    except (OSError, ValueError):
        return None
    if table.dtype != np.int64 or table.shape != (count, 2) or count == 0:
        return None
    offsets, sizes = table[:, 0], table[:, 1]
    if offsets.min() < 0 or sizes.min() < 0 or (offsets + sizes).max() > file_bytes:
        return None
    return np.asarray(table)


def fitted_delta(txn, table: np.ndarray, keys: list[bytes], at: list[int]) -> int | None:
    """File offset minus address in this map (from the first of records ``at``, their
    ``keys``) when every one of them lies where the table says; None otherwise."""
    placed = _places(txn, keys)
    if placed is None or not np.array_equal(placed[0], table[at]):
        return None
    return placed[1]


def table_spans(table: np.ndarray, lead: int, delta: int, ranges) -> list[tuple[int, int]]:
    """(address, length) in this map of the records of index ranges ``[start, stop)``, each
    from ``lead`` records earlier (the leaf page that holds a block's first keys lies
    before their values), cut where records stray (SPAN_GAP)."""
    spans: list[tuple[int, int]] = []
    count = len(table)
    for a, b in ranges:
        a, b = max(0, int(a) - lead), min(int(b), count)
        if b <= a:
            continue
        starts, ends = table[a:b, 0], table[a:b, 0] + table[a:b, 1]
        cuts = np.flatnonzero((starts[1:] < starts[:-1]) | (starts[1:] > ends[:-1] + SPAN_GAP))
        bounds = [0, *(cuts + 1).tolist(), b - a]
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            first, last = int(starts[lo:hi].min()), int(ends[lo:hi].max())
            spans.append((first - delta, last - first))
    return spans


def snapshot(env) -> dict[str, int]:
    """Which committed B-tree of environment ``env`` a value table made now describes."""
    info = env.info()
    return {"txnid": int(info["last_txnid"]), "last_page": int(info["last_pgno"])}


class PlacedRecords:
    """Records read by their place in data.mdb: slices of a map of the whole file
    (``data``, uint8) at the table's (offset, size) rows, each a view until copied."""

    def __init__(self, data: np.ndarray, table: np.ndarray, path: Path):
        self.base = data.ctypes.data
        self.table = table
        self._map = data
        self._starts, self._ends = table[:, 0], table[:, 0] + table[:, 1]
        # inside this map (the table was checked against the file's size; the map is what
        # views and rows' strided window are built over)
        check_spans(path, self._starts, self._ends, len(data))
        self._window: np.ndarray | None = None

    def views(self, indices: np.ndarray) -> list[np.ndarray]:
        """The records as uint8 views of the map (each keeps the map alive, as the mmap
        reader's views do)."""
        return span_views(self._map, self._starts[indices], self._ends[indices])

    def rows(self, indices: np.ndarray, width: int) -> np.ndarray:
        """A new uint8 ``[len(indices), width]`` array of records of ``width`` bytes each
        (every record's size: checked with the table), copied by one fancy index of the
        map seen as overlapping rows, row k at byte k (faster than joining the records'
        views: docs/performance/lmdb-reads.md)."""
        if self._window is None or self._window.shape[1] != width:
            shape = (len(self._map) - width + 1, width)
            self._window = np.lib.stride_tricks.as_strided(
                self._map, shape=shape, strides=(1, 1), writeable=False
            )
        return self._window[self._starts[indices]]

    def spans(self, ranges) -> list[tuple[int, int]]:
        """(address, length) in this map of the records of index ranges ``[start, stop)``
        (no B-tree page is read: none from earlier records)."""
        return table_spans(self.table, 0, -self.base, ranges)
