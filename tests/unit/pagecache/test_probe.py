"""Reading ahead a pack whose page cache this process cannot see: for a file it neither owns
nor may write, mincore answers "every page resident" (mm/mincore.c, can_do_mincore), so a
cold pack looks warm. Our containers run as a non-root user over a read-only dataset mount,
where that is the common case: the readers then ask for their blocks without looking."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from unit_sources import evict, resident_share, write_arrays

import gpufeed
from gpufeed.formats.open import open_reader
from gpufeed.pagecache import advise as readahead
from gpufeed.pagecache import probe as pagecache
from gpufeed.pagecache.advise import BlocksAhead, advise_rows
from gpufeed.pagecache.probe import FileProbe, cache_probe, mincore_sees

NOBODY = 65534


@pytest.fixture()
def open_tmp():
    """A folder another user may enter (pytest's own are 0700)."""
    path = tempfile.mkdtemp(prefix="gpufeed-blind-", dir="/tmp")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_mincore_sees_files_this_process_owns_or_may_write(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    owner = os.stat(path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner)
    assert mincore_sees(path)
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    assert not mincore_sees(path)
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # writable: the kernel tells
    assert mincore_sees(path)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    assert mincore_sees(path)  # root: CAP_FOWNER
    assert mincore_sees(tmp_path / "missing")  # nothing known to be wrong


def test_blocks_ahead_ask_the_readers_probe_not_mincore(monkeypatch):
    submitted = []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: True)  # mincore: "all cached"

    def work(addr, length):
        return submitted.append(addr)

    monkeypatch.setattr(readahead, "populate", work)
    monkeypatch.setattr(readahead, "ask", work)  # the threads' jobs
    data = np.zeros((16, 8), np.uint8)
    seeing = BlocksAhead(threads=1)
    seeing.announce_ranges(data, None, [(0, 4), (4, 8)])
    assert seeing.pending() == 0  # looks cached: a warm pass wakes no thread
    probed = BlocksAhead(threads=1)
    probed.cached = lambda addr, length: addr == data.ctypes.data  # block 0 cached only
    probed.announce_ranges(data, None, [(0, 4), (4, 8)])
    assert probed.pending() == 1
    probed.ready(np.arange(8))
    assert submitted == [data.ctypes.data + 32]
    probed.drain()


def test_large_rows_ask_the_readers_probe_not_mincore(monkeypatch):
    advised = []
    monkeypatch.setattr(readahead, "looks_cached", lambda *_: True)
    monkeypatch.setattr(readahead, "advise_willneed", lambda regions: advised.extend(regions))
    data = np.zeros((4, readahead.READ_AHEAD_MIN_BYTES), np.uint8)
    advise_rows(data, np.array([2, 0]))
    assert advised == []
    advise_rows(data, np.array([2, 0]), cached=lambda *_: False)
    assert [addr for addr, _ in advised] == [data.ctypes.data, data[2].ctypes.data]


def test_a_file_probe_tells_cached_pages_from_cold_ones_and_reads_nothing(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(np.arange(4 << 20, dtype=np.uint8).tobytes())
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 4096, 1 << 20)  # one page of the second MiB, no read-around
    finally:
        os.close(fd)
    if resident_share(path, 0, 1 << 20) > 0:
        pytest.skip(f"{tmp_path}: cannot evict files here (tmpfs?)")
    base = 1 << 40  # a made-up map address: file offset = address - base
    probe = FileProbe(path, -base)
    assert probe(base + (1 << 20), 4096)
    assert not probe(base, 4096)
    assert not probe(base + (1 << 20), 8192)  # its last page is cold
    assert resident_share(path, 0, 1 << 20) < 0.05  # asking read nothing in (a page or two at most)
    probe.close()


def test_cache_probe_places_the_map_by_proc_self_maps(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * 4096))
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), 2 * 4096, offset=4096, prot=mmap.PROT_READ) as m,
    ):
        view = np.frombuffer(m, np.uint8)
        addr = view.ctypes.data
        assert cache_probe(path, addr) is None  # ours: mincore sees it
        monkeypatch.setattr(pagecache, "mincore_sees", lambda p: False)
        probe = cache_probe(path, addr + 10)
        assert probe is not None and probe.delta == 4096 - addr  # file offset 4096 at addr
        del view


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "mmap"])
def test_every_mapped_reader_probes_a_file_mincore_cannot_see(tmp_path, fmt, monkeypatch):
    write_arrays(tmp_path / "src", {"x": 8, "y": 8}, shape=(3, 16, 16), seed=4)
    gpufeed.pack(tmp_path / "src", tmp_path / fmt, format=fmt, workers=1, quiet=True)
    reader = open_reader(tmp_path / fmt)
    want = reader.read_batch(np.array([3, 1]))
    assert reader.cached is None  # the test's own files: mincore sees them
    monkeypatch.setattr(pagecache, "mincore_sees", lambda p: False)
    reader = open_reader(tmp_path / fmt)
    got = reader.read_batch(np.array([3, 1]))
    assert isinstance(reader.cached, FileProbe)
    assert getattr(reader.ahead, "cached", reader.cached) is reader.cached  # LMDB: no blocks
    assert reader.cached(*_first_sample(reader, got))  # just read: cached, by the file
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    reader.close()
    assert reader.cached._fd is None


def _first_sample(reader, batch) -> tuple[int, int]:
    """(address, length) of a sample in the reader's map."""
    if reader.format_name == "lmdb":
        env = reader.handle
        if reader._placed is not None:  # read by the value table, from the reader's own map
            (value,) = reader._placed.views(np.array([3]))
            return readahead.address(value), len(value)
        with env.begin(buffers=True) as txn:
            value = txn.get(b"%010d" % 3)
            return readahead.address(value), len(value)
    data = reader.handle
    return data[3].ctypes.data, data[3].nbytes


def evicted_pack(folder: Path, fmt: str, per_class: int, seed: int) -> Path:
    """A root pack of 2 x ``per_class`` samples of 12 KiB in ``folder``, out of the page
    cache (the test is skipped where files cannot be evicted, tmpfs)."""
    write_arrays(folder / "src", {"x": per_class, "y": per_class}, shape=(3, 64, 64), seed=seed)
    dest = folder / fmt
    gpufeed.pack(folder / "src", dest, format=fmt, workers=1, quiet=True)
    if not evict(dest):
        pytest.skip(f"{folder}: cannot evict files here (tmpfs?)")
    return dest


def as_nobody(work) -> bytes:
    """``work()``'s bytes, run in a forked child that became nobody (who may not write root's
    0644 files); empty when the child failed (its error on stderr)."""
    read, wrote = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(wrote, work())
            code = 0
        except BaseException as e:  # noqa: BLE001 - told to the parent through the exit code
            os.write(2, f"child: {e!r}\n".encode())
        finally:
            os._exit(code)
    os.close(wrote)
    _, status = os.waitpid(pid, 0)
    told = os.read(read, 8)
    os.close(read)
    return told if status == 0 else b""


def _block_range(dest, fmt: str, block: tuple[int, int]) -> tuple[object, int, int]:
    """(file, offset, length) that samples ``block`` occupy, as root reads the pack's index."""
    reader = open_reader(dest)
    first, last = block[0], block[1] - 1
    if fmt == "tar":
        assert reader.shard[first] == reader.shard[last]
        start = int(reader.offset[first])
        end = int(reader.offset[last] + reader.size[last])
        return dest / reader.shards[int(reader.shard[first])], start, end - start
    samples = dest / "samples.npy"
    row = reader.spec.nbytes
    header = os.path.getsize(samples) - reader.count * row
    return samples, header + first * row, (last + 1 - first) * row


@pytest.mark.skipif(
    not hasattr(os, "fork") or os.geteuid() != 0, reason="needs root to become another user"
)
@pytest.mark.parametrize("fmt", ["mmap", "tar"])
def test_a_non_owner_reads_a_cold_pack_ahead(open_tmp, fmt):
    """The real thing: root packs, a child that became nobody reads the pack shuffled by
    blocks; the blocks it announced are in the page cache afterwards (root's mincore), not
    skipped because nobody's mincore called them cached (its probe said they were not)."""
    dest = evicted_pack(open_tmp, fmt, 1024, seed=6)  # 24 MiB
    block = (1984, 2048)  # the last 768 KiB: far past any read-around of the open
    path, offset, length = _block_range(dest, fmt, block)

    def work() -> bytes:
        reader = open_reader(dest)
        reader.read_ahead_ranges([block])
        reader.ahead.ready(np.arange(*block))  # announced: made resident before a copy
        return b"%d" % (reader.cached is not None)

    assert as_nobody(work) == b"1", "the child could not read the pack as nobody"
    assert resident_share(path, offset, length) == 1.0


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "fork") or os.geteuid() != 0, reason="needs root to become another user"
)
@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
def test_a_non_owner_tells_a_cold_pack_from_a_warm_one(open_tmp, fmt):
    """Reader.looks_warm as nobody over root's pack: cold after an eviction (mincore would
    say warm, and the epoch would read nothing ahead), warm once the child read it all."""
    # 48 MiB: past the kernel's read-around of the reader's first look (8 MiB here)
    dest = evicted_pack(open_tmp, fmt, 2048, seed=8)

    def work() -> bytes:
        reader = open_reader(dest)
        cold = reader.looks_warm()
        reader.read_batch(np.arange(reader.count, dtype=np.int64))
        return bytes([cold, reader.looks_warm(), reader.cached is not None])

    told = as_nobody(work)
    assert len(told) == 3, "the child could not read the pack as nobody"
    cold, warm, probed = told
    assert probed, "the child's reader did not ask the file"
    assert (cold, warm) == (0, 1)


def test_the_tar_reader_asks_its_shards_where_mincore_cannot_see(tmp_path, monkeypatch):
    from gpufeed.formats.tar import reader as tar

    write_arrays(tmp_path / "src", {"x": 8, "y": 8}, shape=(3, 16, 16), seed=4)
    gpufeed.pack(tmp_path / "src", tmp_path / "tar", format="tar", workers=1, quiet=True)
    monkeypatch.setattr(tar, "mincore_sees", lambda p: False)
    asked = []
    monkeypatch.setattr(tar, "file_cached", lambda fd, at, n: asked.append((at, n)) or True)
    reader = open_reader(tmp_path / "tar")
    reader.read_batch(np.array([3, 1]))
    assert reader.cached is not None and reader.ahead.cached == reader.cached
    data = reader._map(int(reader.shard[3]))
    at = int(reader.offset[3])
    assert reader.cached(data.ctypes.data + at, 100)
    assert asked[-1] == (at, 100)  # the shard's own offset
    outside = np.zeros(8, np.uint8)
    monkeypatch.setattr(tar, "looks_cached", lambda addr, n: addr == outside.ctypes.data)
    assert reader.cached(outside.ctypes.data, 8)  # not a shard map: mincore's answer
    reader.close()
