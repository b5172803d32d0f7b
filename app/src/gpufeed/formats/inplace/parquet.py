"""Parquet files and Hugging Face ``datasets`` folders read in place (``pip install
'gpufeed[parquet]'``: pyarrow).

What is read: one ``.parquet`` file, a glob of them (``data/train-*.parquet``), a folder of
them (searched below it, as the Hub lays them out: ``data/train-00000-of-00012.parquet``; a
folder holding several splits is refused: name one with a glob), or a folder made by
``datasets``' ``save_to_disk`` (``state.json`` listing ``*.arrow`` files: Arrow IPC streams,
memory-mapped, their record batches read without a copy where they are uncompressed).

Each column is a field (gpufeed.formats.inplace.arrow_columns), ``columns=`` picks some; a
column named ``label`` of integers gives the labels (a Hugging Face ClassLabel its class
names). The unit of I/O is the row group (a record batch of an Arrow file): a batch's rows are
gathered per row group, each needed one read once with only the chosen columns, and each
process keeps its last row groups: at least ``cache_row_groups`` (16; make_loader's block
shuffle mixes ``buffer_blocks``, 16, row groups at a time, so each is read once an epoch),
more while they hold under ``cache_bytes`` (256 MiB: a small set stays whole, as a plain
DataLoader's uniform shuffle wants). ``preferred_block_size`` is the row-group size
(make_loader's block).
Files are opened lazily, per process (fork and spawn safe). Nulls: ``nulls="error"`` (a
CorruptSampleError naming row and column) or ``"mask"`` (an empty value and a
``<column>_valid`` field); a Hub ``Audio`` column reads as its waveform and ``<column>_rate``
(arrow_rows; ``audio="bytes"`` keeps the file). Which files a path names:
parquet_listing; files in object storage: gpufeed.storage.parquet_remote (from_source).

Everything in the files is untrusted: a footer, a row count, a page that does not read is a
DataError (CorruptSampleError for one sample's rows) naming the file.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from gpufeed.errors import (
    CorruptSampleError,
    DataError,
    StalePackError,
    UsageError,
)
from gpufeed.formats.base import Reader
from gpufeed.formats.files import file_identity
from gpufeed.formats.inplace.arrow_columns import (
    column_field,
    first_bytes,
    hub_features,
)
from gpufeed.formats.inplace.arrow_rows import AUDIO, ColumnRows, RowError, audio_feature
from gpufeed.formats.inplace.parquet_listing import has_magic, is_parquet, parquet_files
from gpufeed.formats.record import join_record
from gpufeed.formats.schema import Schema

__all__ = ["ParquetReader", "is_parquet", "open_file", "parquet_files", "pyarrow_modules"]

# more rows than this in one file is no real file's: a crafted footer
MAX_ROWS = 1 << 40
# make_loader's block shuffle mixes buffer_blocks (16: data/order.py) row groups at a time:
# a cache that holds them reads each row group once an epoch
CACHE_ROW_GROUPS = 16
# more row groups are kept while they hold under this many bytes (per process)
CACHE_BYTES = 256 << 20
# nulls=: "error" (a null is a CorruptSampleError), "mask" (an empty value and <col>_valid)
NULLS = ("error", "mask")
INSTALL = "install pyarrow: pip install 'gpufeed[parquet]'"


def pyarrow_modules():
    """(pyarrow, pyarrow.parquet), imported when first needed; a UsageError naming the extra
    where pyarrow is not installed."""
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401 - pa.ipc
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"reading Parquet and Arrow files needs pyarrow: {INSTALL}") from None
    return pa, pq


class _File:
    """One file as this process reads it: Parquet row groups, or an Arrow file's batches.
    `path` is what messages name; `local` the file read (default `path`: an object in
    storage is read from its copy in the cache); `remote` an object in storage read by
    ranges (gpufeed.storage.parquet_remote.RangedObject: a file object whose row groups'
    bytes are fetched, by `holding`, before they are read)."""

    def __init__(self, path, *, local: Path | None = None, remote=None):
        pa, pq = pyarrow_modules()
        self.path = path
        self.parquet = None
        self.batches = None
        self.remote = remote
        local = Path(path) if local is None else local
        if remote is not None or has_magic(local):
            # read, not mapped: a file of theirs truncated while mapped would be a SIGBUS
            self.parquet = pq.ParquetFile(
                remote if remote is not None else local, memory_map=False, pre_buffer=False
            )
            self.schema = self.parquet.schema_arrow
            meta = self.parquet.metadata
            self.rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            return
        source = pa.memory_map(str(local))
        head = source.read(6)
        source.seek(0)
        if head == b"ARROW1":
            f = pa.ipc.open_file(source)
            self.batches = [f.get_batch(k) for k in range(f.num_record_batches)]
            self.schema = f.schema
        else:
            f = pa.ipc.open_stream(source)
            self.schema = f.schema
            self.batches = list(f)
        self.rows = [b.num_rows for b in self.batches]

    def group(self, g: int, columns: list[str]):
        """Row group g, only `columns` (a Table)."""
        pa, _ = pyarrow_modules()
        if self.remote is not None:
            with self.remote.holding(self.parquet.metadata, g, columns):
                return self.parquet.read_row_group(g, columns=columns, use_threads=False)
        if self.parquet is not None:
            return self.parquet.read_row_group(g, columns=columns, use_threads=False)
        table = pa.Table.from_batches([self.batches[g]]).select(columns)
        # an IPC file's arrays are its bytes as they are: offsets that point past their
        # buffers would read memory outside the file (Parquet's are built by its decoder)
        table.validate(full=True)
        return table


def open_file(path, **where) -> _File:
    """A file opened (`where`: _File's local= or remote=), any failure of pyarrow's a
    DataError naming it."""
    pa, _ = pyarrow_modules()
    try:
        return _File(path, **where)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
        raise DataError(
            f"{path}: not a readable Parquet or Arrow file ({type(e).__name__}: {e}); "
            "it is truncated, damaged or not such a file"
        ) from None


def _first_group(f: _File, names: list[str]):
    """The first row group of `f` (its first values tell images from bytes), or None."""
    pa, _ = pyarrow_modules()
    if not f.rows or not f.rows[0]:
        return None
    try:
        return f.group(0, names)
    except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
        raise DataError(f"{f.path}: its first row group does not read: {e}") from None


class ParquetReader(Reader):
    """Rows of Parquet files or a ``datasets`` folder as multi-field samples (module
    docstring). ``columns``: the columns to read (default all); ``cache_row_groups``: how
    many decoded row groups each process keeps at least; ``cache_bytes``: more while they
    hold under that many bytes. Files in object storage are read through a `source`
    (:meth:`from_source`; gpufeed.storage.parquet_remote makes it)."""

    format_name = "parquet"
    checksums = False  # Parquet's page checksums are pyarrow's to check, not per sample

    @classmethod
    def from_source(cls, source, **options) -> ParquetReader:
        """The reader of files that `source` lists and opens: ``source.files`` (the names
        messages give), ``source.open(k)`` (file k, a _File made by open_file),
        ``source.identity(k)`` and ``source.size(k)``; ``source.url`` is the path."""
        reader = cls.__new__(cls)
        reader.source = source
        reader.__init__(source.url, **options)
        return reader

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        columns: list[str] | None = None,
        cache_row_groups: int = CACHE_ROW_GROUPS,
        cache_bytes: int = CACHE_BYTES,
        nulls: str = "error",
        audio: str = "decode",
    ):
        for option, value, choices in (("nulls", nulls, NULLS), ("audio", audio, AUDIO)):
            if value not in choices:
                raise UsageError(f"{option}={value!r}: one of {', '.join(map(repr, choices))}")
        self.nulls, self.audio = nulls, audio
        if int(cache_row_groups) < 1:
            raise UsageError(f"cache_row_groups={cache_row_groups!r}: at least 1")
        self.files = self._listed(path)
        self.cache_row_groups = int(cache_row_groups)
        self.cache_bytes = int(cache_bytes)
        first = self._open_file(0)
        names = self._columns(path, first.schema, columns)
        self.columns = names
        opened = [first] + [self._open_file(k) for k in range(1, len(self.files))]
        schema, classes = self._schema(first, names)
        self._check_same(opened, first.schema, names)
        self._index(opened)
        manifest = {
            "format": self.format_name,
            "format_version": 2,
            "count": self.count_rows,
            "classes": classes,
            "sample": {"kind": "fields", "fields": schema.to_json()},
            "files": {},
            "layout": {"files": self.files, "row_groups": len(self.group_file)},
        }
        super().__init__(Path(self.files[0]).parent, manifest)
        self.identity = [self._identity(k) for k in range(len(self.files))]
        self.labels = self._labels(opened, schema)
        self.crc32 = np.broadcast_to(np.uint32(0), (self.count,))
        sizes = np.diff(self.group_start)
        self.preferred_block_size = int(np.median(sizes)) if len(sizes) else 1

    # -- opening -------------------------------------------------------------------------
    def _listed(self, path) -> list[str]:
        files = self.source.files if self.source is not None else parquet_files(path)
        if not files:
            raise DataError(f"{path}: no Parquet or Arrow files there")
        return [str(f) for f in files]

    def _open_file(self, k: int) -> _File:
        if self.source is not None:
            return self.source.open(k)
        return open_file(Path(self.files[k]))

    def _identity(self, k: int):
        if self.source is not None:
            return self.source.identity(k)
        return file_identity(os.stat(self.files[k]))

    def _columns(self, path, schema, columns) -> list[str]:
        have = list(schema.names)
        if columns is None:
            return have
        if isinstance(columns, str) or not columns:
            raise UsageError(f"columns={columns!r}: a list of column names, e.g. {have[:2]}")
        missing = [c for c in columns if c not in have]
        if missing:
            raise UsageError(f"{path}: no column {missing}; it has {have}")
        return [str(c) for c in columns]

    def _schema(self, first: _File, names: list[str]) -> tuple[Schema, list[str] | None]:
        features = hub_features(first.schema)
        sample = _first_group(first, names)
        self.plans = [self._plan(first, name, features.get(name), sample) for name in names]
        fields = [f for plan in self.plans for f in plan.fields()]
        added = [f.name for plan in self.plans for f in plan.fields()[1:]]
        clash = [n for n in added if n in names or added.count(n) > 1]
        if clash:
            raise UsageError(
                f"{first.path}: a field {clash[0]!r} is added (nulls='mask' adds <col>_valid, "
                "a decoded Audio column <col>_rate) and a column of that name is read too; "
                "leave one out with columns=[...]"
            )
        label = features.get("label")
        classes = label.get("names") if isinstance(label, dict) else None
        ok = isinstance(classes, list) and all(isinstance(c, str) for c in classes)
        return Schema(tuple(fields)), (classes if ok else None)

    def _plan(self, first: _File, name: str, feature, sample) -> ColumnRows:
        """How column `name` is read (arrow_rows.ColumnRows)."""
        col = sample.column(name) if sample is not None else None
        head = first_bytes(col) if col is not None else None
        arrow = first.schema.field(name)
        try:
            field = column_field(name, arrow.type, feature, head)
        except UsageError as e:
            raise DataError(f"{first.path}: column {name!r}: {e}") from None
        audio = self.audio == "decode" and audio_feature(feature) and field.type == "bytes"
        return ColumnRows(field, audio=audio, masked=self.nulls == "mask" and arrow.nullable)

    def _check_same(self, opened: list[_File], schema, names: list[str]) -> None:
        for f in opened[1:]:
            for name in names:
                if (
                    name not in f.schema.names
                    or f.schema.field(name).type != schema.field(name).type
                ):
                    found = (
                        f.schema.field(name).type if name in f.schema.names else "no such column"
                    )
                    raise DataError(
                        f"{f.path}: column {name!r} is {found}; {opened[0].path} has "
                        f"{schema.field(name).type}: the files must share their columns"
                    )

    def _index(self, opened: list[_File]) -> None:
        """The row groups of every file in order: group_file, group_index, group_start."""
        rows, gfile, gindex = [], [], []
        for k, f in enumerate(opened):
            if sum(f.rows) > MAX_ROWS or any(r < 0 for r in f.rows):
                raise DataError(
                    f"{f.path}: its footer claims {sum(f.rows):,} rows; no real file holds "
                    "that many (the file is damaged or crafted)"
                )
            for g, r in enumerate(f.rows):
                rows.append(r)
                gfile.append(k)
                gindex.append(g)
        self.group_file = np.asarray(gfile, dtype=np.int32)
        self.group_index = np.asarray(gindex, dtype=np.int32)
        self.group_start = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        self.count_rows = int(self.group_start[-1])

    def _labels(self, opened: list[_File], schema: Schema) -> np.ndarray:
        """The label column's values, when there is one of integers (else -1s)."""
        if "label" not in schema.names or schema["label"].type != "int":
            return np.broadcast_to(np.int64(-1), (self.count,))
        pa, _ = pyarrow_modules()
        out = np.empty(self.count, dtype=np.int64)
        for g in range(len(self.group_file)):
            f = opened[int(self.group_file[g])]
            try:
                col = f.group(int(self.group_index[g]), ["label"]).column("label").combine_chunks()
            except (pa.ArrowException, OSError, MemoryError) as e:
                raise DataError(f"{f.path}: its label column does not read: {e}") from None
            self._check_rows(g, f, len(col))
            lo, hi = int(self.group_start[g]), int(self.group_start[g + 1])
            out[lo:hi] = col.fill_null(-1).to_numpy(zero_copy_only=False)
        return out

    def _check_rows(self, g: int, f: _File, rows: int) -> None:
        """Row group g read as `rows` rows: as many as its footer said, or a DataError."""
        want = int(self.group_start[g + 1] - self.group_start[g])
        if rows != want:
            raise DataError(
                f"{f.path}: row group {int(self.group_index[g])} holds {rows:,} rows, its "
                f"footer says {want:,}; the file is damaged or crafted"
            )

    # -- reading -------------------------------------------------------------------------
    def _open(self):
        return {"files": {}, "groups": OrderedDict(), "bytes": 0}

    def _close(self, handle) -> None:
        handle["files"].clear()
        handle["groups"].clear()

    def _file(self, k: int) -> _File:
        files = self.handle["files"]
        if k not in files:
            if self.source is None:  # an object's identity is checked by each of its reads
                self._check_identity(k)
            files[k] = self._open_file(k)
        return files[k]

    def _check_identity(self, k: int) -> None:
        try:
            now = file_identity(os.stat(self.files[k]))
        except FileNotFoundError:
            now = None
        if now != self.identity[k]:
            raise StalePackError(
                f"{self.files[k]}: replaced or changed since this dataset was opened; open it again"
            )

    def _group(self, g: int):
        """Row group g (global number) as a Table, from this process's cache."""
        cache = self.handle["groups"]
        if g in cache:
            cache.move_to_end(g)
            return cache[g]
        pa, _ = pyarrow_modules()
        f = self._file(int(self.group_file[g]))
        try:
            table = f.group(int(self.group_index[g]), self.columns)
        except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
            raise CorruptSampleError(
                f.path,
                int(self.group_start[g]),
                f"row group {int(self.group_index[g])} does not read: {e}",
            ) from None
        self._check_rows(g, f, table.num_rows)
        cache[g] = table
        held = self.handle["bytes"] + table.nbytes
        while len(cache) > self.cache_row_groups and held > self.cache_bytes:
            held -= cache.popitem(last=False)[1].nbytes
        self.handle["bytes"] = held
        return table

    def location(self, index: int) -> str:
        g = int(np.searchsorted(self.group_start, index, side="right")) - 1
        return self.files[int(self.group_file[g])]

    def data_files(self) -> list[str]:
        return list(self.files)

    def mean_sample_bytes(self) -> float:
        if self.source is not None:
            total = sum(self.source.size(k) for k in range(len(self.files)))
        else:
            total = sum(os.path.getsize(f) for f in self.files if os.path.exists(f))
        return total / max(1, self.count)

    def read_batch(self, indices: np.ndarray):
        """The batch's rows taken from each row group it touches, joined (no copy) and
        converted column by column once for the batch: a fixed cost a batch, not one a row
        group (a uniform shuffle touches nearly every row group in every batch)."""
        pa, _ = pyarrow_modules()
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return []
        groups = np.searchsorted(self.group_start, indices, side="right") - 1
        order = np.argsort(groups, kind="stable")
        ordered, ordered_groups = indices[order], groups[order]
        cuts = np.flatnonzero(np.diff(ordered_groups)) + 1
        spans = list(zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(order)].tolist(), strict=True))
        pieces = []
        for lo, hi in spans:
            g = int(ordered_groups[lo])
            pieces.append(self._group(g).take(pa.array(ordered[lo:hi] - self.group_start[g])))
        try:
            records = self._records(pa.concat_tables(pieces), ordered)
        except pa.ArrowInvalid:  # files whose schemas differ in a way Arrow will not join
            records = []
            for (lo, hi), piece in zip(spans, pieces, strict=True):
                records += self._records(piece, ordered[lo:hi])
        out: list = [None] * len(indices)
        for j, record in zip(order.tolist(), records, strict=True):
            out[j] = record
        return out

    def _records(self, rows, where: np.ndarray) -> list[bytes]:
        """The records of the table `rows`, whose rows are the global rows `where`."""
        pa, _ = pyarrow_modules()
        columns = []
        for plan in self.plans:
            col = rows.column(plan.name).combine_chunks()
            nulls = plan.nulls(col)
            if nulls is not None and not plan.masked:
                self._null_error(int(where[int(np.argmax(nulls))]), plan.field)
            try:
                columns += plan.values(col, nulls)
            except RowError as e:
                i = int(where[e.row])
                raise CorruptSampleError(self.location(i), i, str(e)) from None
            except (pa.ArrowException, ValueError, TypeError) as e:
                i = int(where[0])
                raise CorruptSampleError(
                    self.location(i), i, f"column {plan.name!r}: {e}"
                ) from None
        return [join_record(list(values)) for values in zip(*columns, strict=True)]

    def _null_error(self, i: int, field) -> None:
        g = int(np.searchsorted(self.group_start, i, side="right") - 1)
        raise CorruptSampleError(
            self.location(i),
            i,
            f"column {field.name!r} is null in this row (row {i - int(self.group_start[g])} of "
            f"row group {int(self.group_index[g])}); gpufeed stores no nulls: pass "
            f"nulls='mask' (a {field.name}_valid field), leave the column out "
            "(columns=[...]), fill it, or pass on_error='skip' to leave such rows out",
        )
