"""The tar format's reader (the layout: gpufeed.formats.tar)."""

from __future__ import annotations

import bisect
import functools
import mmap
import os

import numpy as np

from gpufeed.errors import CorruptSampleError, DataError
from gpufeed.formats.base import Reader
from gpufeed.formats.manifest import MANIFEST_NAME
from gpufeed.formats.npy import read_npz_vectors
from gpufeed.formats.record import record_from_members
from gpufeed.formats.tar.index import INDEX_ARRAYS, check_index
from gpufeed.formats.tar.rows import gather_rows, shard_rows, shard_strides
from gpufeed.formats.tar.writer import (
    INDEX_NAME,
)
from gpufeed.pagecache.advise import (
    READ_AHEAD_MIN_BYTES,
    WARM_PROBES,
    BlocksAhead,
    advise_willneed,
    ask_unless_cached,
    is_run,
    looks_cached,
    looks_warm,
)
from gpufeed.pagecache.maps import kept_map
from gpufeed.pagecache.probe import file_cached, mincore_sees


class ShardMaps(dict):
    """A local pack's shard maps (shard -> its map), kept across readers in a process, and
    where each lies: ``at``, (address, size, shard) sorted by address (see
    TarReader._shard_cached)."""

    def __init__(self):
        super().__init__()
        self.at: list[tuple[int, int, int]] = []


class TarReader(Reader):
    """Random and sequential access to the shards through index.npz (os.pread, no tarfile)."""

    format_name = "tar"

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        layout = manifest["layout"]
        self.shards: list[str] = list(layout["shards"])
        for name in self.shards:
            self.file(name)  # inside the pack, a regular file; pinned
        index = self.file(INDEX_NAME, whole=True)
        self.shard, self.offset, self.size, self.labels, self.crc32 = read_npz_vectors(
            index, INDEX_ARRAYS, self.count
        )
        # as int64 (a uint64 past 2**63 turns negative: check_index refuses it)
        self.offset, self.size, self.labels = (
            a.astype(np.int64, copy=False) for a in (self.offset, self.size, self.labels)
        )
        counts = self._shard_counts()
        check_index(index, self.shard, self.offset, self.size, counts, self._declared_bytes())
        self.shard_start = np.concatenate([[0], np.cumsum(counts)])
        self.ahead = BlocksAhead()  # a stream's next runs populated ahead (read_runs_ahead)

    def _shard_counts(self) -> np.ndarray:
        """The manifest's samples a shard, checked: one a shard, none negative, adding up to
        the count."""
        where = self.root / MANIFEST_NAME
        try:
            counts = np.asarray(self.manifest["layout"]["shard_counts"], dtype=np.int64)
        except (KeyError, TypeError, ValueError, OverflowError):
            counts = None
        if counts is None or counts.ndim != 1 or (counts < 0).any():
            raise DataError(f"{where}: layout shard_counts is not a list of sample counts")
        self.check_count("layout shard_counts", len(counts), len(self.shards))
        self.check_count("the shards (shard_counts)", counts.sum())
        return counts

    def _declared_bytes(self) -> np.ndarray:
        """Each shard's size as the manifest records it (what a fetched copy is checked
        against), else as found here: what check_index holds the index to. A shard found
        shorter is left to the reads, which check their ends against its map."""
        files = self.manifest.get("files")
        files = files if isinstance(files, dict) else {}
        sizes = []
        for name in self.shards:
            entry = files.get(name)
            recorded = entry.get("bytes") if isinstance(entry, dict) else None
            if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 0:
                sizes.append(recorded)
                continue
            found = self.pinned_identity(name) if self.source is None else None
            sizes.append(found[2] if found else 0)  # file_identity's size
        return np.asarray(sizes, dtype=np.int64)

    def _open(self):
        if self.source is not None:
            return {}
        # a local pack's shard maps, kept across readers in this process (one entry a pack,
        # told apart by every shard's identity): a warm pass finds their pages mapped
        identity = tuple(self.pinned_identity(name) for name in self.shards)
        # one owner and mount for a pack's shards: where mincore cannot see the first one,
        # blocks are told cached by asking the shard's file (pagecache.file_cached)
        blind = bool(self.shards) and not mincore_sees(self.root / self.shards[0])
        self.tell_cached_by(self._shard_cached if blind else None)
        return {"maps": kept_map(self.root / INDEX_NAME, identity, "tar shards", ShardMaps)}

    @functools.cached_property
    def strides(self) -> np.ndarray | None:
        """Each shard's stride between samples when a local pack's fixed-shape samples sit
        at one (formats/tar/rows.py), else None: samples are then read one by one."""
        if self.spec.kind != "array" or self.source is not None:
            return None
        return shard_strides(self.shard, self.offset, self.size, self.shard_start, self.spec.nbytes)

    def _rows(self, shard: int) -> np.ndarray | None:
        """The shard's samples as a strided [count, nbytes] view of its map (see strides)."""
        views = self.handle.setdefault("rows", {})
        if shard not in views:
            first, stop = self.shard_range(shard)
            views[shard] = shard_rows(
                self._map(shard),
                int(self.offset[first]),
                stop - first,
                int(self.strides[shard]),
                self.spec.nbytes,
                self.location(first),
            )
        return views[shard]

    def read_rows(self, indices: np.ndarray) -> np.ndarray | None:
        """Fixed-shape samples in any order gathered from the shards' maps, one fancy index
        per shard (a new array); None where the pack's layout does not allow it (strides
        None, a truncated shard): read_batch then reads them one by one."""
        if self.strides is None:
            return None
        shards = self.shard[indices]
        rows = indices - self.shard_start[shards]
        flat = gather_rows(self._rows, shards, rows, self.spec.nbytes)
        if flat is None:
            return None
        return flat.view(self.spec.dtype).reshape(len(indices), *self.spec.shape)

    def _close(self, handle) -> None:
        self.ahead.drain()  # no thread may read a map once it can be unmapped
        handle.pop("rows", None)
        handle.pop("maps", None)  # memory maps close when the last view of them is gone
        for shard in handle.pop("remote", []):
            self.release_file(self.shards[shard])
        for fd in handle.values():
            os.close(fd)

    def _shard_path(self, shard: int):
        """The shard's file to open; for a remote pack, its cached copy, and the shards least
        recently opened are closed and unpinned (so the cache can evict them: a sample
        already read from one stays valid) past the pack's pin budget (storage: a share of
        cache_limit; only the shard read now may exceed it), so that a cache epoch that fits
        reopens none and a small cache_limit is never filled by shards held open."""
        if self.source is None:
            return self.root / self.shards[shard]
        opened = self.handle.setdefault("remote", [])
        if shard in opened:
            opened.remove(shard)
        opened.append(shard)
        budget = self.source.pin_budget()
        while len(opened) > 1 and self._shard_bytes(opened) > budget:
            old = opened.pop(0)
            self.handle.get("maps", {}).pop(old, None)
            fd = self.handle.pop(old, None)
            if fd is not None:
                os.close(fd)
            self.release_file(self.shards[old])
        return self.local_path(self.shards[shard])

    def _shard_bytes(self, shards: list[int]) -> int:
        """The bytes of these shards' samples (what their files hold, less the header of
        the first member and the end blocks)."""
        return int(self._shard_nbytes[shards].sum())

    @functools.cached_property
    def _shard_nbytes(self) -> np.ndarray:
        """Each shard's sample bytes (see _shard_bytes), derived from the index once: the
        pin budget sums them on every shard a remote pack opens."""
        first, end = self.shard_start[:-1], self.shard_start[1:]
        nbytes = np.zeros(len(self.shards), dtype=np.int64)
        full = end > first
        last = end[full] - 1
        nbytes[full] = self.offset[last] + self.size[last] - self.offset[first[full]]
        return nbytes

    def _fd(self, shard: int) -> int:
        fds = self.handle
        fd = fds.get(shard)
        if fd is None:
            # O_NONBLOCK: what replaced a shard since might be a FIFO; fstat tells before a read
            flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(self._shard_path(shard), flags)
            try:
                self.check_pinned(self.shards[shard], os.fstat(fd))
            except BaseException:
                os.close(fd)
                raise
            fds[shard] = fd
        return fd

    def location(self, index: int) -> str:
        return str(self.root / self.shards[int(self.shard[index])])

    def shard_range(self, shard: int) -> tuple[int, int]:
        return int(self.shard_start[shard]), int(self.shard_start[shard + 1])

    def read_ahead(self, indices: np.ndarray) -> None:
        if self.source is not None:  # a remote pack: fetch the shards to come into the cache
            # in the order they will be read (np.unique would sort them)
            shards = dict.fromkeys(self.shard[indices].tolist())
            self.source.warm([self.shards[s] for s in shards])
            return
        if not hasattr(os, "posix_fadvise"):  # macOS
            return
        for i in indices.tolist():
            if self.size[i] >= READ_AHEAD_MIN_BYTES:
                os.posix_fadvise(
                    self._fd(int(self.shard[i])),
                    int(self.offset[i]),
                    int(self.size[i]),
                    os.POSIX_FADV_WILLNEED,
                )

    @property
    def reads_ranges_ahead(self) -> bool:
        """Blocks of a map-style order read ahead, as the mmap reader's, where samples are
        read as rows (see strides)."""
        return self.strides is not None

    def looks_warm(self) -> bool:
        """Whether the samples of up to WARM_PROBES shards spread over the pack look cached
        (readahead.looks_warm over their spans in the shards' maps, made here if need be: a
        pack of thousands of shards maps a sample of them, not all)."""
        if self.source is not None or not self.reads_ranges_ahead or not self.shards:
            return False
        n = len(self.shards)
        picked = np.unique(np.linspace(0, n - 1, min(n, WARM_PROBES)).astype(np.int64))
        ranges = [self.shard_range(int(s)) for s in picked]
        spans = [self._span(first, stop) for first, stop in ranges if stop > first]
        return looks_warm(spans, self.cached)

    def read_ahead_ranges(self, ranges) -> None:
        """Each block's span in its first sample's shard populated on the read-ahead
        threads (BlocksAhead, as the mmap reader's blocks); the rest of a block that runs
        into the next shard asked for (WILLNEED)."""
        if self.strides is None:
            return
        ranges = [(int(a), min(int(b), self.count)) for a, b in ranges]
        spans, rest = [], []
        for a, b in ranges:
            if b <= a:
                continue
            stop = self._shard_end(a, b)
            spans.append((a, *self._span(a, stop)))
            while stop < b:  # the block's samples in the shards after (small shards)
                rest.append(self._span(stop, self._shard_end(stop, b)))
                stop = self._shard_end(stop, b)
        self.ahead.announce_blocks(ranges, spans)
        advise_willneed(rest)

    def _shard_end(self, first: int, stop: int) -> int:
        """The end of samples first..stop-1 that lie in first's shard."""
        return min(stop, int(self.shard_start[self.shard[first] + 1]))

    def _span(self, first: int, stop: int) -> tuple[int, int]:
        """(address, length) of samples first..stop-1 in their shard's map (one shard;
        clipped to the map)."""
        data = self._map(int(self.shard[first]))
        start = int(self.offset[first])
        end = min(start + self.run_bytes(first, stop), len(data))
        return data.ctypes.data + start, max(0, end - start)

    def run_bytes(self, first: int, stop: int) -> int:
        """The bytes one read of samples first..stop-1 (one shard) spans."""
        return int(self.offset[stop - 1] + self.size[stop - 1] - self.offset[first])

    def read_runs_ahead(self, runs) -> None:
        """Start populating runs ``[first, stop)`` of samples (each in one shard) on the
        read-ahead threads, to be read by ``read_batch`` in that order: a stream knows its
        order, so the disk works on the next runs while this one is used. Runs that look
        cached are skipped; a remote pack's shards are fetched ahead instead (their maps
        close when they are unpinned, see _shard_path)."""
        if self.source is not None:
            return
        spans = ((int(first), *self._span(first, stop)) for first, stop in runs)
        self.ahead.announce(spans, mapped=True)  # read next, in order: kept mapped

    def _run_in_one_shard(self, indices: np.ndarray) -> bool:
        """Consecutive samples of one shard (what streaming reads): one read covers them."""
        return is_run(indices) and self.shard[indices[0]] == self.shard[indices[-1]]

    def _map(self, shard: int) -> np.ndarray:
        maps = self.handle.setdefault("maps", {})
        data = maps.get(shard)
        if data is None:
            # the shard's fd (opened and checked by _fd), mapped read-only: np.memmap would
            # open it again and resolve its path, paid each time a remote pack reopens a
            # shard (past its pin budget, see _shard_path; docs/performance/tar-stream.md)
            fd = self._fd(shard)
            size = os.fstat(fd).st_size
            view = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
            data = maps[shard] = np.frombuffer(view, dtype=np.uint8)
            if size and isinstance(maps, ShardMaps):
                bisect.insort(maps.at, (data.ctypes.data, size, shard))
        return data

    def _shard_cached(self, addr: int, length: int) -> bool:
        """Whether a range of a shard's map is cached, asked of the shard's file (mincore
        cannot see it): the map holding ``addr`` found among those this process made."""
        at = getattr(self.handle.get("maps"), "at", ())
        i = bisect.bisect_right(at, (addr, float("inf"))) - 1
        if i < 0 or addr >= at[i][0] + at[i][1]:
            return looks_cached(addr, length)
        start, _, shard = at[i]
        return file_cached(self._fd(shard), addr - start, length)

    def _read_run(self, first: int, last: int):
        """Samples first..last (one shard) as one span of the shard's memory map: (the span,
        each sample's offset in it). No copy here: whoever keeps a sample copies it once,
        from the page cache (a pread per member costs a system call each; a pread of the
        run, a second copy). The span is asked for (WILLNEED) at once unless it looks
        cached, so a cold run is read ahead in the background while earlier samples are
        used."""
        start = int(self.offset[first])
        end = int(self.offset[last] + self.size[last])
        data = self._map(int(self.shard[first]))
        if end > len(data):
            short = int(
                np.searchsorted(
                    self.offset[first : last + 1] + self.size[first : last + 1],
                    len(data),
                    side="right",
                )
            )
            i = first + short
            raise CorruptSampleError(self.location(i), i, "shard is truncated")
        span = data[start:end]
        self.ahead.ready_blocks([first])  # read ahead: resident once its thread is done
        ask_unless_cached(span.ctypes.data, end - start, self.cached)
        return span, self.offset[first : last + 1] - start

    def read_batch(self, indices: np.ndarray):
        pieces = self._shard_runs(indices)
        if len(pieces) > 1:  # consecutive samples across shards: one read per shard
            parts = [self.read_batch(piece) for piece in pieces]
            if self.spec.kind in ("fields", "encoded"):
                return [sample for part in parts for sample in part]
            return np.concatenate(parts)
        run = self._run_in_one_shard(indices)
        if self.spec.kind == "fields":
            records = []
            for i, span in zip(indices.tolist(), self._spans(indices, run), strict=True):
                try:
                    records.append(record_from_members(self.spec.schema, span))
                except ValueError as e:
                    raise CorruptSampleError(self.location(i), i, str(e)) from None
            return records
        if self.spec.kind == "encoded":
            return self._spans(indices, run)
        if run:
            return self._rows_of_run(indices)
        self.ahead.ready(indices)  # blocks read ahead (read_ahead_ranges): resident first
        rows = self.read_rows(indices)
        if rows is not None:
            return rows
        out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
        flat = out.reshape(len(indices), -1).view(np.uint8)
        width = self.spec.nbytes
        fds, fd_of = self.handle, self._fd  # the live table: a shard closed since reopens
        for j, (i, shard, offset, size) in enumerate(self._index_rows(indices)):
            if size != width:
                raise CorruptSampleError(self.location(i), i, "index size differs from spec")
            fd = fds.get(shard)
            if os.preadv(fd_of(shard) if fd is None else fd, [flat[j]], offset) != width:
                raise CorruptSampleError(self.location(i), i, "shard is truncated")
        return out

    def _index_rows(self, indices: np.ndarray):
        """(index, shard, offset, size) of each sample, the index read once for the batch
        (numpy scalars one at a time cost more)."""
        return zip(
            indices.tolist(),
            self.shard[indices].tolist(),
            self.offset[indices].tolist(),
            self.size[indices].tolist(),
            strict=True,
        )

    def _shard_runs(self, indices: np.ndarray) -> list[np.ndarray]:
        """A batch of consecutive samples split where the shard changes (each piece is read
        as one run); any other batch as it is."""
        if len(indices) < 2 or not is_run(indices):
            return [indices]
        cuts = np.flatnonzero(np.diff(self.shard[indices])) + 1
        return np.split(indices, cuts) if len(cuts) else [indices]

    def _spans(self, indices: np.ndarray, run: bool) -> list[bytes]:
        """Each sample's stored bytes (its span in the shard), one read for a run."""
        if run:
            span, rel = self._read_run(int(indices[0]), int(indices[-1]))
            view = memoryview(span)
            sizes = self.size[indices].tolist()
            return [bytes(view[o : o + n]) for o, n in zip(rel.tolist(), sizes, strict=True)]
        out, fds, fd_of, pread = [], self.handle, self._fd, os.pread
        for i, shard, offset, size in self._index_rows(indices):
            fd = fds.get(shard)
            data = pread(fd_of(shard) if fd is None else fd, size, offset)
            if len(data) != size:
                raise CorruptSampleError(self.location(i), i, "shard is truncated")
            out.append(data)
        return out

    def _rows_of_run(self, indices: np.ndarray) -> np.ndarray:
        width = self.spec.nbytes
        bad = np.flatnonzero(self.size[indices] != width)
        if len(bad):
            i = int(indices[bad[0]])
            raise CorruptSampleError(self.location(i), i, "index size differs from spec")
        raw, rel = self._read_run(int(indices[0]), int(indices[-1]))
        steps = np.diff(rel)
        flat = None
        if len(steps) and np.all(steps == steps[0]) and rel[0] == 0:
            # same-size members sit at a fixed stride: the rows are one strided view
            # (read-only, over the map: whoever keeps a sample copies it once)
            where = self.location(int(indices[0]))
            flat = shard_rows(raw, 0, len(indices), int(steps[0]), width, where)
        if flat is None:
            flat = np.empty((len(indices), width), dtype=np.uint8)
            for j, o in enumerate(rel.tolist()):
                flat[j] = raw[o : o + width]
        return flat.view(self.spec.dtype).reshape(len(indices), *self.spec.shape)
