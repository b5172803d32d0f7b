"""Pieces every format shares: errors, the sample spec, checksums, staged parts, atomic files.

The formats layer knows numpy and the storage libraries, never torch: readers hand back numpy
arrays (fixed-shape samples) or byte buffers (encoded samples) and the datasets layer turns them
into tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import mmap
import os
import stat
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST_NAME = "manifest.json"
SOURCES_NAME = "sources.txt"
PARTIAL_SUFFIX = ".partial"
FORMAT_VERSION = 1


class GpufeedError(Exception):
    """Base of the errors gpufeed reports as one clear line."""

    exit_code = 1


class UsageError(GpufeedError):
    """The call itself is wrong (bad option, existing destination): exit code 2."""

    exit_code = 2


class DataError(GpufeedError):
    """The data is wrong (unreadable source file, corrupt record, failed verification)."""


class SourceError(DataError):
    """A source file could not be read or decoded while packing."""


class CorruptSampleError(DataError):
    """A stored sample does not match its checksum or does not decode."""

    def __init__(
        self, path: str | os.PathLike, index: int, problem: str, source: str | None = None
    ):
        self.path = str(path)
        self.index = int(index)
        self.problem = problem
        self.source = source
        where = f"sample {self.index}" + (f" (source {source})" if source else "")
        super().__init__(f"{self.path}: {where}: {problem}")


class NotPackedError(DataError):
    """The path is not a finished gpufeed dataset (no manifest, or a partial pack)."""


class DiskFullError(DataError):
    """A write ran out of space (or quota): names the file and what is free where."""

    def __init__(self, path: str | os.PathLike, need: int | None = None):
        self.path = str(path)
        free = free_bytes(self.path)
        needed = f" (needs about {need:,} more bytes)" if need else ""
        super().__init__(
            f"{self.path}: no space left on device{needed}; {free:,} bytes free there. "
            "Free some space (or pack to another disk); completed parts are kept, "
            "continue with --resume"
        )


class StalePackError(DataError):
    """A pack's files were replaced or changed after a reader of it was opened."""


# --------------------------------------------------------------------------- disk space
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or its
    nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def is_disk_full(exc: BaseException, path: str | os.PathLike, need: int = 0) -> bool:
    """Whether a failed write ran out of space. errno says so for plain writes and HDF5; for
    errors without one (LMDB reports ENOSPC as "Input/output error", torch.save as "file
    write failed") the free space left where `path` lives decides (under `need` bytes, or
    under 1 MiB)."""
    code = getattr(exc, "errno", None)
    if code in _NO_SPACE or "No space left on device" in str(exc):
        return True
    if code is not None and code != errno.EIO:
        return False
    try:
        return free_bytes(path) < max(int(need), 1 << 20)
    except OSError:
        return False


def preallocate(f, nbytes: int, path: str | os.PathLike) -> None:
    """Reserve `nbytes` for open file `f` before it is written through a memory map (or by a
    library that cannot report ENOSPC cleanly): a full disk is then this DiskFullError, not
    a SIGBUS or a half-written file. Filesystems without fallocate are left to report
    ENOSPC on write."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(f.fileno(), 0, int(nbytes))
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise DiskFullError(path, nbytes) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


@contextlib.contextmanager
def no_space_is_an_error(path: str | os.PathLike, need: int = 0) -> Iterator[None]:
    """Turn running out of space while writing `path` into DiskFullError naming it."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - narrowed by is_disk_full, re-raised otherwise
        if isinstance(e, (OSError, RuntimeError)) and is_disk_full(e, path, need):
            raise DiskFullError(path, need or None) from None
        raise


# --------------------------------------------------------------------------- pack files
class UnsafePathError(DataError):
    """A manifest names a path that leaves the pack, or something that is not a regular file."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{self.path}: {reason}")


def pack_file(root: str | os.PathLike, name: str) -> Path:
    """root/name for a file a manifest names, refusing names that leave the pack (absolute,
    "..", a symlink out of it) and anything but a regular file: a reader never follows a
    manifest out of the pack or opens a device or FIFO. A missing file is returned (its
    reader reports it when it opens it)."""
    root = Path(root)
    path = root / str(name)
    parts = str(name).split("/")
    if os.path.isabs(name) or ".." in parts:
        raise UnsafePathError(path, "leads outside the pack; it is not read")
    if any(part in ("", ".") for part in parts):
        raise UnsafePathError(path, "is not a plain file name inside the pack; it is not read")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if "/" in name or stat.S_ISLNK(st.st_mode):  # a link on the way: where does it lead?
        real, top = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise UnsafePathError(path, f"leads outside the pack (to {real}); it is not read")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return path
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(path, "is not a regular file (a pack holds regular files only)")
    return path


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from its replacement: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class SampleSpec:
    """What one stored sample is.

    kind "array": every sample is an array of `dtype` and `shape` (decoded images are uint8 CHW).
    kind "encoded": every sample is an encoded file's bytes (JPEG, PNG, ...), decoded on read.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        if self.kind != "array":
            raise ValueError("encoded samples have no fixed size")
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_json(self) -> dict[str, Any]:
        if self.kind == "array":
            return {"kind": "array", "dtype": self.dtype, "shape": list(self.shape)}
        return {"kind": "encoded"}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SampleSpec:
        if d["kind"] == "array":
            return cls("array", str(d["dtype"]), tuple(int(x) for x in d["shape"]))
        return cls("encoded")


def crc32(buf) -> int:
    """zlib crc32 of a bytes-like object or a C-contiguous array."""
    return zlib.crc32(buf) & 0xFFFFFFFF


def row_crcs(batch: np.ndarray) -> np.ndarray:
    """crc32 of each row of a C-contiguous [N, ...] array."""
    out = np.empty(len(batch), dtype=np.uint32)
    for j in range(len(batch)):
        out[j] = zlib.crc32(batch[j])
    return out


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def read_sources(path: Path) -> list[str]:
    """sources.txt: one source path per line, "\\n" only (names holding a newline are refused
    when packing); names that are not UTF-8 are kept byte for byte (surrogateescape)."""
    lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def write_sources(path: Path, names: Iterable[str]) -> None:
    with open(path, "wb") as f:
        for name in names:
            f.write(name.encode("utf-8", "surrogateescape") + b"\n")


def file_entry(root: Path, name: str) -> dict[str, Any]:
    p = root / name
    return {"bytes": p.stat().st_size, "sha256": sha256_file(p)}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with no_space_is_an_error(path, len(data)), open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def npy_bytes(arr: np.ndarray) -> bytes:
    """An array as the bytes of a .npy file (what np.save would write)."""
    import io

    b = io.BytesIO()
    np.save(b, np.ascontiguousarray(arr), allow_pickle=False)
    return b.getvalue()


def npy_from_bytes(data) -> np.ndarray:
    import io

    return np.load(io.BytesIO(bytes(data)), allow_pickle=False)


@dataclass
class Part:
    """A committed slice of the pack: samples read from a fixed range of source items.

    payload is every accepted sample's bytes concatenated; sample j is
    payload[offsets[j]:offsets[j+1]]. Array samples are stored as raw C-order bytes.
    """

    payload: np.ndarray  # uint8 [total]
    offsets: np.ndarray  # int64 [n+1]
    labels: np.ndarray  # int64 [n]
    crc32: np.ndarray  # uint32 [n]
    items: np.ndarray  # int64 [n] source item index of each sample
    exts: np.ndarray  # str [n] file extension to use for the sample (tar member names)
    skip_items: np.ndarray  # int64 [k]
    skip_errors: np.ndarray  # str [k]
    spec: SampleSpec | None  # None when every item in the part was skipped
    # int64 [items in the part's range, 2]: each source file's size and mtime_ns when read
    # (-1 when it could not be stat'ed): a resume re-reads a part whose files changed since
    stamps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, j: int) -> memoryview:
        return memoryview(self.payload)[self.offsets[j] : self.offsets[j + 1]]

    def arrays(self) -> dict[str, np.ndarray]:
        spec = self.spec.to_json() if self.spec else None
        arrays = {
            name: getattr(self, name)
            for name in (
                "payload",
                "offsets",
                "labels",
                "crc32",
                "items",
                "exts",
                "skip_items",
                "skip_errors",
            )
        }
        arrays["spec"] = np.array(json.dumps(spec))
        if self.stamps is not None:
            arrays["stamps"] = self.stamps
        return arrays

    def save(self, path: Path) -> None:
        """Write, fsync, rename. The space is reserved first (the arrays' bytes plus room for
        the zip and .npy headers), so a full disk is one DiskFullError naming the part."""
        tmp = path.with_name(path.name + ".tmp")
        arrays = self.arrays()
        room = sum(a.nbytes for a in arrays.values()) + 4096 * len(arrays)
        with no_space_is_an_error(tmp, room), open(tmp, "wb") as f:
            preallocate(f, room, tmp)
            np.savez(f, **arrays)
            f.truncate(f.tell())  # give back what the headers did not use
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path) -> Part:
        with np.load(path, allow_pickle=False) as z:
            spec = json.loads(str(z["spec"]))
            return cls(
                payload=z["payload"],
                offsets=z["offsets"],
                labels=z["labels"],
                crc32=z["crc32"],
                items=z["items"],
                exts=z["exts"],
                skip_items=z["skip_items"],
                skip_errors=z["skip_errors"],
                spec=SampleSpec.from_json(spec) if spec else None,
                stamps=z["stamps"] if "stamps" in z.files else None,
            )


def as_index_array(indices: Sequence[int] | np.ndarray, count: int, path: str) -> np.ndarray:
    """Indices as int64, negatives wrapped, range checked with an error naming the dataset."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < -count or idx.max() >= count):
        bad = int(idx[(idx < -count) | (idx >= count)][0])
        raise IndexError(f"{path}: sample {bad} out of range for {count} samples")
    return np.where(idx < 0, idx + count, idx)


# Samples at least this big are asked for ahead (madvise WILLNEED) before a batch is copied out
# of a mapped file: cold, the kernel then reads the whole batch with many requests in flight
# instead of one page fault (and its read-around) at a time. Smaller samples are left to
# readahead: for them the call costs more than it saves.
PREFETCH_MIN_BYTES = 64 << 10
_MADV_WILLNEED = 3


@functools.lru_cache(maxsize=1)
def _madvise():
    if not hasattr(mmap, "MADV_WILLNEED"):  # not Linux/BSD: nothing to ask for
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def is_run(indices: np.ndarray) -> bool:
    """Two or more consecutive indices in increasing order (what sequential epochs read)."""
    n = len(indices)
    return (
        n > 1
        and int(indices[-1]) - int(indices[0]) == n - 1
        and bool(np.all(np.diff(indices) == 1))
    )


def take_rows(data: np.ndarray, indices: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[j] = data[indices[j]]. numpy's default mode="raise" copies through a buffer when
    given ``out`` (twice the copying: 3x slower for 432 KiB rows); the indices were
    range-checked by as_index_array, so "clip" never clips here."""
    return np.take(data, indices, axis=0, out=out, mode="clip")


def advise_willneed(regions: Iterable[tuple[int, int]]) -> None:
    """Start reading (address, length) ranges of memory-mapped files into the page cache.

    A hint only: it returns at once (the reads complete in the background) and failures are
    ignored, since the copy that follows faults the pages in anyway.
    """
    fn = _madvise()
    if fn is None:
        return
    page = mmap.PAGESIZE
    for addr, length in regions:
        start = addr - addr % page
        fn(start, length + (addr - start), _MADV_WILLNEED)


def advise_rows(data: np.ndarray, indices: np.ndarray) -> None:
    """WILLNEED for rows ``indices`` of a C-contiguous mapped array, when rows are large."""
    row = data.strides[0] if data.ndim else 0
    if row < PREFETCH_MIN_BYTES or not data.flags.c_contiguous or len(indices) < 2:
        return
    base = data.ctypes.data
    advise_willneed((base + int(i) * row, row) for i in np.sort(indices))


def advise_samples(data: np.ndarray, offsets: np.ndarray | None, indices: np.ndarray) -> None:
    """WILLNEED for samples ``indices`` of a mapped array: rows of fixed-shape samples
    (``offsets`` None), else the encoded spans ``data[offsets[i]:offsets[i + 1]]``."""
    if offsets is None:
        advise_rows(data, indices)
    else:
        advise_buffers([data[offsets[i] : offsets[i + 1]] for i in indices])


def advise_buffers(buffers: Sequence, sizes: Sequence[int] | None = None) -> None:
    """WILLNEED for buffers that point into a mapped file (LMDB values, memmap slices)."""
    if len(buffers) < 2:
        return
    if sizes is None:
        sizes = list(map(len, buffers))
    if sum(sizes) < PREFETCH_MIN_BYTES * len(sizes):
        return
    advise_willneed(
        (np.frombuffer(b, dtype=np.uint8).ctypes.data, n)
        for b, n in zip(buffers, sizes, strict=True)
        if n
    )


class Reader:
    """Base of the format readers.

    A reader is plain configuration plus numpy index arrays (labels, crc32, offsets) until it
    reads: the storage handle is opened on first use in the process that reads, reopened when
    the pid changes (a forked DataLoader worker), and dropped when pickled (a spawned worker).
    """

    format_name = ""

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
        whole=True: the file is read or mapped whole, so it must exist and hold at least the
        bytes the manifest records (a truncated file mapped by LMDB or numpy is a SIGBUS
        when touched; checked here, it is an error naming the file. A file grown or edited
        in place is left to the per-sample checks and to verify)."""
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

    def check_pinned(self, name: str, st: os.stat_result | None = None) -> None:
        """Raise StalePackError when file `name` is no longer the one this reader pinned."""
        want = self._pinned.get(name)
        if want is None:
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
        """One sample: a numpy array (kind "array") or a bytes-like object (kind "encoded")."""
        batch = self.read_batch(np.array([index], dtype=np.int64))
        return batch[0]

    def read_batch(self, indices: np.ndarray):
        """Samples at `indices` (int64, in range): one [B, ...] array or a list of buffers."""
        raise NotImplementedError

    def prefetch(self, indices: np.ndarray) -> None:
        """Start reading samples ``indices`` into the page cache without waiting (a hint:
        formats that cannot say where a sample lies do nothing)."""

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


class Writer:
    """Base of the format writers: assemble committed parts into the final files.

    A writer works inside a fresh output folder and is given the totals up front (the pack
    knows them once every part is committed), so fixed-size containers are allocated once.
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
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """Close the files; return {"files": [names], "layout": {format details}}."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close what is open after a failed write, quietly (the output is discarded)."""


class ContiguousWriter(Writer):
    """A writer whose samples go into one preallocated array-like ``self.data`` (an HDF5
    dataset or a numpy memmap): rows of fixed-shape arrays, or encoded bytes back to back with
    an offsets index. Subclasses allocate ``self.data`` and call ``_start_index``."""

    def _start_index(self) -> None:
        if self.spec.kind != "array":
            self.offsets = np.zeros(self.count + 1, dtype=np.int64)
        self.labels = np.empty(self.count, dtype=np.int64)
        self.crcs = np.empty(self.count, dtype=np.uint32)
        self.n = 0
        self.nbytes = 0

    def add(self, part: Part) -> None:
        n = len(part)
        if n == 0:
            return
        lo, hi = self.n, self.n + n
        if self.spec.kind == "array":
            self.data[lo:hi] = part.payload.view(self.spec.dtype).reshape(n, *self.spec.shape)
        else:
            size = int(part.offsets[-1])
            self.data[self.nbytes : self.nbytes + size] = part.payload
            self.offsets[lo + 1 : hi + 1] = part.offsets[1:] + self.nbytes
            self.nbytes += size
        self.labels[lo:hi] = part.labels
        self.crcs[lo:hi] = part.crc32
        self.n = hi
