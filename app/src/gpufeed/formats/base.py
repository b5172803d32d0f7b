"""What every format's reader and writer share.

A reader is plain configuration plus numpy index arrays until it reads; a writer assembles
committed parts (:class:`~gpufeed.formats.parts.Part`) into the format's files. Readers hand
back numpy arrays (fixed-shape samples) or byte buffers (encoded samples); ``gpufeed.data``
turns them into tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import DataError, StalePackError
from gpufeed.formats.files import file_identity
from gpufeed.formats.manifest import MANIFEST_NAME, SOURCES_NAME, pack_file, read_sources
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec
from gpufeed.pagecache.plan import BatchReadAhead
from gpufeed.pagecache.probe import cache_probe

__all__ = [
    "ContiguousWriter",
    "Reader",
    "Writer",
    "check_offsets",
    "check_spans",
    "index_array",
    "make_room",
    "span_views",
]

# what a message about a damaged or crafted index tells the user to do
REPACK = "the pack is damaged or was crafted: check it with gpufeed verify, or re-pack it"


class Reader:
    """Base of the format readers.

    A reader is plain configuration plus numpy index arrays (labels, crc32, offsets) until it
    reads: the storage handle is opened on first use in the process that reads, reopened when
    the pid changes (a forked DataLoader worker), and dropped when pickled (a spawned worker).
    """

    format_name = ""
    # a remote pack's files (gpufeed.storage.packs.RemoteFiles: fetch(name) -> a pinned,
    # verified local copy; release(name)); None: the files are under root
    source = None
    # how reads ahead tell a cached range of this reader's map: None, mincore
    # (readahead.looks_cached); a pagecache.FileProbe where mincore cannot see the file
    cached = None

    @classmethod
    def with_source(cls, source, root: str | os.PathLike, manifest: dict[str, Any], **options):
        """The reader of a pack whose files come from `source`, not from `root` (which holds
        the manifest only): set before __init__, where the readers name their files."""
        reader = cls.__new__(cls)
        reader.source = source
        reader.__init__(root, manifest, **options)
        return reader

    def __init__(self, root: str | os.PathLike, manifest: dict[str, Any]):
        self.root = Path(root)
        self.manifest = manifest
        self.spec = SampleSpec.from_json(manifest["sample"])
        self.count = int(manifest["count"])
        self._h = None
        self._pid: int | None = None
        self._pinned: dict[str, tuple | None] = {}

    # -- the pack's files ----------------------------------------------------------------
    def file(self, name: str, *, whole: bool = False) -> Path:
        """The pack file `name`, checked (pack_file) and pinned: its identity now is what
        every later open compares with (check_pinned), so a pack replaced or rewritten
        after this reader was made is an error, never its old index over new data.
        A remote pack's file (`source`) is fetched here when read whole (and pinned while
        this reader lives); otherwise when opened (`local_path`).
        whole=True: the file is read or mapped whole, so it must exist and hold at least the
        bytes the manifest records (a truncated file mapped by LMDB or numpy is a SIGBUS
        when touched; checked here, it is an error naming the file. A file grown or edited
        in place is left to the per-sample checks and to verify)."""
        if self.source is not None:
            self.source.check_name(name)  # pack_file's rule, before any fetch or link
            if not whole:
                return self.root / name
            path = self.source.fetch(name)
            self._pinned[name] = file_identity(os.stat(path))
            return path
        path = pack_file(self.root, name)
        entry = self.manifest.get("files", {}).get(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if whole:
                raise DataError(f"{path}: missing; the pack is incomplete") from None
            self._pinned[name] = None
            return path
        if whole:
            if not isinstance(entry, dict) or "bytes" not in entry:
                raise DataError(f"{self.root / MANIFEST_NAME}: does not list {name}")
            if st.st_size < int(entry["bytes"]):
                raise DataError(
                    f"{path}: {st.st_size:,} bytes, the manifest says {int(entry['bytes']):,}: "
                    "truncated since it was packed (check it with gpufeed verify)"
                )
        self._pinned[name] = file_identity(st)
        return path

    def pinned_identity(self, name: str) -> tuple | None:
        """The identity `name` had when this reader pinned it (what check_pinned compares)."""
        return self._pinned.get(name)

    def check_pinned(self, name: str, st: os.stat_result | None = None) -> None:
        """Raise StalePackError when file `name` is no longer the one this reader pinned."""
        want = self._pinned.get(name)
        if want is None or self.source is not None:  # cached copies are named by their sha256
            return
        path = self.root / name
        try:
            now = file_identity(st if st is not None else os.stat(path))
        except FileNotFoundError:
            now = None
        if now != want:
            raise StalePackError(
                f"{path}: replaced or changed since this dataset was opened (file identity, "
                "size or mtime differ); its index no longer describes it: open the pack again"
            )

    def local_path(self, name: str) -> Path:
        """Where to open the pack's file `name`: under root, or its cached copy (fetched and
        pinned until release_file)."""
        return self.root / name if self.source is None else self.source.fetch(name)

    def release_file(self, name: str) -> None:
        """Done with `name` for now: a cached copy may be evicted (open handles stay valid)."""
        if self.source is not None:
            self.source.release(name)

    def check_count(self, what: str, n: int, expected: int | None = None) -> None:
        """An index array or stored container must hold as many entries as the manifest
        says: a manifest claiming more samples than stored is an error, not an IndexError
        later or silently fewer samples."""
        expected = self.count if expected is None else expected
        if int(n) != int(expected):
            raise DataError(
                f"{self.root}: {what} holds {int(n):,} entries, the manifest says "
                f"{int(expected):,}; the pack is inconsistent (re-pack it)"
            )

    def see_cache(self, path: str | os.PathLike, addr: int) -> None:
        """How this process tells which pages of file ``path``, mapped at ``addr``, are
        cached (``cached``, the reader's ``ahead`` too): mincore, unless it cannot see them
        (pagecache.cache_probe)."""
        self.tell_cached_by(cache_probe(path, addr))

    def tell_cached_by(self, cached) -> None:
        """Make ``cached`` (None: mincore) how this reader and its ``ahead`` tell a cached
        range, closing the probe it replaces."""
        self._close_probe()
        self.cached = cached
        ahead = getattr(self, "ahead", None)
        if hasattr(ahead, "cached"):
            ahead.cached = cached

    def _close_probe(self) -> None:
        close = getattr(self.cached, "close", None)  # a FileProbe's descriptor
        if close is not None:
            close()

    # -- handle management -------------------------------------------------------------
    def _open(self):
        raise NotImplementedError

    def _close(self, handle) -> None:
        close = getattr(handle, "close", None)
        if close is not None:
            close()

    @property
    def handle(self):
        pid = os.getpid()
        if self._h is None or self._pid != pid:
            # A handle inherited through fork is abandoned, never closed here: closing it
            # could disturb the parent's library state (h5py, LMDB).
            self._h = self._open()
            self._pid = pid
        return self._h

    def close(self) -> None:
        if self._h is not None and self._pid == os.getpid():
            self._close(self._h)
        self._close_probe()
        self._h = None
        self._pid = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_h"] = None
        state["_pid"] = None
        return state

    def __len__(self) -> int:
        return self.count

    # -- reading -------------------------------------------------------------------------
    def location(self, index: int) -> str:
        """The file that holds sample `index` (for error messages)."""
        return str(self.root)

    def read(self, index: int):
        """One sample: a numpy array (kind "array") or a bytes-like object (kind "encoded",
        or "fields": the sample's record, gpufeed.formats.record)."""
        batch = self.read_batch(np.array([index], dtype=np.int64))
        return batch[0]

    def read_batch(self, indices: np.ndarray):
        """Samples at `indices` (int64, in range): one [B, ...] array or a list of buffers."""
        raise NotImplementedError

    def read_ahead_batch(self, hints: BatchReadAhead) -> None:
        """The one entry of a batch's read-ahead (make_loader's plan, carried by the batch;
        gpufeed.pagecache.plan): the samples of a later batch (:meth:`read_ahead`, indices
        checked by the dataset) and the blocks announced with this one
        (:meth:`read_ahead_ranges`)."""
        if hints.ahead is not None and len(hints.ahead):
            self.read_ahead(np.asarray(hints.ahead, dtype=np.int64))
        if hints.ranges:
            self.read_ahead_ranges(hints.ranges)

    def read_ahead(self, indices: np.ndarray) -> None:
        """Start reading samples ``indices`` into the page cache without waiting (a hint:
        formats that cannot say where a sample lies do nothing)."""

    # whether read_ahead_ranges is worth calling (make_loader reads small samples ahead by
    # block only then): mmap, mapped HDF5 and LMDB measured faster cold, as fast warm
    # (docs/performance/page-cache-read-ahead.md, docs/performance/lmdb-reads.md)
    reads_ranges_ahead = False
    # whether that holds in storage order too, where the kernel's own readahead streams
    # most files (mmap and HDF5 measured slower with blocks on top); LMDB's does not keep up
    # (docs/performance/lmdb-reads.md, "LMDB in storage order")
    reads_ranges_ahead_in_order = False

    def looks_warm(self) -> bool:
        """Whether this reader's sample bytes look cached throughout (readahead.looks_warm:
        pages spread over them), asked once an epoch read ahead by block: then no block is
        announced. False where the reader cannot tell (the default: blocks as before)."""
        return False

    def read_ahead_ranges(self, ranges) -> None:
        """Start reading the samples of index ranges ``[start, stop)`` (whole blocks of the
        epoch's order, a window ahead) into the page cache without waiting: one hint a
        range, for small samples (a hint: formats that cannot say where a range lies do
        nothing)."""

    def mean_sample_bytes(self) -> float:
        """Stored bytes per sample: exact for fixed-shape arrays, from file sizes otherwise."""
        if self.spec.kind == "array":
            return float(self.spec.nbytes)
        files = self.manifest.get("files", {})
        total = sum(int(f.get("bytes", 0)) for f in files.values() if isinstance(f, dict))
        return total / max(1, self.count)

    def iter_range(self, start: int = 0, stop: int | None = None, step: int = 256):
        """(index, sample) in storage order; used by verify and sequential readers."""
        stop = self.count if stop is None else stop
        for lo in range(start, stop, step):
            idx = np.arange(lo, min(lo + step, stop), dtype=np.int64)
            batch = self.read_batch(idx)
            for j, i in enumerate(idx):
                yield int(i), batch[j]

    def sources(self) -> list[str] | None:
        """Source path of every sample, when the pack recorded them."""
        p = pack_file(self.root, SOURCES_NAME)
        if not p.exists():
            return None
        return read_sources(p)

    def data_files(self) -> list[str]:
        """Files (relative to root) that hold sample bytes."""
        return sorted(self.manifest.get("files", {}))


def index_array(where, arr, dtype=np.int64) -> np.ndarray:
    """``arr``, an index read from ``where`` (a file, and the dataset or key in it), as
    ``dtype``: one dimension of integers that fit it, or an error naming it (a crafted dtype
    or shape must not reach the arithmetic). Its length is the caller's to check
    (Reader.check_count)."""
    arr = np.asarray(arr)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(
            f"{where}: holds {arr.dtype}{list(arr.shape)}, expected one dimension of integers; "
            f"{REPACK}"
        )
    if arr.dtype == dtype:
        return arr
    info = np.iinfo(dtype)
    if len(arr) and (int(arr.min()) < info.min or int(arr.max()) > info.max):
        raise DataError(f"{where}: holds values beyond {np.dtype(dtype)}; {REPACK}")
    return arr.astype(dtype)


def check_spans(path, starts, ends, limit: int, *, first: int = 0, ordered: bool = False) -> None:
    """Raise a DataError naming ``path`` and the first bad sample unless every span
    ``[starts[j], ends[j])`` (sample ``first + j``) lies inside the ``limit`` bytes there:
    0 <= start <= end <= limit, and each after the one before where ``ordered``. Checked
    before any view is built from them: a view past a map reads other memory, or faults."""
    starts, ends = np.asarray(starts), np.asarray(ends)
    for arr in (starts, ends):
        if arr.dtype.kind not in "iu":
            raise DataError(f"{path}: offsets of dtype {arr.dtype}, expected integers; {REPACK}")
    # a uint64 past int64 turns negative here, and is refused as such
    starts = starts.astype(np.int64, copy=False)
    ends = ends.astype(np.int64, copy=False)
    outside = (starts < 0) | (ends < starts) | (ends > limit)
    before = np.zeros_like(outside)
    if ordered and len(starts) > 1:
        before[1:] = starts[1:] < ends[:-1]
    bad = outside | before
    if bad.any():
        j = int(np.argmax(bad))
        where = (
            f"outside the {int(limit):,} bytes there"
            if outside[j]
            else f"overlapping sample {first + j - 1}, which ends at {int(ends[j - 1]):,}"
        )
        raise DataError(
            f"{path}: sample {first + j} lies at bytes [{int(starts[j]):,}, {int(ends[j]):,}), "
            f"{where}; {REPACK}"
        )


def check_offsets(path, offsets: np.ndarray, limit: int) -> None:
    """An ``[N + 1]`` offsets index (sample j is ``data[offsets[j]:offsets[j + 1]]``):
    non-decreasing, inside the ``limit`` bytes of ``path`` (check_spans)."""
    check_spans(path, offsets[:-1], offsets[1:], limit)


def span_views(data, starts: np.ndarray, ends: np.ndarray) -> list:
    """``data[starts[j]:ends[j]]`` for each j (samples stored as spans of one array): views
    of a map, fresh arrays of an h5py dataset. Sliced by Python ints (numpy's scalars index
    slower)."""
    return [data[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


class Writer:
    """Base of the format writers: assemble committed parts into the final files.

    A writer works inside a fresh output folder and is given the totals up front (the pack
    knows them once every part is committed), so fixed-size containers are allocated once.
    A writer that takes count None (tar, LMDB, mmap's .npy, uncompressed HDF5) is fed each
    part as it is committed (gpufeed.write.assemble.Stream).
    """

    format_name = ""

    def __init__(
        self,
        out: Path,
        spec: SampleSpec | None,
        count: int,
        total_bytes: int,
        options: dict[str, Any],
    ):
        self.out = Path(out)
        self.spec = spec
        self.count = count
        self.total_bytes = total_bytes
        self.options = options

    # the file being written, named when the disk fills up
    current_file: Path | None = None

    def add(self, part: Part) -> None:
        """Write the part's samples. Keeps no view of ``part.payload`` once it returns: a
        gpufeed Writer fills that buffer again with the next part's records."""
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """Close the files; return {"files": [names], "layout": {format details}}."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close what is open after a failed write, quietly (the output is discarded)."""

    def needs_rewrite(self) -> bool:
        """Whether a writer fed as parts were committed must cut the pack again now that
        every part is in (the tar writer: TarWriter.needs_rewrite, then TarWriter.recut, which
        copies the samples' bytes into the default cut; a writer without recut writes the
        pack again from its parts)."""
        return False


def make_room(writer: Writer, names: tuple[str, ...], rows: int) -> None:
    """Grow the writer's per-sample index arrays `names` to hold at least `rows` rows (a
    writer fed as parts are committed does not know its count; it doubles them)."""
    have = len(getattr(writer, names[0]))
    if rows <= have:
        return
    for name in names:
        old = getattr(writer, name)
        grown = np.empty(max(rows, 2 * have), dtype=old.dtype)
        grown[:have] = old
        setattr(writer, name, grown)


class ContiguousWriter(Writer):
    """A writer whose samples go into one preallocated array-like ``self.data`` (an HDF5
    dataset or a numpy memmap): rows of fixed-shape arrays, or encoded bytes back to back with
    an offsets index. Subclasses allocate ``self.data`` and call ``_start_index``.

    Fed as parts are committed (count None: gpufeed.write.assemble.Stream), a subclass sets
    ``self.appended`` instead (formats.appended.AppendedFile): each part's payload is appended
    to that file as it comes, the index grows, and :meth:`placed` says where each sample went
    (the part is then saved without its payload; gpufeed.write.direct reads it back)."""

    appended = None  # an AppendedFile, when fed as parts are committed
    # Part.where's first column for a sample in ``appended`` (tar: the shard, >= 0; LMDB -1):
    # the subclass's, naming its file to gpufeed.write.direct
    place_marker = 0

    def _start_index(self) -> None:
        rows = self.count if self.count is not None else 1024
        if self.spec.kind != "array":
            self.offsets = np.zeros(rows + 1, dtype=np.int64)
        self.labels = np.empty(rows, dtype=np.int64)
        self.crcs = np.empty(rows, dtype=np.uint32)
        self.n = 0
        self.nbytes = 0

    def add(self, part: Part) -> None:
        n = len(part)
        if n == 0:
            return
        lo, hi = self.n, self.n + n
        if self.count is None:
            make_room(self, ("labels", "crcs"), hi)
            if self.spec.kind != "array":
                make_room(self, ("offsets",), hi + 1)
        if self.appended is not None:
            self._append(part)
        elif self.spec.kind == "array":
            self.data[lo:hi] = part.payload.view(self.spec.dtype).reshape(n, *self.spec.shape)
        else:
            size = int(part.offsets[-1])
            self.data[self.nbytes : self.nbytes + size] = part.payload
            self.offsets[lo + 1 : hi + 1] = part.offsets[1:] + self.nbytes
            self.nbytes += size
        self.labels[lo:hi] = part.labels
        self.crcs[lo:hi] = part.crc32
        self.n = hi

    def _append(self, part: Part) -> None:
        """The part's payload at the end of ``appended``, its offsets in the index."""
        n, size = len(part), int(part.offsets[-1])
        if self.spec.kind == "array" and size != n * self.spec.nbytes:
            raise ValueError(
                f"{self.appended.path}: a part of {n} samples holds {size:,} bytes, not "
                f"{n} x {self.spec.nbytes:,} ({self.spec.describe()})"
            )
        self.appended.append(part.payload[:size])
        if self.spec.kind != "array":
            self.offsets[self.n + 1 : self.n + n + 1] = part.offsets[1:] + self.nbytes
        self.nbytes += size

    def placed(self, count: int) -> np.ndarray | None:
        """int64 [count, 3]: the last ``count`` samples' (place_marker, file offset, size)
        rows in ``appended`` (None when not fed as parts are committed)."""
        if self.appended is None:
            return None
        lo = self.n - count
        rows = np.empty((count, 3), dtype=np.int64)
        rows[:, 0] = self.place_marker
        if self.spec.kind == "array":
            rows[:, 2] = self.spec.nbytes
            rows[:, 1] = np.arange(lo, self.n, dtype=np.int64) * self.spec.nbytes
        else:
            rows[:, 1] = self.offsets[lo : self.n]
            rows[:, 2] = np.diff(self.offsets[lo : self.n + 1])
        rows[:, 1] += self.appended.head_size
        return rows

    def trim_index(self) -> None:
        """The index cut to the samples written (it grows ahead when fed part by part)."""
        self.labels, self.crcs = self.labels[: self.n], self.crcs[: self.n]
        if self.spec.kind != "array":
            self.offsets = self.offsets[: self.n + 1]
