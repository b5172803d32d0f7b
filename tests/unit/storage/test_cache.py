"""The local cache on its own: atomic landing, checksums, LRU past cache_limit, pins, a full
disk, and a downloader killed mid-file. The fetches here write known bytes; the tests with a
real S3 server are in test_remote.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gpufeed.errors import UsageError
from gpufeed.storage import Cache, CacheFullError, ChecksumError, FetchAhead, FileEntry

KIB = 1024


def blob(seed: int, size: int) -> tuple[FileEntry, bytes]:
    data = hashlib.sha256(str(seed).encode()).digest() * (size // 32) + b"x" * (size % 32)
    return FileEntry(f"file-{seed}", size, hashlib.sha256(data).hexdigest()), data


def writer(data: bytes, calls: list | None = None):
    def fetch(entry, out):
        if calls is not None:
            calls.append(entry.name)
        out.write(data)

    return fetch


def cached_names(cache: Cache) -> set[str]:
    return {p.name for p in (cache.root / "objects").rglob("*") if p.is_file()}


def test_a_miss_lands_verified_and_a_second_get_is_a_hit(tmp_path):
    cache = Cache(tmp_path / "c")
    entry, data = blob(1, 100 * KIB)
    calls = []
    with cache.get(entry, writer(data, calls)) as pin:
        assert pin.path.read_bytes() == data
        assert pin.path == cache.path(entry)
    with cache.get(entry, writer(data, calls)) as pin:
        assert pin.path.read_bytes() == data
    assert calls == ["file-1"]
    assert cache.stats.as_dict() == {
        "hits": 1, "misses": 1, "retries": 0, "bytes_fetched": 0, "evictions": 0,
    }  # fmt: skip


@pytest.mark.parametrize("bad", ["flipped", "short", "long"])
def test_wrong_bytes_are_refused_and_leave_nothing(tmp_path, bad):
    cache = Cache(tmp_path / "c")
    entry, data = blob(2, 64 * KIB)
    wrong = {
        "flipped": data[:-1] + bytes([data[-1] ^ 1]),
        "short": data[:-10],
        "long": data + b"!",
    }[bad]

    def fetch(entry, out):
        out.write(wrong)

    with pytest.raises(ChecksumError, match=r"file-2: fetched \d+ bytes with sha256 "):
        cache.get(entry, fetch)
    assert cached_names(cache) == set()  # neither the file nor its .part
    assert cache.pin(entry) is None


def test_lru_eviction_keeps_the_limit_and_never_evicts_a_pinned_file(tmp_path):
    cache = Cache(tmp_path / "c", cache_limit="300KiB")
    blobs = [blob(i, 100 * KIB) for i in range(6)]
    held = cache.get(*_fetchable(blobs[0]))  # pinned throughout, and the oldest
    for b in blobs[1:3]:
        cache.get(*_fetchable(b)).release()
        time.sleep(0.01)  # distinct mtimes
    cache.get(*_fetchable(blobs[1])).release()  # 1 is now more recent than 2
    for b in blobs[3:]:
        cache.get(*_fetchable(b)).release()
        assert cache.usage() <= 300 * KIB
    present = cached_names(cache)
    assert blobs[0][0].sha256 in present  # pinned: kept although least recently used
    assert blobs[5][0].sha256 in present
    assert blobs[2][0].sha256 not in present  # least recently used unpinned: gone first
    assert cache.stats.evictions == 3
    assert held.path.read_bytes() == blobs[0][1]
    held.release()


def test_pins_holding_the_whole_limit_give_a_clear_error(tmp_path):
    cache = Cache(tmp_path / "c", cache_limit=250 * KIB)
    pins = [cache.get(*_fetchable(blob(i, 100 * KIB))) for i in range(2)]
    with pytest.raises(CacheFullError, match=r"cache_limit 250\.0 KiB cannot hold file-9"):
        cache.get(*_fetchable(blob(9, 100 * KIB)))
    assert {p.path.name for p in pins} <= cached_names(cache)
    assert not any(n.endswith(".part") for n in cached_names(cache))
    for p in pins:
        p.release()
    cache.get(*_fetchable(blob(9, 100 * KIB))).release()  # fits once a pin is released


def _fetchable(b):
    entry, data = b
    return entry, writer(data)


def test_a_full_disk_names_the_cache_dir_and_the_setting(tmp_path):
    """A 1 MiB tmpfs (in a private mount namespace) cannot hold a 2 MiB file."""
    script = textwrap.dedent(
        f"""
        import hashlib, sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        from test_cache import blob, writer
        from gpufeed.storage import Cache, CacheFullError
        cache = Cache("{tmp_path}/small/cache")
        entry, data = blob(3, 2 << 20)
        try:
            cache.get(entry, writer(data))
        except CacheFullError as e:
            print("ERROR", e)
        import os
        print("LEFT", sorted(os.listdir(cache.root / "objects" / entry.sha256[:2])))
        """
    )
    (tmp_path / "small").mkdir()
    cmd = f'mount -t tmpfs -o size=1m tmpfs "{tmp_path}/small" && exec "{sys.executable}" -c "$0"'
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd, script], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert f"ERROR cache_dir {tmp_path}/small/cache: no space left on its disk for file-3" in (
        res.stdout
    )
    assert "cache_limit (now none)" in res.stdout
    assert "LEFT []" in res.stdout


def test_a_downloader_killed_mid_file_leaves_nothing_that_looks_complete(tmp_path, python_env):
    """kill -9 while the fetch has written half of the file: no file at the final name (only
    a .part, never read), and the next get sweeps the .part and fetches the file whole."""
    entry, data = blob(4, 1 << 20)
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        from test_cache import blob
        from gpufeed.storage import Cache
        entry, data = blob(4, 1 << 20)
        def fetch(entry, out):
            out.write(data[: len(data) // 2])
            out.flush()
            print("HALF", flush=True)
            time.sleep(600)
        Cache("{tmp_path}/c").get(entry, fetch)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=python_env
    )
    try:
        assert proc.stdout.readline().strip() == "HALF"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    cache = Cache(tmp_path / "c")
    assert not cache.path(entry).exists()
    leftovers = list(cache.path(entry).parent.iterdir())
    assert [p.name.endswith(".part") for p in leftovers] == [True]
    assert cache.pin(entry) is None  # a .part is never taken for the file
    with cache.get(entry, writer(data)) as pin:
        assert pin.path.read_bytes() == data
    assert [p.name for p in cache.path(entry).parent.iterdir()] == [entry.sha256]


def test_fetch_ahead_runs_ahead_by_at_most_ahead_files_and_yields_in_order(tmp_path):
    cache = Cache(tmp_path / "c")
    blobs = [blob(i, 10 * KIB) for i in range(10)]
    data = {e.name: d for e, d in blobs}
    started = []

    def fetch(entry, out):
        started.append(entry.name)
        out.write(data[entry.name])

    with FetchAhead(lambda e: cache.get(e, fetch), [e for e, _ in blobs], workers=2, ahead=3) as it:
        time.sleep(0.3)
        assert len(started) == 3  # nothing consumed yet: three fetched ahead, no more
        for (_entry, payload), pin in zip(blobs, it, strict=True):
            assert pin.path.read_bytes() == payload
            pin.release()
    assert sorted(started) == sorted(e.name for e, _ in blobs)  # each once


def test_fetch_ahead_raises_a_failed_fetch_at_its_place_in_the_order(tmp_path):
    cache = Cache(tmp_path / "c")
    blobs = [blob(i, KIB) for i in range(4)]

    def fetch(entry, out):
        if entry.name == "file-2":
            raise ChecksumError("file-2: broken")
        out.write(dict((e.name, d) for e, d in blobs)[entry.name])

    got = []
    with pytest.raises(ChecksumError, match="file-2: broken"):
        with FetchAhead(lambda e: cache.get(e, fetch), [e for e, _ in blobs], ahead=4) as it:
            for pin in it:
                got.append(pin.path.name)
                pin.release()
    assert got == [blobs[0][0].sha256, blobs[1][0].sha256]


def test_a_forked_child_does_not_keep_the_parents_locks_or_pins(tmp_path):
    """A fork copies the descriptors flocks hang on: a DataLoader worker forked while the parent
    held the cache lock would hold it until it exited, and every download on the node (its
    own fetch helper's too) would wait for it. The child closes its copies at once."""
    import multiprocessing

    from gpufeed.storage.cache import CACHE_LOCK, _Flock

    cache = Cache(tmp_path / "c", 64 * KIB)
    entry, data = blob(1, 32 * KIB)
    pin = cache.get(entry, writer(data))
    lock = _Flock(cache.root / CACHE_LOCK)
    lock.acquire()
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_ready_then_wait, args=(ready, go))
    child.start()
    try:
        assert ready.wait(60)  # the child runs Python code: its at-fork hook has run
        lock.release()
        pin.release()
        assert _Flock(cache.root / CACHE_LOCK, wait=False).acquire()
        assert cache._evict(cache.path(entry))  # no longer pinned by the child's copy
    finally:
        go.set()
        child.join(10)


def _ready_then_wait(ready, go) -> None:
    ready.set()
    go.wait(60)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)  # the usual default: what made the cache world-readable
    yield
    os.umask(old)


def modes(root) -> dict[str, int]:
    """Every folder and file under `root` (root itself as "."): its permission bits."""
    out = {".": root.stat().st_mode & 0o777}
    for p in root.rglob("*"):
        if not p.is_symlink():
            out[str(p.relative_to(root))] = p.stat().st_mode & 0o777
    return out


def test_the_cache_is_private_to_its_user(tmp_path, umask_022, monkeypatch):
    monkeypatch.delenv("GPUFEED_CACHE_SHARED", raising=False)
    cache = Cache(tmp_path / "c", cache_limit="1MiB")
    entry, data = blob(5, 10 * KIB)
    cache.get(entry, writer(data)).release()
    found = modes(cache.root)
    assert {"objects", "locks", "cache.lock", str(cache.path(entry).relative_to(cache.root))} <= (
        set(found)
    )
    for name, mode in found.items():
        want = 0o700 if (cache.root / name).is_dir() else 0o600
        assert mode == want, f"{name}: {oct(mode)}"


def test_an_older_world_readable_cache_is_closed_on_open(tmp_path, umask_022, monkeypatch):
    monkeypatch.delenv("GPUFEED_CACHE_SHARED", raising=False)
    for sub in ("objects", "locks"):
        (tmp_path / "c" / sub).mkdir(parents=True, mode=0o755)
    Cache(tmp_path / "c")
    assert modes(tmp_path / "c")["objects"] == modes(tmp_path / "c")["locks"] == 0o700


def test_a_shared_cache_follows_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFEED_CACHE_SHARED", "1")
    old = os.umask(0o002)  # a group sharing one cache
    try:
        cache = Cache(tmp_path / "c")
        entry, data = blob(6, 10 * KIB)
        cache.get(entry, writer(data)).release()
    finally:
        os.umask(old)
    for name, mode in modes(cache.root).items():
        want = 0o775 if (cache.root / name).is_dir() else 0o664
        assert mode == want, f"{name}: {oct(mode)}"
    assert Cache(tmp_path / "c2", shared=False).shared is False  # the argument wins


def test_a_bad_shared_setting_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFEED_CACHE_SHARED", "maybe")
    with pytest.raises(UsageError, match=r"GPUFEED_CACHE_SHARED='maybe': expected 1"):
        Cache(tmp_path / "c")
