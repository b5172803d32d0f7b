"""WebDataset tar shards read in place: an index of member offsets, built on first open and
cached outside the data, then random access like a pack's (os.pread, no tarfile per read).

A sample is WebDataset's: the consecutive members that share a key (the member name up to the
first dot of its file name); each suffix is a field (``jpg``, ``cls``, ``caption.txt``, named
``caption_txt``: field names are identifiers). A field's type comes from its last extension:

  jpg jpeg png webp -> image   cls cls2 index id -> int   txt text -> str   json -> json
  npy -> ragged (dtype and rank of the first sample's array)      anything else -> bytes

The schema holds the suffixes every sample has (others are left out; the manifest's
``layout.dropped`` names them). Labels are the ``cls`` field's, when there is one.

The index (which shard, each field's data offset and size, labels) is written to
``INDEX_DIR/webdataset-<sha256 of the shard paths>.npz``, never beside the shards (they may be
read-only). It is used only for the very files it was built from: keyed by each shard's
identity (device, inode, size, mtime_ns, ctime_ns: a copy with its size and mtime restored,
``cp -p`` or ``rsync -t``, is a new file with a new ctime), checked against the shard sizes at
open, and each member's tar header (type, size, extension) is checked when it is read; a
mismatch is an error naming the shard, never another member's bytes. INDEX_DIR:
``index_dir=``, else $GPUFEED_INDEX_DIR, else ~/.cache/gpufeed/index.

A member that cannot be read as its field (a ``.cls`` beyond int64, a damaged ``.npy``) is an
error naming the shard, sample and member when that sample is read; the folder still opens.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import CorruptSampleError, DataError, NotPackedError, StalePackError
from gpufeed.formats.base import Reader
from gpufeed.formats.files import atomic_write_bytes, file_identity
from gpufeed.formats.inplace.webdataset_index import (
    header_mismatch,
    header_name,
    name_end,
    scan_shard,
)
from gpufeed.formats.npy import parse_header
from gpufeed.formats.record import join_record, npy_shape, stored_from_member
from gpufeed.formats.schema import Field, Schema

__all__ = [
    "WebDatasetReader",
    "cached_index",
    "expand_shards",
    "in_place_identity",
    "index_folder",
    "is_webdataset",
    "load_index",
]

IMAGE_EXT = {"jpg": "jpeg", "jpeg": "jpeg", "png": "png", "webp": "webp"}
INT_EXT = ("cls", "cls2", "index", "id")
STR_EXT = ("txt", "text")
BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")
# field types whose stored bytes are the member's own (stored_from_member returns them as
# given): read as a view of the pread buffer, not copied once more
AS_IS = frozenset({"image", "bytes", "str", "json"})
INT64 = (-(2**63), 2**63 - 1)


def in_place_identity(st: os.stat_result) -> str:
    """What tells data read in place from its replacement: file_identity plus ctime_ns, which
    a copy restoring size and mtime (``cp -p``, ``rsync -t``) cannot set."""
    return repr((*file_identity(st), st.st_ctime_ns))


def index_folder(given: str | os.PathLike | None = None) -> Path:
    """Where in-place indexes are cached (module docstring)."""
    if given:
        return Path(given)
    env = os.environ.get("GPUFEED_INDEX_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpufeed" / "index"


def expand_shards(path: str | os.PathLike) -> list[Path]:
    """A folder of .tar files (sorted), one .tar, or a brace pattern shard-{000..009}.tar."""
    text = os.fspath(path)
    m = BRACES.search(text)
    if m:
        lo, hi = m.group(1), m.group(2)
        width = len(lo)
        return [
            Path(text[: m.start()] + str(i).zfill(width) + text[m.end() :])
            for i in range(int(lo), int(hi) + 1)
        ]
    p = Path(text)
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.suffix == ".tar" and q.is_file())
    return [p]


def is_webdataset(path: str | os.PathLike) -> bool:
    """A .tar file, a brace pattern of them, or a folder holding .tar files (and no pack)."""
    shards = expand_shards(path)
    return bool(shards) and all(s.suffix == ".tar" for s in shards) and shards[0].exists()


def _field_name(suffix: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", suffix)
    return name if name and not name[0].isdigit() else f"f_{name}"


def _field(suffix: str, first_data: bytes) -> Field:
    name, ext = _field_name(suffix), suffix.rsplit(".", 1)[-1].lower()
    if ext in IMAGE_EXT:
        return Field(name, "image", format=IMAGE_EXT[ext])
    if ext in INT_EXT:
        return Field(name, "int")
    if ext in STR_EXT:
        return Field(name, "str")
    if ext == "json":
        return Field(name, "json")
    if ext == "npy":
        shape, _, dtype = _npy_header(first_data)
        return Field(name, "ragged", dtype=dtype.str, shape=(-1,) * len(shape))
    return Field(name, "bytes")


def _npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of a .npy member (ValueError when it is none); a pickled
    (object) dtype is refused, never loaded."""
    head = parse_header(io.BytesIO(data[:65536]))
    if head[2].hasobject:
        raise ValueError(f"a .npy of dtype {head[2]} (Python objects) is not read")
    return head


def _identities(shards: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Each shard's in_place_identity, and its size."""
    ids, sizes = [], []
    for s in shards:
        try:
            st = os.stat(s)
        except FileNotFoundError:
            raise NotPackedError(f"{s}: does not exist") from None
        except OSError as e:
            raise DataError(f"{s}: cannot read the shard: {e.strerror}") from None
        ids.append(in_place_identity(st))
        sizes.append(st.st_size)
    return np.asarray(ids, dtype=str), np.asarray(sizes, dtype=np.int64)


def _build(shards: list[Path]) -> dict[str, Any]:
    per_shard = [scan_shard(s) for s in shards]
    flat = [(k, key, smp) for k, samples in enumerate(per_shard) for key, smp in samples]
    if not flat:
        raise DataError(f"{shards[0].parent}: the tar shards hold no samples")
    common = [s for s in flat[0][2] if all(s in smp for *_, smp in flat)]
    dropped = sorted({s for *_, smp in flat for s in smp} - set(common))
    if not common:
        raise DataError(f"{shards[0]}: no member suffix is in every sample; nothing to read")
    offsets = np.array([[smp[s][0] for s in common] for *_, smp in flat], dtype=np.int64)
    sizes = np.array([[smp[s][1] for s in common] for *_, smp in flat], dtype=np.int64)
    shard = np.array([k for k, _, _ in flat], dtype=np.int32)
    keys = [(shards[k], key) for k, key, _ in flat]
    fields = [
        _schema_field(suffix, keys, offsets[:, j], sizes[:, j]) for j, suffix in enumerate(common)
    ]
    labels = np.full(len(flat), -1, dtype=np.int64)
    if "cls" in common:
        j = common.index("cls")
        for k, path in enumerate(shards):
            with open(path, "rb") as f:
                for i in np.flatnonzero(shard == k).tolist():
                    size = min(int(sizes[i, j]), 64)  # longer is no int64: -1, named on read
                    labels[i] = _label(os.pread(f.fileno(), size, int(offsets[i, j])))
    return {
        "shard": shard,
        "offsets": offsets,
        "sizes": sizes,
        "labels": labels,
        "schema": json.dumps(Schema(tuple(fields)).to_json()),
        "suffixes": json.dumps(common),
        "dropped": json.dumps(dropped),
    }


def _schema_field(suffix: str, keys, offsets: np.ndarray, sizes: np.ndarray) -> Field:
    """The field of a suffix; a .npy's dtype and rank are the first readable member's (one
    that is not is named when its sample is read)."""
    if suffix.rsplit(".", 1)[-1].lower() != "npy":
        return _field(suffix, b"")
    first_error = None
    for i in range(min(len(keys), 100)):
        path, key = keys[i]
        head = _pread(path, min(int(sizes[i]), 65536 + 12), int(offsets[i]))
        try:
            return _field(suffix, head)
        except ValueError as e:
            first_error = first_error or f"{path}: member {key}.{suffix}: {e}"
    raise DataError(
        f"{first_error}; and the next {min(len(keys), 100) - 1} samples' .{suffix} are no "
        ".npy arrays either: the field's dtype cannot be known (rewrite the shards' .npy "
        "members with numpy.save)"
    )


def _label(text: bytes) -> int:
    """A .cls member's class as stored_from_member reads it; -1 (unknown) when it is no
    int64 (reading that sample then names the member)."""
    try:
        value = int(text.strip() or b"x")
    except ValueError:
        return -1
    return value if INT64[0] <= value <= INT64[1] else -1


def _pread(path: Path, size: int, offset: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), size, offset)


def cached_index(path: Path, fresh, build) -> dict[str, Any]:
    """The arrays cached at ``path`` (an .npz) when ``fresh(them)``, else ``build()``'s,
    cached there (atomically; a cache folder that cannot be written is no error: the index
    is built again on each open)."""
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                cached = {k: z[k] for k in z.files}
            if fresh(cached):
                return cached
        except (OSError, ValueError, KeyError):
            pass  # an unreadable cache is rebuilt
    index = build()
    buf = io.BytesIO()
    np.savez(buf, **index)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue(), shared=True)
    except OSError:
        pass
    return index


def index_path(shards: list[Path], where: Path) -> Path:
    """Where the index of these shards is cached."""
    real = [os.path.realpath(s) for s in shards]
    key = hashlib.sha256("\n".join(real).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return where / f"webdataset-{key}.npz"


def load_index(shards: list[Path], where: Path) -> dict[str, Any]:
    """The cached index of these shards, built (and cached) when missing, stale or unfit."""
    identity, shard_bytes = _identities(shards)  # before the scan: a change during it shows
    return cached_index(
        index_path(shards, where),
        lambda cached: _fits(cached, identity, shard_bytes) and _ends_fit(shards, cached),
        lambda: {**_build(shards), "identity": identity, "shard_bytes": shard_bytes},
    )


def _fits(index: dict[str, Any], identity: np.ndarray, shard_bytes: np.ndarray) -> bool:
    """A cached index of exactly these files (their identities), whose arrays agree with each
    other and put every member inside its shard; any other is rebuilt."""
    try:
        if not np.array_equal(index["identity"], identity):
            return False
        shard, offsets, sizes = index["shard"], index["offsets"], index["sizes"]
        width = len(json.loads(str(index["suffixes"])))
        fields = Schema.from_json(json.loads(str(index["schema"]))).fields
        n = len(shard)
        if len(fields) != width or not n or index["labels"].shape != (n,):
            return False
        if offsets.shape != (n, width) or sizes.shape != (n, width):
            return False
        if any(a.dtype.kind not in "iu" for a in (shard, offsets, sizes, index["labels"])):
            return False
        if shard.min() < 0 or shard.max() >= len(shard_bytes):
            return False
        end = shard_bytes[shard][:, None]
        return bool(
            (offsets >= 512).all() and (sizes >= 0).all() and (sizes <= end - offsets).all()
        )
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, DataError):
        return False


def _ends_fit(shards: list[Path], index: dict[str, Any]) -> bool:
    """Each shard's first and last indexed members have the headers the index expects (a
    shard rewritten in place within the ctime's tick keeps its identity)."""
    shard, offsets, sizes = index["shard"], index["offsets"], index["sizes"]
    suffixes = json.loads(str(index["suffixes"]))
    ks, first = np.unique(shard, return_index=True)
    last = len(shard) - 1 - np.unique(shard[::-1], return_index=True)[1]
    for k, i0, i1 in zip(ks.tolist(), first.tolist(), last.tolist(), strict=True):
        try:
            with open(shards[k], "rb") as f:
                for i, j in ((i0, 0), (i1, len(suffixes) - 1)):
                    head = os.pread(f.fileno(), 512, int(offsets[i, j]) - 512)
                    if header_mismatch(head, int(sizes[i, j]), name_end(suffixes[j])):
                        return False
        except OSError:
            return False
    return True


@functools.lru_cache(maxsize=1024)
def _npy_header_of(head: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    return _npy_header(head)


def _npy_mismatch(field: Field, data) -> None:
    """ValueError when a .npy member is not of the field's dtype (the first sample's), or is
    Fortran-ordered: its bytes would be read as other values."""
    try:
        start = npy_shape(data)[1]
    except (ValueError, EOFError, SyntaxError, TypeError) as e:
        raise ValueError(f"not a .npy array: {e}") from None
    shape, fortran, dtype = _npy_header_of(bytes(data[:start]))
    if dtype != np.dtype(field.dtype):
        raise ValueError(f"a .npy of dtype {dtype.str}; the field is {field.dtype}")
    if fortran and len(shape) > 1:
        raise ValueError("a Fortran-ordered .npy; save it C-ordered")


class WebDatasetReader(Reader):
    """Random access into WebDataset shards through the cached index (module docstring)."""

    format_name = "webdataset"
    checksums = False  # WebDataset stores none: verify_crc has nothing to compare

    def __init__(self, path: str | os.PathLike, *, index_dir: str | os.PathLike | None = None):
        shards = expand_shards(path)
        where = index_folder(index_dir)
        index = load_index(shards, where)
        schema = Schema.from_json(json.loads(str(index["schema"])))
        manifest = {
            "format": "webdataset",
            "format_version": 2,
            "count": len(index["shard"]),
            "classes": None,
            "sample": {"kind": "fields", "fields": schema.to_json()},
            "files": {},
            "layout": {
                "shards": [str(s) for s in shards],
                "dropped": json.loads(str(index["dropped"])),
            },
        }
        root = shards[0].parent
        super().__init__(root, manifest)
        self.shards = [str(s) for s in shards]
        self.index_path = index_path(shards, where)
        self.shard = index["shard"]
        self.offsets = index["offsets"]
        self.sizes = index["sizes"]
        self.labels = index["labels"]
        self.suffixes = json.loads(str(index["suffixes"]))
        self.name_ends = [name_end(s) for s in self.suffixes]
        self.crc32 = np.zeros(self.count, dtype=np.uint32)
        self.identity = index["identity"]

    def _open(self):
        return {}

    def _close(self, handle) -> None:
        for fd in handle.values():
            os.close(fd)

    def _fd(self, k: int) -> int:
        fds = self.handle
        if k not in fds:
            fd = os.open(self.shards[k], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if in_place_identity(os.fstat(fd)) != str(self.identity[k]):
                os.close(fd)
                raise StalePackError(
                    f"{self.shards[k]}: changed since it was indexed (a new file, or new "
                    "size, mtime or ctime); open it again"
                )
            fds[k] = fd
        return fds[k]

    def location(self, index: int) -> str:
        return self.shards[int(self.shard[index])]

    def data_files(self) -> list[str]:
        return list(self.shards)

    def member_name(self, index: int, j: int) -> str:
        """The name of the tar member holding field j of sample `index` (for messages)."""
        fd = self._fd(int(self.shard[index]))
        return header_name(os.pread(fd, 512, int(self.offsets[index, j]) - 512))

    def read_batch(self, indices: np.ndarray):
        fields = self.spec.schema.fields
        out = []
        for i in indices.tolist():
            fd = self._fd(int(self.shard[i]))
            out.append(join_record([self._member(fd, i, j, f) for j, f in enumerate(fields)]))
        return out

    def _member(self, fd: int, i: int, j: int, field: Field):
        """Field j of sample i, its tar header checked against the index first."""
        size, offset = int(self.sizes[i, j]), int(self.offsets[i, j])
        buf = os.pread(fd, 512 + size, offset - 512)
        if len(buf) != 512 + size:
            raise CorruptSampleError(self.location(i), i, "shard is truncated")
        head = buf[:512]
        wrong = header_mismatch(head, size, self.name_ends[j])
        if wrong:
            self._forget_index()
            raise StalePackError(
                f"{self.location(i)}: sample {i}, field {field.name!r}: found {wrong} at byte "
                f"{offset - 512:,}, where the index has a {size:,}-byte .{self.suffixes[j]} "
                "member: the shard changed since it was indexed; open it again (the index is "
                "built anew)"
            )
        data = memoryview(buf)[512:] if field.type in AS_IS else buf[512:]
        try:
            if field.type == "ragged":
                _npy_mismatch(field, data)
            return stored_from_member(field, data)
        except ValueError as e:
            raise CorruptSampleError(
                self.location(i), i, f"member {header_name(head)!r} (field {field.name!r}): {e}"
            ) from None

    def _forget_index(self) -> None:
        """The cached index does not describe the shards: the next open builds it anew."""
        try:
            self.index_path.unlink()
        except OSError:
            pass
