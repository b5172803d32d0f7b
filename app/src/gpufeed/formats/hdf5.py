"""HDF5 (h5py): one file, `data.h5`, readable with plain h5py.

Layout (N samples):
  /samples   [N, *shape] dtype   fixed-shape samples (decoded images are uint8 CHW)
  /encoded   [total] uint8       encoded samples (JPEG, PNG, ...) concatenated, and
  /offsets   [N + 1] int64       sample i is encoded[offsets[i]:offsets[i + 1]]
  /labels    [N] int64           class index, -1 when the source had none
  /crc32     [N] uint32          zlib crc32 of each sample's stored bytes
  attributes on /: gpufeed_format_version, sample (JSON), classes (JSON)

Without compression the sample data is stored contiguously, so the reader can map it straight
from the page cache (numpy memmap at the dataset's file offset); with compression
(gzip[:level] or lzf) it is chunked and read through h5py.
"""

from __future__ import annotations

import json
import os
from typing import Any

import h5py
import numpy as np

from gpufeed.errors import DataError, UnsafePathError, UsageError
from gpufeed.formats.appended import (
    STREAMED_HDF5,
    AppendedFile,
    copy_range,
    synced_and_hashed,
)
from gpufeed.formats.base import (
    REPACK,
    ContiguousWriter,
    Reader,
    check_offsets,
    index_array,
    span_views,
)
from gpufeed.formats.mapped import MappedSamples
from gpufeed.formats.spec import SampleSpec
from gpufeed.pagecache.advise import BlocksAhead
from gpufeed.pagecache.copy import take_rows
from gpufeed.pagecache.maps import kept_map

FILE_NAME = "data.h5"
# a streamed pack's files in out/ while it finishes (HDF5Writer): the file of one sample that
# says where HDF5 places the samples' storage, and the file h5py makes whose metadata is
# copied around the samples
PROBE_NAME = "data.h5.probe"
ASIDE_NAME = "data.h5.aside"
CHUNK_BYTES = 1 << 16


def compression_args(compression: str | None) -> dict[str, Any]:
    if not compression or compression == "none":
        return {}
    name, _, level = compression.partition(":")
    if name == "gzip":
        if level and not (level.isdigit() and 1 <= int(level) <= 9):
            raise UsageError(f"gzip level {level!r}: use gzip:1 (fast) to gzip:9 (small)")
        return {
            "compression": "gzip",
            "compression_opts": int(level or 4),
            "shuffle": False,
        }
    if name == "lzf":
        if level:
            raise UsageError("lzf takes no level; use --compression lzf")
        return {"compression": "lzf"}
    raise UsageError(f"unknown HDF5 compression {compression!r}; use none, lzf or gzip[:1-9]")


def plain_dataset(f: h5py.File, name: str, path) -> h5py.Dataset:
    """Dataset ``name`` of ``f`` (the file at ``path``), refused unless its bytes are that
    file's own: HDF5 can keep a dataset's bytes in other files (external raw storage, a
    virtual dataset's sources) or link a name to another file (an external link) or to
    another name (a soft link), and a file from elsewhere must not serve another file's
    bytes as its samples."""
    parts = [p for p in str(name).split("/") if p]
    node: h5py.Group | h5py.Dataset = f
    for i, part in enumerate(parts):
        where = "/" + "/".join(parts[: i + 1])
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise DataError(f"{path}: no dataset {where}")
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise UnsafePathError(path, f"{where} is {kind} ({_link_target(link)}); it is not read")
        node = node[part]
    where = "/" + "/".join(parts)
    if not isinstance(node, h5py.Dataset):
        raise DataError(f"{path}: {where} is not a dataset")
    dcpl = node.id.get_create_plist()
    if dcpl.get_external_count() > 0:
        files = [
            dcpl.get_external(i)[0].decode(errors="replace")
            for i in range(dcpl.get_external_count())
        ]
        raise UnsafePathError(
            path,
            f"dataset {where} keeps its bytes in other files ({', '.join(files)}); it is not read",
        )
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise UnsafePathError(
            path, f"dataset {where} is a virtual dataset over other datasets; it is not read"
        )
    return node


def _link_target(link) -> str:
    if isinstance(link, h5py.ExternalLink):
        return f"to {link.filename}:{link.path}"
    return f"to {link.path}"


class HDF5Writer(ContiguousWriter):
    """Given its count, it writes the samples through h5py into the dataset made for them.

    Fed as parts are committed (count None: a fresh uncompressed pack,
    gpufeed.write.assemble.Stream), it appends them to data.h5 itself from the offset where
    HDF5 places the dataset's storage (found from a probe file made the same way: the
    metadata before it does not depend on the count), the bytes before it left for the
    metadata. When it finishes it makes the file h5py would (the same calls, its storage
    placed by a write of the first row) and copies that file's metadata, before and after
    the storage, around the samples already there: the same file, its samples written once.
    """

    format_name = "hdf5"
    place_marker = STREAMED_HDF5

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self._comp = compression_args(options.get("compression"))
        self.path = self.current_file = self.out / FILE_NAME
        self.spec = spec = spec or SampleSpec("encoded")
        self.f = None
        self.sha256: dict[str, Any] = {}
        if count is None:
            if self._comp:
                raise UsageError("a compressed HDF5 pack is written from its parts, not streamed")
            self.appended = AppendedFile(self.path, bytes(self._storage_offset()))
            self._start_index()
            return
        self.f = h5py.File(self.path, "w", track_order=False)
        if spec.kind == "array":
            self.data = self._samples(count)
        else:
            self.data = self._encoded(total_bytes)
        self._start_index()

    def _storage_offset(self) -> int:
        """Where HDF5 places the samples' storage in data.h5: in a probe file of one sample
        made the way finish makes the file."""
        probe = self.out / PROBE_NAME
        self.current_file = probe
        try:
            row = np.zeros(self.spec.nbytes if self.spec.kind == "array" else 1, np.uint8)
            return self._placed_file(probe, 1, row)
        finally:
            self.f.close()
            self.f = None
            probe.unlink()
            self.current_file = self.path

    def _placed_file(self, path, rows: int, first: np.ndarray | None) -> int | None:
        """``self.f``, a new HDF5 file at ``path`` holding the samples' dataset of ``rows``
        samples (array) or bytes, its storage placed by writing ``first`` (the first
        sample's bytes) as the first row, as the pack made from parts places it at its first
        write; returns the storage's offset (None: no sample)."""
        self.f = h5py.File(path, "w", track_order=False)
        array = self.spec.kind == "array"
        data = self._samples(rows) if array else self._encoded(rows)
        if not rows:
            return None
        data[0:1] = first.view(data.dtype).reshape(data[0:1].shape)
        return data.id.get_offset()

    def _samples(self, count: int) -> h5py.Dataset:
        kw = dict(track_times=False)
        if self._comp:
            rows = max(1, min(count, CHUNK_BYTES // max(1, self.spec.nbytes)))
            kw.update(self._comp, chunks=(max(rows, 1), *self.spec.shape) if count else None)
        shape = (count, *self.spec.shape)
        return self.f.create_dataset("samples", shape=shape, dtype=self.spec.dtype, **kw)

    def _encoded(self, total_bytes: int) -> h5py.Dataset:
        kw = dict(track_times=False)
        if self._comp and total_bytes:
            kw.update(self._comp, chunks=(min(total_bytes, CHUNK_BYTES),))
        return self.f.create_dataset("encoded", shape=(total_bytes,), dtype=np.uint8, **kw)

    def finish(self) -> dict[str, Any]:
        if self.appended is not None:
            self._finish_streamed()
        else:
            assert self.n == self.count, (self.n, self.count)
            self._write_index()
        layout = {
            "file": FILE_NAME,
            "compression": self.options.get("compression") or None,
        }
        if self.spec.kind == "array":
            layout["datasets"] = {
                "samples": "/samples",
                "labels": "/labels",
                "crc32": "/crc32",
            }
        else:
            layout["datasets"] = {
                "encoded": "/encoded",
                "offsets": "/offsets",
                "labels": "/labels",
                "crc32": "/crc32",
            }
        return {"files": [FILE_NAME], "layout": layout, "sha256": dict(self.sha256)}

    def _write_index(self) -> None:
        """The index datasets and attributes written after the samples, the file closed."""
        kw = dict(track_times=False)
        if self.spec.kind != "array":
            self.f.create_dataset("offsets", data=self.offsets, **kw)
        self.f.create_dataset("labels", data=self.labels, **kw)
        self.f.create_dataset("crc32", data=self.crcs, **kw)
        self.f.attrs["gpufeed_format_version"] = self.spec.format_version
        self.f.attrs["sample"] = json.dumps(self.spec.to_json())
        self.f.attrs["classes"] = json.dumps(self.options.get("classes"))
        self.f.close()

    def _finish_streamed(self) -> None:
        """The file h5py makes of these samples, made aside (its storage holds only the
        first row: a sparse file) and closed; its metadata before and after the storage
        copied around the samples already in data.h5, which is cut to its size, then fsynced
        and hashed in a thread (assemble waits for it). A crash at any point leaves the
        samples where the parts say (gpufeed.write.direct)."""
        self.trim_index()
        side, aside = self.appended, self.out / ASIDE_NAME
        array = self.spec.kind == "array"
        rows = self.n if array else self.nbytes
        first = None
        if rows:
            first_size = self.spec.nbytes if array else 1
            first = np.frombuffer(os.pread(side.fd, first_size, side.head_size), np.uint8)
        self.current_file = aside
        offset = self._placed_file(aside, rows, first)
        self._write_index()
        self.current_file = self.path
        fd = os.open(aside, os.O_RDWR)
        try:
            if offset == side.head_size:
                size, end = os.fstat(fd).st_size, offset + self.nbytes
                copy_range(fd, side.fd, offset, 0, 0)
                copy_range(fd, side.fd, size - end, end, end)
                os.ftruncate(side.fd, size)
                os.unlink(aside)
                done, side.fd = side.fd, -1
            else:  # no sample; or (never seen) the storage placed elsewhere: the samples
                # copied into the file made aside, which replaces data.h5 (a crash after it
                # leaves parts whose samples are not where they say: they are redone)
                if offset is not None:
                    copy_range(side.fd, fd, self.nbytes, side.head_size, offset)
                os.replace(aside, self.path)
                side.close()
                done, fd = fd, -1
        finally:
            if fd >= 0:
                os.close(fd)
        self.appended = None
        self.sha256[FILE_NAME] = synced_and_hashed(done, os.fstat(done).st_size)

    def abort(self) -> None:
        if self.appended is not None:
            self.appended.close()
        try:
            if self.f is not None:
                self.f.close()
        except Exception:  # noqa: BLE001 - closing a file whose write failed: it is discarded
            pass


class HDF5Reader(MappedSamples, Reader):
    """Reads data.h5. `use_mmap=None` maps uncompressed sample data directly (fastest);
    False always reads through h5py."""

    format_name = "hdf5"

    def __init__(self, root, manifest, *, use_mmap: bool | None = None, rdcc_mb: int = 64):
        super().__init__(root, manifest)
        self.path = self.file(FILE_NAME, whole=True)
        self.rdcc_nbytes = rdcc_mb << 20
        self.data_name = "samples" if self.spec.kind == "array" else "encoded"
        self.ahead = BlocksAhead()  # blocks of the order populated ahead (read_ahead_ranges)
        try:
            with h5py.File(self.path, "r") as f:
                labels = plain_dataset(f, "labels", self.path)[...]
                crc32 = plain_dataset(f, "crc32", self.path)[...]
                offsets = None
                if self.spec.kind != "array":
                    offsets = plain_dataset(f, "offsets", self.path)[...]
                ds = plain_dataset(f, self.data_name, self.path)
                stored = (ds.dtype, ds.shape)
                offset = ds.id.get_offset()
                contiguous = ds.chunks is None and offset is not None
        except (OSError, KeyError, ValueError, TypeError) as e:  # h5py's do not name the file
            raise DataError(f"{self.path}: cannot read the HDF5 index: {e}") from None
        self.labels = index_array(f"{self.path}: /labels", labels)
        self.crc32 = index_array(f"{self.path}: /crc32", crc32, np.uint32)
        self.offsets = None if offsets is None else index_array(f"{self.path}: /offsets", offsets)
        if use_mmap and not contiguous:
            raise UsageError(f"{self.path}: /{self.data_name} is chunked; it cannot be mapped")
        self.mmap_offset = offset if contiguous and use_mmap is not False else None
        self.check_count("/labels", len(self.labels))
        self.check_count("/crc32", len(self.crc32))
        if self.offsets is not None:
            self.check_count("/offsets", len(self.offsets), self.count + 1)
        self._check_data(*stored)
        if contiguous:
            self._check_mapped(offset)

    def _check_data(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        """The sample dataset is what the manifest says: the samples' dtype and shape, or
        the encoded bytes the offsets index (inside them: base.check_offsets)."""
        if self.offsets is None:
            want_dtype, want_shape = np.dtype(self.spec.dtype), (self.count, *self.spec.shape)
        else:
            want_dtype, want_shape = np.dtype(np.uint8), (int(self.offsets[-1]),)
            if len(shape) == 1:
                check_offsets(f"{self.path}: /offsets", self.offsets, shape[0])
        if dtype != want_dtype or tuple(shape) != want_shape:
            raise DataError(
                f"{self.path}: /{self.data_name} holds {dtype}{list(shape)}, the manifest says "
                f"{want_dtype}{list(want_shape)}; {REPACK}"
            )

    def _check_mapped(self, offset: int) -> None:
        """A contiguous dataset's bytes lie inside the file: it is mapped from there (a map
        past the end of a file is a SIGBUS when touched)."""
        if self.offsets is None:
            need = self.count * self.spec.nbytes
        else:
            need = int(self.offsets[-1])
        size = os.stat(self.path).st_size
        if offset < 0 or offset + need > size:
            raise DataError(
                f"{self.path}: /{self.data_name} lies at bytes [{offset:,}, {offset + need:,}), "
                f"past the file's {size:,} bytes: truncated or crafted (check it with gpufeed "
                "verify, or re-pack it)"
            )

    def _open(self):
        self.check_pinned(FILE_NAME)
        if self.mmap_offset is not None:  # inside the file: _check_mapped
            if self.spec.kind == "array":
                shape, dtype = (self.count, *self.spec.shape), self.spec.dtype
            else:
                shape, dtype = (int(self.offsets[-1]),), np.uint8
            if shape[0] == 0:
                return np.empty(shape, dtype)
            data = kept_map(  # kept for the next reader of this file (pagecache/maps.py)
                self.path,
                self.pinned_identity(FILE_NAME),
                (np.dtype(dtype).str, self.mmap_offset, shape),
                # a plain ndarray over the map: np.memmap's slicing finalizes a memmap per
                # sample (docs/performance/jpeg-decode.md, "The Python per batch")
                lambda: np.memmap(
                    self.path, dtype=dtype, mode="r", offset=self.mmap_offset, shape=shape
                ).view(np.ndarray),
            )
            self.see_cache(self.path, data.ctypes.data)
            return data
        f = h5py.File(self.path, "r", rdcc_nbytes=self.rdcc_nbytes)
        return f[self.data_name]

    def _close(self, handle) -> None:
        self.ahead.drain()  # no thread may read the map once it can be unmapped
        if isinstance(handle, h5py.Dataset):
            handle.file.close()

    def location(self, index: int) -> str:
        return str(self.path)

    def mapped_samples(self) -> np.ndarray | None:
        # a chunked or compressed dataset is read through h5py's cache: nothing to read
        # ahead or look at, and no HDF5 file opened in the process that forks the workers
        return self.handle if self.mmap_offset is not None else None

    def read_batch(self, indices: np.ndarray):
        data = self.handle
        if isinstance(data, np.ndarray):  # a mapped contiguous dataset
            return self.read_mapped(data, indices)
        if self.spec.kind == "array":
            out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
            _h5_take(data, indices, out)
            return out
        # h5py slices are fresh arrays
        return span_views(data, self.offsets[indices], self.offsets[indices + 1])


def _h5_take(ds: h5py.Dataset, indices: np.ndarray, out: np.ndarray) -> None:
    """out[j] = ds[indices[j]] with one h5py read: a slice when the indices are dense, else
    one fancy selection of the sorted unique indices (h5py needs increasing indices)."""
    if len(indices) == 0:
        return
    uniq, inverse = np.unique(indices, return_inverse=True)
    lo, hi = int(uniq[0]), int(uniq[-1]) + 1
    if hi - lo <= 2 * len(uniq):
        block = ds[lo:hi]
        take_rows(block, indices - lo, out)
    elif len(uniq) == len(indices) and np.array_equal(uniq, indices):
        ds.read_direct(out, source_sel=np.s_[uniq])
    else:
        take_rows(ds[uniq], inverse.reshape(-1), out)
