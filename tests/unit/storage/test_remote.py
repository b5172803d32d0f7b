"""A pack through a real S3 server: upload, fetch through the cache, two processes sharing one
cache, faults (server stopped and started mid-download, 503s, a cut connection resumed),
a changed object, a missing object and bad credentials."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gpufeed.errors import NotPackedError, UsageError
from gpufeed.formats.manifest import read_manifest
from gpufeed.storage import (
    ChecksumError,
    CredentialsError,
    ObjectNotFoundError,
    RetryPolicy,
    open_pack,
    upload_pack,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
FAST_RETRY = RetryPolicy(retries=8, base_s=0.05, max_s=1.0)


def test_upload_then_fetch_through_the_cache(s3, tar_pack, tmp_path, rclone_server):
    manifest = upload_pack(tar_pack, f"{s3}/train")
    # every file, the manifest among them
    assert rclone_server.keys(f"{s3}/train") == sorted(p.name for p in tar_pack.iterdir())
    pack = open_pack(f"{s3}/train", tmp_path / "cache", cache_limit="10MB")
    assert pack.manifest == manifest == read_manifest(tar_pack)
    names = sorted(pack.entries)
    with pack.fetch_ahead(names, workers=3, ahead=2) as files:
        for name, pin in zip(names, files, strict=True):
            assert pin.path.read_bytes() == (tar_pack / name).read_bytes()
            pin.release()
    total = sum(e.size for e in pack.entries.values())
    assert pack.stats.as_dict() == {
        "hits": 0, "misses": len(names), "retries": 0, "bytes_fetched": total, "evictions": 0,
    }  # fmt: skip
    again = open_pack(f"{s3}/train", tmp_path / "cache")  # a second epoch: all from the cache
    for name in names:
        again.fetch(name).release()
    assert (again.stats.hits, again.stats.misses, again.stats.bytes_fetched) == (len(names), 0, 0)


def test_a_pack_crosses_to_a_spawned_worker(s3, tar_pack, tmp_path):
    """What a DataLoader worker gets: the pack pickled; its client is made again there."""
    upload_pack(tar_pack, f"{s3}/train")
    pack = open_pack(f"{s3}/train", tmp_path / "cache")
    pack.fetch("index.npz").release()
    clone = pickle.loads(pickle.dumps(pack))
    with clone.fetch("shard-000004.tar") as pin:
        assert pin.path.read_bytes() == (tar_pack / "shard-000004.tar").read_bytes()
    assert clone.stats.misses == 2  # the counts travel with it


def test_the_manifest_goes_last_and_foreign_prefixes_are_refused(s3, tar_pack, rclone_server):
    url = f"{s3}/train"
    upload_pack(tar_pack, url)
    with pytest.raises(UsageError, match=r"already holds a pack; pass overwrite=True"):
        upload_pack(tar_pack, url)
    rclone_server.put(f"{url}/stale.bin", b"from an older pack")
    upload_pack(tar_pack, url, overwrite=True)
    # the replaced pack's leftovers are removed
    assert rclone_server.keys(url) == sorted(p.name for p in tar_pack.iterdir())
    rclone_server.put(f"{s3}/notours/data.bin", b"someone else's")
    with pytest.raises(UsageError, match=r"holds 1 objects and no manifest.json: not a gpufeed"):
        upload_pack(tar_pack, f"{s3}/notours", overwrite=True)
    assert rclone_server.keys(f"{s3}/notours") == ["data.bin"]


def test_upload_refuses_an_unfinished_pack(s3, tar_pack, tmp_path):
    partial = tmp_path / "half.partial"
    partial.mkdir()
    (partial / "state.json").write_text("{}")
    with pytest.raises(NotPackedError, match="unfinished pack"):
        upload_pack(partial, f"{s3}/half")
    with pytest.raises(UsageError, match="upload_pack writes to object storage"):
        upload_pack(tar_pack, str(tmp_path / "local"))


def test_a_reader_never_takes_a_pack_without_its_manifest(s3, tar_pack, tmp_path, rclone_server):
    rclone_server.put(f"{s3}/half/shard-000000.tar", (tar_pack / "shard-000000.tar").read_bytes())
    with pytest.raises(NotPackedError, match=r"half: no manifest.json; .* upload is unfinished"):
        open_pack(f"{s3}/half", tmp_path / "cache")


def test_a_remote_manifest_of_the_wrong_structure_names_object_and_field(
    s3, tar_pack, tmp_path, rclone_server
):
    """A remote manifest is checked as a local one is (check_manifest): `count: "abc"` or
    `layout.shards: 42` is a DataError naming the object and field, not a reader's error."""
    from gpufeed.errors import DataError

    manifest = json.loads((tar_pack / "manifest.json").read_text())
    for field, value in (("count", "abc"), ("layout", {**manifest["layout"], "shards": 42})):
        url = f"{s3}/bad-{field}"
        rclone_server.put(f"{url}/manifest.json", json.dumps({**manifest, field: value}).encode())
        with pytest.raises(DataError, match=rf"bad-{field}/manifest.json: field \S*{field[:5]}"):
            open_pack(url, tmp_path / "cache")


def test_multipart_upload_of_a_large_file(s3, tmp_path, rclone_server):
    """A file over the part size goes up in parts and comes back byte for byte."""
    from gpufeed.storage.store import MULTIPART_CHUNK

    pack = tmp_path / "big"
    pack.mkdir()
    data = (b"0123456789abcdef" * (1 << 16)) * ((MULTIPART_CHUNK * 2 + (1 << 20)) >> 20)
    (pack / "data.bin").write_bytes(data)
    _write_manifest(pack)
    upload_pack(pack, f"{s3}/big")
    assert rclone_server.get(f"{s3}/big/data.bin") == data
    bucket = s3.removeprefix("s3://")
    log = rclone_server.log_path.read_text(errors="replace")  # rclone logs where parts landed
    assert re.search(
        rf"rclone_temp_multipart_\S+: Moved \(server-side\) to: {bucket}/big/data", log
    )


def _write_manifest(pack: Path) -> dict:
    from gpufeed.formats.manifest import file_entry

    files = {p.name: file_entry(pack, p.name) for p in pack.iterdir()}
    manifest = {
        "gpufeed_manifest": 1, "format": "mmap", "format_version": 1, "files": files,
        "count": 0, "sample": {"kind": "encoded"},
    }  # fmt: skip
    (pack / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_an_object_changed_after_packing_is_detected(s3, tar_pack, tmp_path, rclone_server):
    upload_pack(tar_pack, f"{s3}/train")
    shard = f"{s3}/train/shard-000001.tar"
    data = bytearray(rclone_server.get(shard))
    data[100] ^= 0xFF  # same size, other bytes
    rclone_server.put(shard, bytes(data))
    pack = open_pack(f"{s3}/train", tmp_path / "cache")
    with pytest.raises(ChecksumError, match=r"shard-000001.tar: fetched \d+ bytes with sha256"):
        pack.fetch("shard-000001.tar")
    rclone_server.put(shard, bytes(data) + b"more")
    with pytest.raises(ChecksumError, match=r"shard-000001.tar: more than the manifest's"):
        pack.fetch("shard-000001.tar")
    assert not list((tmp_path / "cache" / "objects").rglob("*.part"))
    assert pack.cache.pin(pack.entry("shard-000001.tar")) is None
    pack.fetch("shard-000002.tar").release()  # the others are fine


def test_missing_objects_and_bad_credentials_name_the_object_and_setting(
    s3, tar_pack, tmp_path, rclone_server, monkeypatch
):
    upload_pack(tar_pack, f"{s3}/train")
    rclone_server.delete(f"{s3}/train/shard-000003.tar")
    pack = open_pack(f"{s3}/train", tmp_path / "cache")
    with pytest.raises(ObjectNotFoundError, match=rf"{s3}/train/shard-000003.tar: no such object"):
        pack.fetch("shard-000003.tar")
    assert pack.stats.retries == 0  # a missing object is not retried
    with pytest.raises(UsageError, match=r"the manifest lists no file 'nope.tar'"):
        pack.fetch("nope.tar")
    with pytest.raises(ObjectNotFoundError, match=r"no-such-bucket-xyz/train/manifest.json: the b"):
        open_pack("s3://no-such-bucket-xyz/train", tmp_path / "cache")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(CredentialsError, match=r"refused the credentials .*AWS_ACCESS_KEY_ID"):
        open_pack(f"{s3}/train", tmp_path / "cache")


def test_a_profile_in_aws_config_is_used(s3, tar_pack, tmp_path, rclone_server, monkeypatch):
    """No AWS_* keys in the environment: AWS_PROFILE's keys and endpoint_url are read from
    ~/.aws/config and ~/.aws/credentials (as the AWS CLI does)."""
    upload_pack(tar_pack, f"{s3}/train")
    env = rclone_server.env()
    (tmp_path / "config").write_text(
        f"[profile gpufeedtest]\nregion = {env['AWS_REGION']}\n"
        f"endpoint_url = {env['AWS_ENDPOINT_URL']}\n"
    )
    (tmp_path / "credentials").write_text(
        f"[gpufeedtest]\naws_access_key_id = {env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "gpufeedtest")
    pack = open_pack(f"{s3}/train", tmp_path / "cache")
    pack.fetch("shard-000000.tar").release()
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(CredentialsError, match=r"no-such-profile"):
        open_pack(f"{s3}/train", tmp_path / "cache")


def test_two_processes_share_one_cache_without_double_downloads(
    s3, tar_pack, tmp_path, rclone_server, python_env
):
    """Two real processes (two ranks on a node) read the whole pack at the same moment from
    one cache_dir: every file is fetched once in all, and both read the right bytes."""
    upload_pack(tar_pack, f"{s3}/train")
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import json, os, sys, time
        from gpufeed.storage import open_pack
        pack = open_pack("{s3}/train", "{tmp_path}/cache")
        names = sorted(pack.entries)
        while not os.path.exists("{go}"):
            time.sleep(0.01)
        digests = {{}}
        with pack.fetch_ahead(names, workers=4) as files:
            for name, pin in zip(names, files):
                digests[name] = pin.path.stat().st_size
                pin.release()
        print(json.dumps(pack.stats.as_dict()))
        """
    )
    env = {**python_env, **rclone_server.env()}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    time.sleep(1.0)  # both have imported and opened the pack
    go.touch()
    stats = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    pack = open_pack(f"{s3}/train", tmp_path / "cache")
    n = len(pack.entries)
    total = sum(e.size for e in pack.entries.values())
    assert sum(s["misses"] for s in stats) == n  # each file downloaded once, by one of them
    assert sum(s["hits"] for s in stats) == n
    assert sum(s["bytes_fetched"] for s in stats) == total
    for name in pack.entries:
        with pack.fetch(name) as pin:
            assert pin.path.read_bytes() == (tar_pack / name).read_bytes()


def test_server_stopped_and_started_mid_download_is_retried(
    s3, tmp_path, rclone_server, monkeypatch
):
    """The server dies while a 24 MiB file streams in, and comes back 1.5 s later: the
    download retries (connection reset, then refused) and lands the whole file."""
    pack_dir = tmp_path / "big"
    pack_dir.mkdir()
    (pack_dir / "data.bin").write_bytes(bytes(range(256)) * (24 << 12))
    _write_manifest(pack_dir)
    upload_pack(pack_dir, f"{s3}/big")
    pack = open_pack(f"{s3}/big", tmp_path / "cache", retry=RetryPolicy(8, 0.1, 1.0))
    started, resume = threading.Event(), threading.Event()
    real_download = pack._download

    def paused_download(entry, out):
        class Pausing:  # stalls the first write until the server is gone
            def write(self, data):
                if not started.is_set():
                    started.set()
                    resume.wait(30)
                return out.write(data)

            def seek(self, *a):
                return out.seek(*a)

        real_download(entry, Pausing())

    monkeypatch.setattr(pack, "_download", paused_download)
    result = {}
    t = threading.Thread(target=lambda: result.update(pin=pack.fetch("data.bin")))
    t.start()
    assert started.wait(30)
    rclone_server.stop()
    resume.set()
    time.sleep(1.5)
    rclone_server.start()
    t.join(60)
    with result["pin"] as pin:
        assert pin.path.read_bytes() == (pack_dir / "data.bin").read_bytes()
    assert pack.stats.retries >= 1
    assert not list((tmp_path / "cache" / "objects").rglob("*.part"))


def test_5xx_answers_are_retried_with_backoff_and_counted(s3_faults, tar_pack, tmp_path):
    url, proxy = s3_faults
    upload_pack(tar_pack, f"{url}/train")
    pack = open_pack(f"{url}/train", tmp_path / "cache", retry=FAST_RETRY)
    proxy.fail_next(3, status=503)
    with pack.fetch("shard-000000.tar") as pin:
        assert pin.path.read_bytes() == (tar_pack / "shard-000000.tar").read_bytes()
    assert pack.stats.retries == 3
    assert proxy.injected == 3
    proxy.fail_next(100, status=500)
    with pytest.raises(Exception, match=r"shard-000001.tar: .*500.* \(gave up after 8 retries\)"):
        pack.fetch("shard-000001.tar")
    proxy.fail_next(0)
    assert not list((tmp_path / "cache" / "objects").rglob("*.part"))


def test_a_cut_connection_resumes_at_the_byte_reached(s3_faults, tmp_path):
    """moto answers ranged GETs with 206: after a reset at 3 MiB, the retry fetches only the
    rest (bytes fetched stay near the file's size, not twice it)."""
    url, proxy = s3_faults
    pack_dir = tmp_path / "big"
    pack_dir.mkdir()
    (pack_dir / "data.bin").write_bytes(bytes(range(251)) * (32 << 12))
    size = (pack_dir / "data.bin").stat().st_size
    _write_manifest(pack_dir)
    upload_pack(pack_dir, f"{url}/big")
    pack = open_pack(f"{url}/big", tmp_path / "cache", retry=FAST_RETRY)
    proxy.cut_after(3 << 20)
    with pack.fetch("data.bin") as pin:
        assert pin.path.read_bytes() == (pack_dir / "data.bin").read_bytes()
    assert pack.stats.retries == 1
    assert size <= pack.stats.bytes_fetched < size + (3 << 20)


def test_stores_of_one_url_share_a_client_until_its_settings_change(s3, monkeypatch):
    from gpufeed.storage.store import ObjectStore
    from gpufeed.storage.urls import parse_location

    first = ObjectStore(parse_location(f"{s3}/p")).store
    assert ObjectStore(parse_location(f"{s3}/p")).store is first  # one client, made once
    assert ObjectStore(parse_location(f"{s3}/q")).store is not first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another endpoint
    assert ObjectStore(parse_location(f"{s3}/p")).store is not first
