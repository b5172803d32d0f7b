"""Writing tar shards (the layout: gpufeed.formats.tar.reader's docstring)."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import DataError
from gpufeed.formats.base import Writer, make_room
from gpufeed.formats.files import fsync_dir, kernel_copy
from gpufeed.formats.npy import npy_bytes
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec
from gpufeed.formats.tar.fields import PartMembers, Scratch
from gpufeed.formats.tar.hashing import ShardHasher
from gpufeed.formats.tar.members import BLOCK, KEY_FORMAT

INDEX_NAME = "index.npz"
SHARD_FORMAT = "shard-{:06d}.tar"
RECORD = 20 * BLOCK
# a multi-field pack's samples are assembled and written in runs of about this many bytes
# (and a re-cut pack's shards copied in blocks of as many: TarWriter.recut)
RUN_BYTES = 8 << 20
# ...and of at most this many samples (the run's end is found a window of them at a time)
RUN_SAMPLES = 8192
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
    needs_rewrite and recut."""

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
        # each sample's bytes in a shard, and the bytes the cut rule reserves for it (_full):
        # what recut cuts again by, without the samples
        self.grown = np.empty(rows, dtype=np.int64)
        self.needs = np.empty(rows, dtype=np.int64)
        self.names: list[str] = []
        self.f = None
        # each shard's sha256, made from the bytes as they are written (the manifest's, without
        # reading the shards back at the end, when the pack's workers are done), in a thread
        self._hasher = ShardHasher()
        self.digests: dict[str, Future] = {}
        # a finished shard is fsynced and closed in a thread while the next one is written;
        # finish() waits for them all (before the index and the manifest)
        self._syncer: ThreadPoolExecutor | None = None
        self._synced: list[Future] = []
        self.in_shard = 0
        self.pos = 0
        self.n = 0
        self._scratch = Scratch()  # the buffers runs are built in (fields.Scratch)
        self._hasher.deferred = self._may_recut()

    def _start_shard(self) -> None:
        self._end_shard()
        name = SHARD_FORMAT.format(len(self.names))
        self.names.append(name)
        self.current_file = self.out / name
        self.f = open(self.current_file, "wb")
        self._hasher.start()
        self.in_shard = 0
        self.pos = 0

    def _write(self, buf: np.ndarray) -> None:
        """A run's bytes at the shard's end, by os.write from the buffer (no copy through the
        file object; a short write, for a signal or a pipe-like file system, is finished),
        hashed meanwhile in the hasher's thread (the buffer held until it is: Scratch.hold).
        Written before this returns: a committed part names only bytes in the shards."""
        self.f.flush()
        self._scratch.hold(self._hasher.update(buf))
        fd, rest = self.f.fileno(), memoryview(buf)
        while rest:
            rest = rest[os.write(fd, rest) :]

    def _end_shard(self) -> None:
        if self.f is None:
            return
        end = self.pos + 2 * BLOCK
        trailer = b"\0" * (2 * BLOCK + (-end) % RECORD)
        self.f.write(trailer)
        self._hasher.update(trailer)
        if not self._hasher.deferred:
            self.digests[self.names[-1]] = self._hasher.digest()
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
    _CUT = ("grown", "needs")

    def add(self, part: Part) -> None:
        if not len(part):  # a part of skipped items only: no member to write
            return
        make_room(self, self._INDEX + self._CUT, self.n + len(part))
        first = self.n
        if self.spec.kind == "fields":
            members = PartMembers.of_fields(self.spec.schema, part, self._scratch)
            # what a sample may need in a shard (the rule every multi-field pack was cut by)
            needs = np.diff(part.offsets) + 1280 * len(members.suffixes)
            self._add_runs(members, needs, spans=True)
        else:  # KEY.npy or KEY.EXT, then KEY.cls; a run of samples of one extension at a time
            exts = part.exts if self.spec.kind == "encoded" else np.full(len(part), "npy")
            cuts = [0, *(np.flatnonzero(exts[1:] != exts[:-1]) + 1).tolist(), len(part)]
            for a, b in itertools.pairwise(cuts):
                ext = str(exts[a])
                members = PartMembers.of_samples(part, a, b, ext, self.header, self._scratch)
                self._add_runs(members, members.sample_bytes, spans=False)
        self.labels[first : self.n] = part.labels
        self.crcs[first : self.n] = part.crc32
        if self._hasher.deferred and not self._may_recut():
            self._catch_up()

    def _may_recut(self) -> bool:
        """Whether needs_rewrite may yet say so at the end (the shards are then hashed as
        they are cut again, not now: hashing.ShardHasher.deferred): a streamed pack, cut
        for a shard size that the count so far does not yet give."""
        return (
            not self.chosen and self.count is None and default_shard_size(self.n) < self.max_count
        )

    def _catch_up(self) -> None:
        """Hashing no longer deferred: the shards written meanwhile hashed from their files
        (in the hasher's thread), the one being written from its bytes so far."""
        for name in self.names[:-1] if self.f is not None else self.names:
            if name not in self.digests:
                self.digests[name] = self._hasher.file_digest(self.out / name)
        if self.f is not None:
            self.f.flush()
            self._hasher.resume(self.current_file, self.pos)
        else:
            self._hasher.deferred = False

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
        rows = slice(self.n, self.n + len(needs))
        grown = members.sample_bytes
        self.grown[rows], self.needs[rows] = grown, needs
        a, n = 0, len(needs)
        while a < n:
            if self.f is None or self._full(int(needs[a]), self.pos, self.in_shard):
                self._start_shard()
            b = self._run_end(a, needs, grown)
            buf, data = members.build(a, b, self.n)
            if spans:
                last = data[:, -1] + members.sizes[a:b, -1]
                self._index(self.pos + data[:, 0] - BLOCK, last - data[:, 0] + BLOCK, b - a)
            else:
                self._index(
                    self.pos + data[:, 0] + len(self.header), members.fields[0].lens[a:b], b - a
                )
            self.pos += len(buf)
            self._write(buf)
            a = b

    def _run_end(self, a: int, needs: np.ndarray, grown: np.ndarray) -> int:
        """The end of the run from sample ``a`` (which fits the current shard): the first
        sample after it that the shard is full for (_full, for all at once) or that starts
        RUN_BYTES past it; a run ends sooner only where it is long in samples (where a run
        ends moves no byte: it is one write)."""
        b = min(len(needs), a + RUN_SAMPLES)
        size = grown[a:b]
        pos = self.pos + np.cumsum(size) - size  # where each sample would start
        count = self.in_shard + np.arange(b - a)
        stop = (pos - self.pos >= RUN_BYTES) | (count >= self.max_count)
        stop |= (count > 0) & (pos + needs[a:b] + 2 * BLOCK > self.max_bytes)
        stop[0] = False
        first = int(stop.argmax())
        return a + first if stop[first] else b

    def needs_rewrite(self) -> bool:
        """Whether the shards written differ from the default cut for the count written (a
        writer fed as parts are committed chose its shard size before the count was known:
        a Writer's samples, skipped sources); the shards are then cut again (recut), so a
        pack's bytes never depend on how it was made. Only a shard that reached either size
        can have been cut differently."""
        want = default_shard_size(self.n)
        if self.chosen or want == self.max_count:
            return False
        most = np.bincount(self.shard[: self.n], minlength=1).max()
        return bool(most >= min(want, self.max_count))

    def end_shards(self) -> None:
        """Every shard written so far closed as it is (the last without its end blocks), for
        recut to read: the caller moves them aside first (gpufeed.write.assemble.Stream)."""
        f, self.f = self.f, None
        if f is not None:
            f.close()  # read back at once: not fsynced (the old cut is the parts' until the end)
        self._wait_synced()

    def recut(self, written: Path) -> None:
        """The shards in ``written`` (end_shards) written again into self.out, cut by
        default_shard_size for the count written: the bytes a writer that knew the count
        writes. A sample's members depend on its key (its index in the pack), not on its
        shard, so each new shard is byte ranges of the old ones, copied (no sample read back
        or encoded again), then the end blocks; the index rows move with their samples, and
        each shard's sha256 is made as it is written (_write)."""
        self.names, self.digests = [], {}
        self._hasher.deferred = False
        # two blocks in turn: one is hashed in the hasher's thread while the next is copied
        blocks = [[memoryview(np.empty(RUN_BYTES, np.uint8)), None] for _ in range(2)]
        fds: dict[int, int] = {}
        try:
            for new, old, start, end in self._recut_index():
                if new == len(self.names):
                    self._start_shard()
                if old not in fds:
                    fds[old] = os.open(written / SHARD_FORMAT.format(old), os.O_RDONLY)
                self._copy(fds[old], start, end, blocks, written / SHARD_FORMAT.format(old))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _recut_index(self) -> list[tuple[int, int, int, int]]:
        """The index rows moved to the default cut for the count written; returns the copies
        that make its shards, in order: (new shard, old shard, start, end), a run of samples
        of one new shard and one old shard each (their bytes one range of the old shard)."""
        n = self.n
        if not n:
            return []
        grown, old = self.grown[:n], self.shard[:n].copy()
        self.max_count = default_shard_size(n)
        new = self._cut(self.needs[:n].tolist(), grown.tolist())
        before = np.cumsum(grown) - grown  # each sample's start, were the shards one file
        old_start = _in_shard(before, old)
        self.offset[:n] += _in_shard(before, new) - old_start
        self.shard[:n] = new
        firsts = np.flatnonzero(np.r_[True, (old[1:] != old[:-1]) | (new[1:] != new[:-1])])
        lasts = np.r_[firsts[1:], n] - 1
        ends = old_start[lasts] + grown[lasts]
        runs = np.stack([new[firsts], old[firsts], old_start[firsts], ends], axis=1)
        return runs.tolist()

    def _copy(self, fd: int, start: int, end: int, blocks: list, name: Path) -> None:
        """Bytes start..end of the old shard ``name`` at the end of the shard being written:
        read for the sha256 (hashed in the hasher's thread: ``blocks``, [buffer, its job]
        pairs, used in turn, a buffer's job waited for before it is read into again), and
        copied by the kernel (_put)."""
        self.f.flush()
        out = self.f.fileno()
        while start < end:
            blocks.append(held := blocks.pop(0))
            block, job = held
            if job is not None:
                job.result()
            got = os.preadv(fd, [block[: min(len(block), end - start)]], start)
            if got <= 0:
                raise DataError(f"{name}: ends at byte {start:,}, before its samples' {end:,}")
            held[1] = self._hasher.update(block[:got])
            _put(fd, out, block[:got], start)
            self.pos += got
            start += got

    def _cut(self, needs: list[int], grown: list[int]) -> np.ndarray:
        """Each sample's shard in the cut _add_runs makes of these samples (its rule, _full,
        sample by sample)."""
        shard = np.empty(len(needs), dtype=np.int32)
        s, pos, count = -1, 0, 0
        for i, (need, size) in enumerate(zip(needs, grown, strict=True)):
            if s < 0 or self._full(need, pos, count):
                s, pos, count = s + 1, 0, 0
            shard[i] = s
            pos, count = pos + size, count + 1
        return shard

    def finish(self) -> dict[str, Any]:
        assert self.count is None or self.n == self.count
        for name in self._INDEX:
            setattr(self, name, getattr(self, name)[: self.n])
        if self.f is None and not self.names:
            self._start_shard()  # an empty dataset is still one valid (empty) tar
        if self._hasher.deferred:  # not cut again after all (needs_rewrite)
            self._catch_up()
        self._end_shard()
        self._wait_synced()
        digests = {name: job.result() for name, job in self.digests.items()}
        self._hasher.close()
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
        return {"files": files, "layout": layout, "sha256": digests}

    def abort(self) -> None:
        try:
            self._wait_synced()
        except OSError:  # the output is discarded
            pass
        self._hasher.close()
        if self.f is not None:
            try:
                self.f.close()
            except OSError:  # the flush of a shard whose write failed: it is discarded
                pass
            self.f = None


def _in_shard(before: np.ndarray, shard: np.ndarray) -> np.ndarray:
    """Each sample's start in its shard, from its start were the shards one file (a shard's
    samples in order, every shard holding one)."""
    first = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
    return before - before[first][shard]


def _put(fd: int, out: int, data: memoryview, start: int) -> None:
    """``data``, read from ``fd`` at ``start``, appended to ``out``: by the kernel where the
    system and file system can (files.kernel_copy: closing a Writer's pack of 100k JPEGs took
    1.0 s of CPU so, 2.4 s writing them from the buffer; 2-CPU dev VM), the rest written
    from ``data``."""
    rest = data[kernel_copy(fd, out, len(data), start) :]
    while rest:
        rest = rest[os.write(out, rest) :]


def _sync_close(f) -> None:
    try:
        os.fsync(f.fileno())
    finally:
        f.close()
