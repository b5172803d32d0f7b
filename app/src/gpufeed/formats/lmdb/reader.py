"""The LMDB format's reader (the layout: gpufeed.formats.lmdb)."""

from __future__ import annotations

import mmap
from pathlib import Path

import lmdb
import numpy as np

from gpufeed.errors import CorruptSampleError, DataError
from gpufeed.formats.base import REPACK, Reader, index_array
from gpufeed.formats.lmdb.envs import (
    DATA_FILE,
    DEFAULT_READAHEAD,
    acquire_env,
    lmdb_error,
    release_env,
)
from gpufeed.formats.lmdb.keys import CRC_KEY, LABELS_KEY, keys
from gpufeed.formats.lmdb.values import (
    SNAPSHOT,
    VALUES_FILE,
    PlacedRecords,
    fitted_delta,
    load_value_table,
    snapshot,
    table_spans,
)
from gpufeed.formats.npy import npy_from_bytes
from gpufeed.pagecache.advise import (
    READ_AHEAD_THREADS,
    Background,
    address,
    advise_buffers,
    looks_warm,
    populate_ahead,
)
from gpufeed.pagecache.copy import PARALLEL_COPY_MIN_BYTES, copy_buffers
from gpufeed.pagecache.maps import kept_map

# are found by arithmetic, not by a B-tree lookup a block (each lookup faults its pages in:
# a read of its own, waited for). The line is fitted once a map to the first values of the
# lowest and highest blocks first announced (read next anyway) and checked against one
# between them; a pack whose values stray from it is not read ahead, nor one whose records
# vary in size (encoded images, fields: reads_ranges_ahead). The
# blocks are then read in and mapped by READ_AHEAD_THREADS threads (MADV_POPULATE_READ):
# two requests in flight, and no page fault left for the copy (docs/performance/lmdb-reads.md).
LINE_SLACK = 4  # values' bytes a value may stray from the line, either way


def value_line(txn, at: np.ndarray) -> tuple[int, float] | None:
    """(address of value 0, bytes per value) when the values of indices ``at`` (3 or more,
    ascending) lie on that line within LINE_SLACK values' bytes; None otherwise."""
    if len(at) < 3 or at[-1] <= at[0]:
        return None
    values = [txn.get(k) for k in keys(at)]
    if any(v is None for v in values):
        return None
    addr = np.array([address(v) for v in values], dtype=np.float64)
    stride = (addr[-1] - addr[0]) / float(at[-1] - at[0])
    line = addr[0] - at[0] * stride
    if stride <= 0 or np.abs(addr - line - at * stride).max() > LINE_SLACK * stride:
        return None
    return int(line), stride


def line_anchors(ranges, count: int) -> np.ndarray:
    """The first index of the lowest, middle and highest of ``ranges`` (in range)."""
    starts = np.unique([int(a) for a, _ in ranges if 0 <= int(a) < count])
    if len(starts) < 3:
        return np.array([0, count // 2, count - 1], dtype=np.int64)
    return starts[[0, len(starts) // 2, -1]].astype(np.int64)


def line_spans(line, ranges, count: int) -> list[tuple[int, int]]:
    """(address, length) of the records of index ranges [start, stop), with LINE_SLACK
    values' bytes either side, none before the first record or after the last (stops
    past count are clipped)."""
    base, stride = line
    slack = LINE_SLACK * stride
    spans = []
    for a, b in ranges:
        a, b = int(a), min(int(b), count)
        if b > a:
            lo = int(base + max(0.0, a * stride - slack))
            spans.append((lo, int(base + min(b * stride + slack, count * stride)) - lo))
    return spans


def _check_env(env, path: Path) -> None:
    """Every page LMDB's own meta page says it may read lies within data.mdb: a read past the
    end of the file is a SIGBUS, not an error."""
    info, st = env.info(), env.stat()
    size = path.stat().st_size
    if (info["last_pgno"] + 1) * st["psize"] > size:
        raise DataError(
            f"{path}: {size:,} bytes, but LMDB's own index reaches page {info['last_pgno']} of "
            f"{st['psize']} bytes: truncated (check it with gpufeed verify)"
        )


def _index(path: Path, name: bytes, value: bytes, dtype=np.int64) -> np.ndarray:
    """Index key ``name``'s .npy bytes as integers (base.index_array)."""
    where = f"{path}: key {name.decode()}"
    try:
        arr = npy_from_bytes(value)
    except (ValueError, EOFError) as e:
        raise DataError(f"{where}: not a readable .npy array: {e}; {REPACK}") from None
    return index_array(where, arr, dtype)


class LMDBReader(Reader):
    format_name = "lmdb"

    def __init__(self, root, manifest, *, readahead: bool = DEFAULT_READAHEAD):
        super().__init__(root, manifest)
        data = self.file(DATA_FILE, whole=True)
        self.env_key = (str(Path(self.root).absolute()), *self._pinned[DATA_FILE][:2])
        self.readahead = bool(readahead)
        self.ahead = Background(READ_AHEAD_THREADS)
        self._line: tuple | None = None  # (env, value_line) of the map last read ahead
        self._table: tuple | None = None  # (env, value table fitted to it) (lmdb_values)
        self._placed: PlacedRecords | None = None  # this process's, where the table is exact
        self.data_path = data
        self.has_value_table = VALUES_FILE in self.manifest.get("files", {})
        env = acquire_env(self.env_key, self.readahead)
        try:
            _check_env(env, data)
            with env.begin() as txn:
                labels, crcs = txn.get(LABELS_KEY), txn.get(CRC_KEY)
        except lmdb.Error as e:
            raise lmdb_error(data, e) from None
        finally:
            release_env(self.env_key, env)
        if labels is None or crcs is None:
            raise CorruptSampleError(data, 0, "LMDB index keys are missing")
        self.labels = _index(data, LABELS_KEY, labels)
        self.crc32 = _index(data, CRC_KEY, crcs, np.uint32)
        self.check_count(LABELS_KEY.decode(), len(self.labels))
        self.check_count(CRC_KEY.decode(), len(self.crc32))

    def _open(self):
        self.check_pinned(DATA_FILE)
        env = acquire_env(self.env_key, self.readahead)
        try:
            return self._opened(env)
        except lmdb.Error as e:
            release_env(self.env_key, env)
            raise lmdb_error(self.data_path, e) from None
        except BaseException:
            release_env(self.env_key, env)
            raise

    def _opened(self, env):
        """``env``, this process's handle, after finding where its records are read from."""
        self._placed = self._placed_records(env)
        if self._placed is not None:  # records are read from this map (its pages probed)
            self.see_cache(self.data_path, self._placed.base)
            return env
        with env.begin(buffers=True) as txn:
            labels = txn.get(LABELS_KEY)  # a value in the map: where the map lies
            if labels is not None and len(labels):
                self.see_cache(self.data_path, address(labels))
        return env

    def _placed_records(self, env) -> PlacedRecords | None:
        """The records by their place (lmdb_values.PlacedRecords) where the value table is
        exact: made of the environment as it still is (its snapshot), every record the
        sample's size where samples are fixed-size, and three records where LMDB says."""
        recorded = self.manifest.get("layout", {}).get(SNAPSHOT)
        if recorded is None or recorded != snapshot(env):
            return None
        fitted = self._check_table(env)
        if fitted is None:
            return None
        table = fitted[0]
        if self.spec.kind == "array" and np.any(table[:, 1] != self.spec.nbytes):
            return None
        how = ("u8", self.readahead)  # advised as LMDB's own map (DEFAULT_READAHEAD)
        data = kept_map(self.data_path, self.pinned_identity(DATA_FILE), how, self._own_map)
        return PlacedRecords(data, table, self.root / VALUES_FILE)

    def _own_map(self) -> np.ndarray:
        with open(self.data_path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        if not self.readahead:
            data.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(data, dtype=np.uint8)

    def _close(self, handle) -> None:
        self.ahead.drain()  # no thread may read the map once it can be closed
        self._placed = None  # its map, unless kept, unmapped now (forget_maps: evictable)
        release_env(self.env_key, handle)

    def __getstate__(self):
        state = super().__getstate__()
        state["_line"] = state["_table"] = state["_placed"] = None  # this process's env, map
        return state

    def location(self, index: int) -> str:
        return str(Path(self.root) / DATA_FILE)

    def read_ahead(self, indices: np.ndarray) -> None:
        env = self.handle
        if self._placed is not None:
            advise_buffers(self._placed.views(indices), cached=self.cached)
            return
        # the values' pages are not touched until copied: look them up, then advise
        try:
            with env.begin(buffers=True) as txn:
                get = txn.get
                values = [v for v in map(get, keys(indices)) if v is not None]
                advise_buffers(values, cached=self.cached)
        except lmdb.Error as e:
            raise lmdb_error(self.data_path, e) from None

    @property
    def reads_ranges_ahead(self) -> bool:
        # fixed-size records by their line; records of varying sizes (encoded images, fields)
        # stray from any line (a JPEG pack: up to 39 records' bytes), so by the pack's value
        # table where it has one (lmdb_values)
        return self.spec.kind == "array" or self.has_value_table

    @property
    def reads_ranges_ahead_in_order(self) -> bool:
        # a cold pass in storage order gains with blocks read ahead, a warm one loses nothing
        # (docs/performance/lmdb-reads.md, "LMDB in storage order";
        # page-cache-read-ahead.md, "A warm epoch announces nothing"); measured for
        # fixed-size records only
        return self.spec.kind == "array"

    def looks_warm(self) -> bool:
        return looks_warm(self._block_spans([(0, self.count)]), self.cached)

    def read_ahead_ranges(self, ranges) -> None:
        populate_ahead(self.ahead, self._block_spans(ranges), self.cached)

    def _block_spans(self, ranges) -> list[tuple[int, int]]:
        """(address, length) in this process's map of the records of index ranges ``[start,
        stop)``: by the value table where it is exact, else by the line (fixed-size
        records) or the table as a hint; none where neither fits the pack."""
        self.handle  # noqa: B018 - opened in this process: _placed is this process's
        if self._placed is not None:
            return self._placed.spans(ranges)
        if self.spec.kind == "array":
            line = self._fitted_line(ranges)
            return [] if line is None else line_spans(line, ranges, self.count)
        fitted = self._fitted_table() if self.has_value_table else None
        return [] if fitted is None else table_spans(*fitted, ranges)

    def _fitted_table(self) -> tuple[np.ndarray, int, int] | None:
        """(table, lead, delta) for this process's map: the value table, the records a
        leaf page holds (a block is read from that many records earlier: its first keys'
        leaf lies before their values) and file offset minus address; None where the table
        does not fit the pack (lmdb_values.load_value_table, fitted_delta)."""
        env = self.handle  # this process's (a new one after a fork: checked anew)
        if self._table is None or self._table[0] is not env:
            self._table = (env, self._check_table(env))
        return self._table[1]

    def _check_table(self, env) -> tuple[np.ndarray, int, int] | None:
        try:  # a hint: a table that is missing or cut short reads without it
            path = self.file(VALUES_FILE, whole=True)
        except DataError:
            return None
        entry = self.manifest.get("files", {}).get(VALUES_FILE)
        table = load_value_table(path, self.count, self.data_path.stat().st_size, entry)
        if table is None:
            return None
        at = [0, self.count // 2, self.count - 1]
        with env.begin(buffers=True) as txn:
            delta = fitted_delta(txn, table, keys(np.array(at)), at)
        if delta is None:
            return None
        stat = env.stat()
        return table, -(-stat["entries"] // max(1, stat["leaf_pages"])), delta

    def _fitted_line(self, ranges) -> tuple[int, float] | None:
        """This process's value line (value_line), fitted once a map to ``ranges``' blocks
        (line_anchors); None for a pack whose values stray from any line."""
        env = self.handle  # this process's (a new one after a fork: the line is fitted anew)
        if self._line is None or self._line[0] is not env:
            with env.begin(buffers=True) as txn:
                self._line = (env, value_line(txn, line_anchors(ranges, self.count)))
        return self._line[1]

    def read_batch(self, indices: np.ndarray):
        env = self.handle
        placed = self._placed
        if placed is not None:  # no lookup: the table is where the records are
            width = self.spec.nbytes if self.spec.kind == "array" else 0
            if 0 < width < PARALLEL_COPY_MIN_BYTES:  # sizes checked with the table
                rows = placed.rows(indices, width)
                return rows.view(self.spec.dtype).reshape(len(indices), *self.spec.shape)
            views = placed.views(indices)
            if self.spec.kind == "encoded":  # views of this reader's own map, as mmap's are
                # no copy: docs/performance/jpeg-decode.md, "The Python per batch"
                advise_buffers(views, cached=self.cached)
                return views
            return self._copied(views, indices)
        try:
            with env.begin(buffers=True) as txn:
                get = txn.get  # a get per key: faster than cursor.getmulti's tuples
                values = [get(k) for k in keys(indices)]
                if None in values:
                    missing = indices[values.index(None)]
                    raise CorruptSampleError(self.location(missing), int(missing), "record missing")
                return self._copied(values, indices)
        except lmdb.Error as e:  # a damaged B-tree page met on the way (MDB_CORRUPTED, ...)
            raise lmdb_error(self.data_path, e) from None

    def _copied(self, values: list, indices: np.ndarray):
        """The samples of records ``values`` (views into a map, valid until this returns)
        in memory the batch owns."""
        sizes = list(map(len, values))
        advise_buffers(values, sizes, self.cached)
        if self.spec.kind != "array":
            return [bytes(v) for v in values]
        width = self.spec.nbytes
        if sizes.count(width) != len(sizes):
            j = next(j for j, n in enumerate(sizes) if n != width)
            raise CorruptSampleError(
                self.location(indices[j]),
                int(indices[j]),
                f"record is {sizes[j]} bytes, expected {width}",
            )
        if width >= PARALLEL_COPY_MIN_BYTES:  # large values: a copy per value, on threads
            out = np.empty((len(values), *self.spec.shape), dtype=self.spec.dtype)
            return copy_buffers(values, out)
        # small values: one C loop copies every value out of the map into memory the
        # batch owns (faster than a numpy row assignment per value)
        joined = bytearray().join(values)
        return np.frombuffer(joined, dtype=self.spec.dtype).reshape(len(values), *self.spec.shape)
