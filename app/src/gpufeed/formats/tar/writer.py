"""Writing tar shards (the layout: gpufeed.formats.tar.reader's docstring)."""

from __future__ import annotations

import hashlib
import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from gpufeed.formats.base import Writer, make_room
from gpufeed.formats.files import fsync_dir
from gpufeed.formats.npy import npy_bytes
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec
from gpufeed.formats.tar.fields import PartMembers
from gpufeed.formats.tar.members import BLOCK, KEY_FORMAT

INDEX_NAME = "index.npz"
SHARD_FORMAT = "shard-{:06d}.tar"
RECORD = 20 * BLOCK
# a multi-field pack's samples are assembled and written in runs of about this many bytes
RUN_BYTES = 8 << 20
# shard_size and shard_bytes when not given: see default_shard_size. Bytes as MosaicML
# Streaming's size_limit and LitData's chunk_bytes: a remote shard is fetched whole before its
# first sample is read, by each worker for its own shard
DEFAULT_SHARD_SIZE = 10_000
DEFAULT_SHARD_BYTES = 64 << 20
# a small pack is still cut into this many shards (each rank's workers get one to stream)...
MIN_SHARDS = 16
# ...of no fewer samples than this
MIN_SHARD_SIZE = 64


def shard_pattern(n: int) -> str:
    if n <= 1:
        return SHARD_FORMAT.format(0)
    return f"shard-{{{0:06d}..{n - 1:06d}}}.tar"


def default_shard_size(count: int | None) -> int:
    """Samples per shard when shard_size is not given: DEFAULT_SHARD_SIZE, and for a pack of
    fewer than MIN_SHARDS x that many samples, count / MIN_SHARDS (rounded up; at least
    MIN_SHARD_SIZE), so that a small pack is still MIN_SHARDS shards to share among ranks and
    workers. shard_bytes (default DEFAULT_SHARD_BYTES) bounds every shard as well; an explicit
    shard_size or shard_bytes replaces its default. count None (not known yet): the default."""
    if count is None:
        return DEFAULT_SHARD_SIZE
    return min(DEFAULT_SHARD_SIZE, max(MIN_SHARD_SIZE, -(-count // MIN_SHARDS)))


def npy_header(spec: SampleSpec) -> bytes:
    full = npy_bytes(np.zeros(spec.shape, dtype=spec.dtype))
    return full[: len(full) - spec.nbytes]


class TarWriter(Writer):
    """Splits samples into shards of at most `shard_size` samples and `shard_bytes` bytes
    (defaults: default_shard_size). Fed as parts are committed (count None), it cuts for the
    source's item count (options["items"]) when it has one, else for DEFAULT_SHARD_SIZE; see
    needs_rewrite."""

    format_name = "tar"

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self.spec = spec or SampleSpec("encoded")
        self.chosen = bool(options.get("shard_size"))  # the user's: kept whatever the count
        self.max_count = int(options.get("shard_size") or 0) or default_shard_size(
            count if count is not None else options.get("items")
        )
        self.max_bytes = int(options.get("shard_bytes") or DEFAULT_SHARD_BYTES)
        self.header = npy_header(self.spec) if self.spec.kind == "array" else b""
        # the index, one row per sample; count None (a pack streamed as its parts are
        # committed, gpufeed.write.assemble): rows are added as samples come
        rows = count if count is not None else 1024
        self.shard = np.empty(rows, dtype=np.int32)
        self.offset = np.empty(rows, dtype=np.int64)
        self.size = np.empty(rows, dtype=np.int64)
        self.labels = np.empty(rows, dtype=np.int64)
        self.crcs = np.empty(rows, dtype=np.uint32)
        self.names: list[str] = []
        self.f = None
        # each shard's sha256, made from the bytes as they are written (the manifest's, without
        # reading the shards back at the end, when the pack's workers are done)
        self.hash = None
        self.digests: dict[str, str] = {}
        # a finished shard is fsynced and closed in a thread while the next one is written;
        # finish() waits for them all (before the index and the manifest)
        self._syncer: ThreadPoolExecutor | None = None
        self._synced: list[Future] = []
        self.in_shard = 0
        self.pos = 0
        self.n = 0

    def _start_shard(self) -> None:
        self._end_shard()
        name = SHARD_FORMAT.format(len(self.names))
        self.names.append(name)
        self.current_file = self.out / name
        self.f = open(self.current_file, "wb")
        self.hash = hashlib.sha256()
        self.in_shard = 0
        self.pos = 0

    def _write(self, buf: np.ndarray) -> None:
        """A run's bytes at the shard's end, by os.write from the buffer (no copy through the
        file object); a short write (a signal, a pipe-like file system) is finished."""
        self.f.flush()
        fd, rest = self.f.fileno(), memoryview(buf)
        self.hash.update(rest)
        while rest:
            rest = rest[os.write(fd, rest) :]

    def _end_shard(self) -> None:
        if self.f is None:
            return
        end = self.pos + 2 * BLOCK
        trailer = b"\0" * (2 * BLOCK + (-end) % RECORD)
        self.f.write(trailer)
        self.hash.update(trailer)
        self.digests[self.names[-1]] = self.hash.hexdigest()
        self.f.flush()
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-fsync")
        self._synced.append(self._syncer.submit(_sync_close, self.f))
        self.f = None

    def _wait_synced(self) -> None:
        """Every finished shard fsynced and closed (the first error raised)."""
        synced, self._synced = self._synced, []
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        for job in synced:
            job.result()

    _INDEX = ("shard", "offset", "size", "labels", "crcs")

    def add(self, part: Part) -> None:
        if not len(part):  # a part of skipped items only: no member to write
            return
        make_room(self, self._INDEX, self.n + len(part))
        first = self.n
        if self.spec.kind == "fields":
            members = PartMembers.of_fields(self.spec.schema, part)
            # what a sample may need in a shard (the rule every multi-field pack was cut by)
            needs = np.diff(part.offsets) + 1280 * len(members.suffixes)
            self._add_runs(members, needs, spans=True)
        else:  # KEY.npy or KEY.EXT, then KEY.cls; a run of samples of one extension at a time
            exts = part.exts if self.spec.kind == "encoded" else np.full(len(part), "npy")
            cuts = [0, *(np.flatnonzero(exts[1:] != exts[:-1]) + 1).tolist(), len(part)]
            for a, b in itertools.pairwise(cuts):
                members = PartMembers.of_samples(part, a, b, str(exts[a]), self.header)
                self._add_runs(members, members.sample_bytes, spans=False)
        self.labels[first : self.n] = part.labels
        self.crcs[first : self.n] = part.crc32

    def placed(self, count: int) -> np.ndarray:
        """int64 [count, 3]: the last ``count`` samples' (shard, offset, size) rows."""
        rows = slice(self.n - count, self.n)
        return np.stack([self.shard[rows], self.offset[rows], self.size[rows]], axis=1).astype(
            np.int64
        )

    def _full(self, need: int, pos: int, count: int) -> bool:
        """Whether a sample needing `need` bytes after `count` samples up to `pos` in a
        shard starts a new one."""
        return count >= self.max_count or (count > 0 and pos + need + 2 * BLOCK > self.max_bytes)

    def _index(self, starts, sizes, count: int = 1) -> None:
        """The next `count` index rows: samples of the current shard."""
        rows = slice(self.n, self.n + count)
        self.shard[rows], self.offset[rows], self.size[rows] = len(self.names) - 1, starts, sizes
        self.n += count
        self.in_shard += count

    def _add_runs(self, members: PartMembers, needs: np.ndarray, spans: bool) -> None:
        """A part's samples written a run at a time (gpufeed.formats.tar.fields), each run
        inside one shard. Index rows: with ``spans`` (multi-field samples) the first member's
        header and the bytes to the end of the last member's data (what the reader parses);
        else the first member's data past ``self.header`` and the sample's own bytes."""
        needs, grown = needs.tolist(), members.sample_bytes.tolist()
        j, n = 0, len(needs)
        while j < n:
            if self.f is None or self._full(needs[j], self.pos, self.in_shard):
                self._start_shard()
            a, pos, count, j = j, self.pos + grown[j], self.in_shard + 1, j + 1
            while j < n and pos - self.pos < RUN_BYTES and not self._full(needs[j], pos, count):
                pos, count, j = pos + grown[j], count + 1, j + 1
            buf, data = members.build(a, j, self.n)
            if spans:
                last = data[:, -1] + members.sizes[a:j, -1]
                self._index(self.pos + data[:, 0] - BLOCK, last - data[:, 0] + BLOCK, j - a)
            else:
                self._index(
                    self.pos + data[:, 0] + len(self.header), members.fields[0].lens[a:j], j - a
                )
            self.pos += len(buf)
            self._write(buf)

    def needs_rewrite(self) -> bool:
        """Whether the shards written differ from the default cut for the count written (a
        writer fed as parts are committed chose its shard size before the count was known:
        a Writer's samples, skipped sources); the pack is then written again from its parts
        (gpufeed.write.assemble), so a pack's bytes never depend on how it was made. Only
        a shard that reached either size can have been cut differently."""
        want = default_shard_size(self.n)
        if self.chosen or want == self.max_count:
            return False
        most = np.bincount(self.shard[: self.n], minlength=1).max()
        return bool(most >= min(want, self.max_count))

    def finish(self) -> dict[str, Any]:
        assert self.count is None or self.n == self.count
        for name in self._INDEX:
            setattr(self, name, getattr(self, name)[: self.n])
        if self.f is None and not self.names:
            self._start_shard()  # an empty dataset is still one valid (empty) tar
        self._end_shard()
        self._wait_synced()
        self.current_file = self.out / INDEX_NAME
        with open(self.current_file, "wb") as f:
            np.savez(
                f,
                shard=self.shard,
                offset=self.offset,
                size=self.size,
                labels=self.labels,
                crc32=self.crcs,
            )
        fsync_dir(self.out)
        counts = np.bincount(self.shard, minlength=len(self.names)).tolist()
        layout = {
            "pattern": shard_pattern(len(self.names)),
            "shards": self.names,
            "shard_counts": counts,
            "key_format": KEY_FORMAT,
            "shard_size": self.max_count,
            "shard_bytes": self.max_bytes,
        }
        files = sorted([*self.names, INDEX_NAME])
        return {"files": files, "layout": layout, "sha256": dict(self.digests)}

    def abort(self) -> None:
        try:
            self._wait_synced()
        except OSError:  # the output is discarded
            pass
        if self.f is not None:
            try:
                self.f.close()
            except OSError:  # the flush of a shard whose write failed: it is discarded
                pass
            self.f = None


def _sync_close(f) -> None:
    try:
        os.fsync(f.fileno())
    finally:
        f.close()
