"""Faults end to end, through open_dataset and make_loader against a real S3 server (rclone on
127.0.0.1): the server stopped and started again mid-epoch is retried and counted; a missing
object, bad credentials and a cache too small give errors naming the object or the setting,
and leave nothing half-written in the cache."""

from __future__ import annotations

import threading
import time

import pytest

from gpufeed.data.open import open_dataset
from gpufeed.errors import CacheFullError, CredentialsError, ObjectNotFoundError
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def shards(pack_factory):
    return pack_factory("tar", shard_size=2)  # 17 samples: 9 shards


def no_parts(cache) -> bool:
    return not list((cache / "objects").rglob("*.part"))


def test_the_server_stopped_and_started_mid_epoch_is_retried_and_counted(
    s3, shards, tmp_path, rclone_server
):
    upload_pack(shards, f"{s3}/train")
    ds = open_dataset(
        f"{s3}/train",
        cache_dir=tmp_path / "c",
        map_style=False,
        shuffle_buffer=0,
        fetch_ahead=1,
        read_size=1,
    )
    it = iter(ds)
    labels = [int(next(it)[1])]  # the first shard (and maybe the next) is in
    rclone_server.stop()
    # the rest is read in a thread; the server starts again from this one (a server started
    # from a thread would die with it: PR_SET_PDEATHSIG)
    rest = threading.Thread(target=lambda: labels.extend(int(y) for _, y in it))
    rest.start()
    time.sleep(1.5)
    rclone_server.start()
    rest.join(120)
    assert sorted(labels) == sorted(ds.reader.labels.tolist())  # every sample, once
    assert ds.reader.source.stats.retries >= 1
    assert no_parts(tmp_path / "c")


def test_a_missing_shard_is_named_in_the_training_loop(s3, shards, tmp_path, rclone_server):
    upload_pack(shards, f"{s3}/train")
    rclone_server.delete(f"{s3}/train/shard-000004.tar")
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c")
    with pytest.raises(ObjectNotFoundError, match=rf"{s3}/train/shard-000004.tar: no such object"):
        list(ds)
    mapped = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", map_style=True)
    loader = make_loader(mapped, 4, num_workers=0)
    with pytest.raises(ObjectNotFoundError, match=r"shard-000004.tar: no such object"):
        list(loader)
    assert ds.reader.source.stats.retries == 0  # a missing object is not retried
    mapped.reader.source.close()  # the shards fetched ahead in the background finish first
    assert no_parts(tmp_path / "c")


def test_bad_credentials_name_the_settings(s3, shards, tmp_path, monkeypatch):
    upload_pack(shards, f"{s3}/train")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(CredentialsError, match=r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        open_dataset(f"{s3}/train", cache_dir=tmp_path / "c")


def test_a_cache_too_small_for_a_shard_names_cache_limit(s3, shards, tmp_path):
    upload_pack(shards, f"{s3}/train")
    shard = (shards / "shard-000000.tar").stat().st_size
    index = (shards / "index.npz").stat().st_size
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", cache_limit=index + shard // 2)
    started = time.monotonic()
    with pytest.raises(CacheFullError, match=r"shard-0000\d\d.tar.*cache_limit"):
        list(ds)
    assert time.monotonic() - started < 30  # refused, not retried
    assert no_parts(tmp_path / "c")
    assert ds.reader.source.stats.bytes_fetched == index  # no shard byte was fetched


def test_credentials_never_reach_messages_json_output_or_the_cache(
    s3, shards, tmp_path, monkeypatch, python_env
):
    import os
    import subprocess
    import sys

    upload_pack(shards, f"{s3}/train")
    key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    run = [sys.executable, "-m", "gpufeed"]
    cache = tmp_path / "c"
    for env in ({}, {"AWS_SECRET_ACCESS_KEY": "wrong-Secret-XYZZY"}):
        for cmd in ("verify", "inspect"):
            out = subprocess.run(
                [*run, cmd, f"{s3}/train", "--json", "--cache-dir", str(cache)],
                capture_output=True, text=True, env={**os.environ, **python_env, **env},
                timeout=120,
            )  # fmt: skip
            text = out.stdout + out.stderr
            assert secret not in text and "XYZZY" not in text and key not in text, text
    files = [p for p in cache.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files and not any(secret.encode() in p.read_bytes() for p in files)
