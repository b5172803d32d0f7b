"""The object-store client: one small interface over obstore for s3://, gs://, az://, https://.

Why obstore (docs/object-storage.md has the numbers): measured side by side against s3fs and
boto3 on the same server, it lists and answers small ranged reads fastest and, alone of the
three, speaks S3, GCS, Azure and plain HTTP through one library.

Settings come from the standard places, read by the libraries themselves:
  - AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_REGION,
    AWS_ENDPOINT_URL (and AWS_ENDPOINT_URL_S3): read by obstore;
  - otherwise AWS_PROFILE and ~/.aws/config + ~/.aws/credentials (profiles, SSO, role
    chains, the profile's endpoint_url and region): resolved by botocore when installed;
  - otherwise web identity (Kubernetes IRSA), ECS and EC2 instance roles: obstore;
  - GOOGLE_* / AZURE_* variables for gs:// and az://: obstore.
An http:// endpoint is allowed when the user configured one (a local MinIO or rclone).

The client is created lazily in the process that uses it, so a store object can be made in a
DataLoader's parent and used in spawned workers. A forked one cannot use it once the parent
has: obstore runs every request on one tokio runtime per process, made on first use, whose
threads do not survive a fork (tokio-rs/tokio#4301); a forked child's requests would wait for
ever. So a forked child fetches pack files through a helper process (storage/helper.py), and
a direct request from it raises StorageError instead of hanging.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpufeed.errors import (
    BucketNotFoundError,
    CredentialsError,
    ObjectNotFoundError,
    StorageError,
)
from gpufeed.storage.urls import RemoteURL

# bytes per read; larger ones cost obstore more CPU (docs/performance/object-storage-fetch.md)
STREAM_CHUNK = 64 << 10
MULTIPART_CHUNK = 16 << 20  # upload part size (S3 needs >= 5 MiB parts)
MULTIPART_CONCURRENCY = 4
CREDENTIAL_HELP = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS store), "
    "or AWS_PROFILE with ~/.aws/config"
)
_client_pid: int | None = None  # the process that made an obstore client (started its runtime)
# obstore clients of this process by URL, options and the settings environment: making one
# (its HTTP client and TLS roots) is not free, and opening a pack by URL made two (the
# manifest, then the reader; docs/performance/object-storage-fetch.md)
_clients: dict[tuple[str, str, str], Any] = {}
_SETTINGS_ENV = ("AWS_", "GOOGLE_", "AZURE_")
MAX_CLIENTS = 16


def forked_from_a_client() -> bool:
    """Whether this process was forked from one that made an obstore client, so it cannot
    make one (its fetches go through storage/helper.py)."""
    return _client_pid is not None and _client_pid != os.getpid()


def _check_not_forked(url: RemoteURL) -> None:
    if forked_from_a_client():
        raise StorageError(
            f"{url}: this process was forked from one (pid {_client_pid}) that had used object "
            "storage; obstore's tokio runtime does not survive a fork, so requests here would "
            "hang. Fetch pack files through RemotePack.fetch (it uses a helper process), or "
            "start the process with multiprocessing_context='spawn'"
        )


class TransientError(StorageError):
    """A failure worth retrying: connection reset or refused, timeout, 5xx."""


class RangeIgnoredError(TransientError):
    """The server answered a ranged GET with the whole object (200, not 206)."""


class ObjectStore:
    """Objects under one URL prefix; names are relative to it (e.g. "shard-000001.tar")."""

    def __init__(self, url: RemoteURL, *, options: dict[str, Any] | None = None):
        self.url = url
        self.options = dict(options or {})
        self._pid = -1
        self._store = None

    def __getstate__(self):
        return {"url": self.url, "options": self.options, "_pid": -1, "_store": None}

    @property
    def store(self):
        global _client_pid
        if self._pid != os.getpid():
            _check_not_forked(self.url)
            if _client_pid != os.getpid():
                _clients.clear()  # a spawned or forked process's own clients only
            env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS_ENV))
            key = (self.url.url, repr(sorted(self.options.items())), repr(env))
            if key not in _clients:
                if len(_clients) >= MAX_CLIENTS:
                    _clients.clear()
                _clients[key] = _make_store(self.url, self.options)
            self._store = _clients[key]
            self._pid = _client_pid = os.getpid()
        return self._store

    def read_bytes(self, name: str) -> bytes:
        obstore = _obstore(self.url)

        with _errors(self.url.child(name)):
            return bytes(obstore.get(self.store, name).bytes())

    def stream(self, name: str, start: int = 0) -> Iterator[memoryview]:
        """The object's bytes from `start` on, in chunks of about STREAM_CHUNK."""
        obstore = _obstore(self.url)

        where = self.url.child(name)
        with _errors(where):
            options = {"range": {"offset": start}} if start else None
            result = obstore.get(self.store, name, options=options)
            chunks = result.stream(min_chunk_size=STREAM_CHUNK)
        while True:
            with _errors(where):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield memoryview(chunk)

    def list(self, prefix: str = "") -> dict[str, int]:
        """name -> size of every object under `prefix` (relative to the store's URL)."""
        obstore = _obstore(self.url)

        with _errors(self.url.child(prefix)):
            return {
                m["path"]: int(m["size"])
                for batch in obstore.list(self.store, prefix or None)
                for m in batch
            }

    def list_tagged(self, prefix: str = "") -> dict[str, tuple[int, str | None]]:
        """name -> (size, ETag) of every object under `prefix` (the ETag: None when the store
        gives none)."""
        obstore = _obstore(self.url)

        with _errors(self.url.child(prefix)):
            return {
                m["path"]: (int(m["size"]), m.get("e_tag") or None)
                for batch in obstore.list(self.store, prefix or None)
                for m in batch
            }

    def copy(self, src: str, dst: str) -> None:
        """Object `src` copied to `dst` by the store itself (S3 CopyObject: no byte passes
        through this process); an object at `dst` is replaced."""
        obstore = _obstore(self.url)

        with _errors(self.url.child(src)):
            obstore.copy(self.store, src, dst, overwrite=True)

    def put_file(self, name: str, path: str | os.PathLike) -> None:
        """Upload a local file; multipart (in MULTIPART_CHUNK parts) above one part's size."""
        obstore = _obstore(self.url)

        with _errors(self.url.child(name)):
            obstore.put(
                self.store,
                name,
                Path(path),
                chunk_size=MULTIPART_CHUNK,
                max_concurrency=MULTIPART_CONCURRENCY,
            )

    def put_bytes(self, name: str, data: bytes) -> None:
        obstore = _obstore(self.url)

        with _errors(self.url.child(name)):
            obstore.put(self.store, name, data)

    def delete(self, name: str) -> None:
        obstore = _obstore(self.url)

        with _errors(self.url.child(name)):
            obstore.delete(self.store, name)


def _obstore(url: RemoteURL):
    """The obstore module, or an error saying which extra installs it (not a traceback)."""
    try:
        import obstore
    except ImportError:
        raise StorageError(
            f"{url}: object storage needs the obstore package, which is not installed: "
            "pip install 'gpufeed[s3]'"
        ) from None
    return obstore


def _make_store(url: RemoteURL, options: dict[str, Any]):
    _obstore(url)
    from obstore.store import from_url

    kwargs: dict[str, Any] = {
        # gpufeed retries itself (storage/download.py): each retry is counted and resumes
        "retry_config": {"max_retries": 0, "retry_timeout": timedelta(seconds=60)},
        "client_options": {"connect_timeout": "10s", "read_timeout": "60s", **options},
    }
    if url.scheme in ("s3", "s3a"):
        kwargs.update(_aws_settings(url))
    if url.scheme == "http" or _endpoint(kwargs).startswith("http://"):
        kwargs["client_options"]["allow_http"] = True
    with _errors(str(url)):
        return from_url(url.url, **kwargs)


def _endpoint(kwargs: dict[str, Any]) -> str:
    return str(
        kwargs.get("config", {}).get("endpoint")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or ""
    )


def _aws_settings(url: RemoteURL) -> dict[str, Any]:
    """Credentials, region and endpoint from a profile, when the environment names no keys."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return {}  # obstore reads the AWS_* variables itself
    try:
        import botocore.session
    except ImportError:
        if os.environ.get("AWS_PROFILE"):
            raise CredentialsError(
                f"{url}: AWS_PROFILE={os.environ['AWS_PROFILE']} needs botocore to read "
                "~/.aws/config; pip install 'gpufeed[s3]'"
            ) from None
        return {}  # web identity / ECS / EC2 roles: obstore's own chain
    return _profile_settings(botocore.session.Session(), url)


def _profile_settings(session, url: RemoteURL) -> dict[str, Any]:
    try:
        credentials = session.get_credentials()
        scoped = session.get_scoped_config()
    except Exception as e:  # botocore.exceptions.ProfileNotFound and its kin
        raise CredentialsError(f"{url}: {e}; {CREDENTIAL_HELP}") from None
    config: dict[str, Any] = {}
    region = session.get_config_variable("region")
    if region:
        config["region"] = region
    s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
    endpoint = s3_section.get("endpoint_url") or scoped.get("endpoint_url")
    if endpoint and not os.environ.get("AWS_ENDPOINT_URL"):
        config["endpoint"] = endpoint
    if credentials is None:
        return {"config": config} if config else {}
    from obstore.auth.boto3 import Boto3CredentialProvider

    return {"config": config, "credential_provider": Boto3CredentialProvider(session)}


class _errors:
    """Turn the library's exceptions into gpufeed's, each naming the object and what to do."""

    def __init__(self, where: str):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, etype, exc, tb):
        if exc is None or isinstance(exc, StorageError):
            return False
        mapped = translate(exc, self.where)
        if mapped is None:
            return False
        raise mapped from exc


def translate(exc: BaseException, where: str) -> StorageError | None:
    """gpufeed's error for a library exception (None: not a storage failure, re-raise it)."""
    from obstore import exceptions as ox

    text = str(exc).split("\n\nDebug source:")[0]
    status, code = _status(text)
    if code == " NoSuchBucket":
        return BucketNotFoundError(f"{where}: the bucket does not exist (NoSuchBucket)")
    if isinstance(exc, ox.NotFoundError | FileNotFoundError) or status == 404:
        return ObjectNotFoundError(f"{where}: no such object in the store{code}")
    if isinstance(exc, ox.PermissionDeniedError | ox.UnauthenticatedError) or status in (401, 403):
        return CredentialsError(
            f"{where}: the store refused the credentials ({status}{code}); {CREDENTIAL_HELP}"
        )
    if "non-partial response" in text:
        return RangeIgnoredError(f"{where}: the server ignored a byte range (answered 200)")
    if "credential" in text.lower() or "missing region" in text.lower():
        return CredentialsError(f"{where}: {text}; {CREDENTIAL_HELP}")
    if status is not None and status < 500 and status != 429:
        return StorageError(f"{where}: the store answered {status}{code}")
    if isinstance(exc, ox.BaseError | OSError):  # 5xx, 429, reset, refused, timed out
        return TransientError(f"{where}: {text.splitlines()[0]}")
    return None


def _status(text: str) -> tuple[int | None, str]:
    """The HTTP status and the S3 error code (as " NoSuchKey") a library message reports."""
    m = re.search(r"status code: (\d{3})", text)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    return (int(m.group(1)) if m else None), (f" {code.group(1)}" if code else "")
