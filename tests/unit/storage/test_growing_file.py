"""An mmap pack read from a real S3 server (rclone on 127.0.0.1) while its sample file downloads:
the first batches come from the bytes already written (each checked against its crc32), with
no byte fetched twice; the file still lands whole and verified; a fault mid-download is
retried as before and leaves nothing half-written; two processes sharing the cache download
it once. The download is paused by wrapping the real stream (the bytes come from the server)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from faultproxy import FaultProxy  # noqa: E402  (tests/unit/storage, on sys.path: conftest)

import gpufeed.storage.cache as cache_module
from gpufeed.data.open import open_dataset
from gpufeed.errors import ChecksumError
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack
from gpufeed.storage.growing_file import Landing
from gpufeed.storage.store import ObjectStore
from gpufeed.write.pack import pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SAMPLES = "samples.npy"


@pytest.fixture(scope="module")
def big_mmap(tmp_path_factory, make_arrays_module):
    """An mmap pack of 128 uint8 samples of 64 KiB (8 MiB of samples) and its local dataset."""
    src = tmp_path_factory.mktemp("landing-src")
    make_arrays_module(src, {"a": 64, "b": 64}, shape=(64, 1024), seed=3)
    dest = tmp_path_factory.mktemp("landing") / "mmap"
    pack(src, dest, "mmap", quiet=True)
    return dest


@pytest.fixture(scope="module")
def make_arrays_module():
    from unit_sources import write_arrays

    return write_arrays


@pytest.fixture()
def small_steps(monkeypatch):
    monkeypatch.setattr(cache_module, "LANDING_STEP", 64 << 10)


class Gate:
    """Holds the download of samples.npy once it has passed `after` bytes, until released."""

    def __init__(self, after: int):
        self.after = after
        self.held = threading.Event()
        self.go = threading.Event()

    def install(self, monkeypatch) -> Gate:
        real = ObjectStore.stream
        gate = self

        def stream(store, name, start=0):
            got = start
            for chunk in real(store, name, start):
                if name.endswith(SAMPLES) and got >= gate.after and not gate.go.is_set():
                    gate.held.set()
                    assert gate.go.wait(60), "the test never released the download"
                got += len(chunk)
                yield chunk

        monkeypatch.setattr(ObjectStore, "stream", stream)
        return self


def local_samples(path) -> np.ndarray:
    return np.load(path / SAMPLES)


def all_batches(ds) -> np.ndarray:
    return np.concatenate([b.samples.numpy() for b in make_loader(ds, 16, check_shm=False)])


def fetched_bytes(big_mmap) -> int:
    """What reading the pack fetches: its samples, labels and crc32s (not sources.txt)."""
    files = json.loads((big_mmap / "manifest.json").read_text())["files"]
    return sum(int(files[n]["bytes"]) for n in (SAMPLES, "labels.npy", "crc32.npy"))


def cached_sample_file(cache, big_mmap):
    digest = json.loads((big_mmap / "manifest.json").read_text())["files"][SAMPLES]["sha256"]
    return cache / "objects" / digest[:2] / digest


def test_the_first_batch_comes_while_the_samples_download_and_nothing_is_fetched_twice(
    s3, big_mmap, tmp_path, monkeypatch, small_steps
):
    upload_pack(big_mmap, f"{s3}/m")
    gate = Gate(after=3 << 20).install(monkeypatch)
    cache = tmp_path / "c"
    ds = open_dataset(f"{s3}/m", cache_dir=cache)
    first = ds.get_batch(list(range(16)))  # 1 MiB of samples: below where the download waits
    want = local_samples(big_mmap)
    assert np.array_equal(first.samples.numpy(), want[:16])
    assert gate.held.wait(30)  # the download is held at 3 MiB: the file cannot have landed
    landed = cached_sample_file(cache, big_mmap)
    assert not landed.exists(), "served from the download in progress, before it landed"
    gate.go.set()
    assert np.array_equal(all_batches(ds), want)
    assert landed.exists()
    assert hashlib.sha256(landed.read_bytes()).hexdigest() == landed.name
    assert not list((cache / "objects").rglob("*.part"))
    stats = ds.reader.source.stats.as_dict()
    assert stats["bytes_fetched"] == fetched_bytes(big_mmap), stats
    assert stats["misses"] == 3


def test_an_object_changed_in_the_store_is_refused_and_leaves_nothing(
    s3, big_mmap, tmp_path, rclone_server, small_steps
):
    upload_pack(big_mmap, f"{s3}/m")
    data = bytearray((big_mmap / SAMPLES).read_bytes())
    data[-1] ^= 0xFF  # the last sample's last byte: the early reads see their crc32s match
    data[200] ^= 0xFF  # and the first sample's: its crc32 fails while it downloads
    rclone_server.put(f"{s3}/m/{SAMPLES}", bytes(data))
    cache = tmp_path / "c"
    with pytest.raises(ChecksumError, match=SAMPLES):  # at open, or at the first read
        open_dataset(f"{s3}/m", cache_dir=cache).get_batch(list(range(16)))
    assert not list((cache / "objects").rglob("*.part"))
    assert not cached_sample_file(cache, big_mmap).exists()


def test_a_forked_worker_waits_for_the_parents_download_without_a_helper(
    s3, big_mmap, tmp_path, monkeypatch, small_steps
):
    """A DataLoader worker forked while the parent downloads the sample file (the parent reads
    it early) waits for it to land and maps it: no helper process (its imports cost ~1 s)."""
    upload_pack(big_mmap, f"{s3}/m")
    gate = Gate(after=3 << 20).install(monkeypatch)
    ds = open_dataset(f"{s3}/m", cache_dir=tmp_path / "c")
    want = local_samples(big_mmap)
    assert np.array_equal(ds.get_batch(list(range(4))).samples.numpy(), want[:4])
    assert gate.held.wait(30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: waits on the download lock, then reads
        try:
            got = ds.get_batch(list(range(100, 120))).samples.numpy()
            ok = np.array_equal(got, want[100:120]) and ds.reader.source.pack._helper is None
        except BaseException:  # noqa: BLE001
            ok = False
        os._exit(0 if ok else 1)
    gate.go.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture()
def rclone_faults(s3, rclone_server, monkeypatch):
    """(s3://BUCKET, FaultProxy): the rclone server (whose ranged GETs obstore refuses, so a
    download cut short starts over) reached through a fault-injecting proxy."""
    proxy = FaultProxy(rclone_server.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield s3, proxy
    proxy.stop()


@pytest.mark.parametrize("server", ["rclone", "moto"])
def test_a_reset_mid_download_is_retried_and_the_early_reads_stay_right(
    server, big_mmap, tmp_path, request, small_steps
):
    """A reset past 2 MiB: moto resumes at the byte reached (206); rclone answers the ranged
    GET with 200, so the download starts over from 0. The early reads wait through both."""
    url, proxy = request.getfixturevalue("s3_faults" if server == "moto" else "rclone_faults")
    upload_pack(big_mmap, f"{url}/m")
    proxy.cut_first_past(2 << 20)  # samples.npy: the only object past 2 MiB
    cache = tmp_path / "c"
    ds = open_dataset(f"{url}/m", cache_dir=cache)
    want = local_samples(big_mmap)
    assert np.array_equal(all_batches(ds), want)
    assert proxy.injected == 1
    stats = ds.reader.source.stats.as_dict()
    fetched = fetched_bytes(big_mmap)
    twice = stats["bytes_fetched"] - fetched
    if server == "moto":  # resumed: nothing fetched twice
        assert stats["retries"] == 1 and twice == 0, stats
    else:  # started over: the bytes before the reset, twice
        assert 0 <= twice <= 3 << 20, stats
        # the resume from the byte reached is answered 200: a second retry, from byte 0. On
        # a loaded machine the reset can come before the first chunk reaches the reader
        # (the proxy counts what it relayed into the socket): then the one retry asks from
        # byte 0 and nothing is fetched twice.
        assert stats["retries"] == (2 if twice else 1), stats
    assert not list((cache / "objects").rglob("*.part"))
    landed = cached_sample_file(cache, big_mmap)
    assert hashlib.sha256(landed.read_bytes()).hexdigest() == landed.name


READER = textwrap.dedent(
    """
    import json, sys, hashlib
    from gpufeed.data.open import open_dataset
    from gpufeed.loading.make import make_loader
    ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2])
    h = hashlib.sha256()
    for b in make_loader(ds, 16, check_shm=False):
        h.update(b.samples.numpy().tobytes())
    print(json.dumps({"digest": h.hexdigest(), "stats": ds.reader.source.stats.as_dict()}))
    """
)


def test_two_processes_sharing_the_cache_download_the_samples_once(
    s3, big_mmap, tmp_path, python_env
):
    upload_pack(big_mmap, f"{s3}/m")
    cache = tmp_path / "node-cache"
    env = {**os.environ, **python_env}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, f"{s3}/m", str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    want = hashlib.sha256(local_samples(big_mmap).tobytes()).hexdigest()
    assert [r["digest"] for r in results] == [want, want]
    total = sum(r["stats"]["bytes_fetched"] for r in results)
    assert total == fetched_bytes(big_mmap), results
    assert not list((cache / "objects").rglob("*.part"))


def test_a_landing_waits_for_its_bytes_and_answers_false_once_done(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDONLY)
    try:
        landing = Landing(fd, 4096)
        buf = bytearray(16)
        got: list[bool] = []
        reader = threading.Thread(target=lambda: got.append(landing.read_into([(100, buf)])))
        reader.start()
        landing.advance(64)  # not yet past the read's end: it keeps waiting
        reader.join(0.2)
        assert reader.is_alive()
        landing.advance(1024)
        reader.join(5)
        assert got == [True] and bytes(buf) == bytes(range(100, 116))
        with pytest.raises(ValueError):
            landing.read_into([(4090, bytearray(16))])
        landing.finish()
        assert landing.done and landing.read_into([(0, bytearray(4))]) is False
    finally:
        os.close(fd)


def test_a_forked_child_never_waits_on_the_parents_landing(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    landing = Landing(fd, 4096)  # never advanced: only this process's download would
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if landing.read_into([(0, bytearray(4))]) is False else 1)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
