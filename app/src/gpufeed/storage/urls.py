"""Local path or object-storage URL: the one rule every command uses to tell them apart.

A string with a scheme (s3://bucket/prefix, gs://, az://, https://) is a URL, never a local
folder: a URL that no local path can serve is an error, not a folder named `s3:`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gpufeed.errors import UsageError

# What the object-store client (obstore) reads; s3a/gcs/azure/abfs(s) are its aliases.
REMOTE_SCHEMES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "adl", "http", "https"}
)
SUPPORTED = "s3://, gs://, az://, https:// or a local path"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.DOTALL)


@dataclass(frozen=True)
class RemoteURL:
    """scheme://bucket/prefix, normalised: no trailing slash, no empty path segments."""

    scheme: str
    bucket: str  # the URL's first part: bucket, container or account, or the host
    prefix: str  # key prefix inside the bucket, "" for the bucket's root

    @property
    def url(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{self.scheme}://{self.bucket}{tail}"

    def key(self, name: str) -> str:
        """The full key of `name` (a file of the pack, relative to the prefix)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def __str__(self) -> str:
        return self.url


def parse_location(where: str | os.PathLike) -> Path | RemoteURL:
    """A local Path, or a RemoteURL; UsageError for a URL gpufeed cannot serve."""
    text = os.fspath(where)
    m = _SCHEME.match(text)
    if m is None or len(m.group(1)) == 1:  # no scheme (a one-letter one is a drive, not ours)
        return Path(text)
    scheme, slashes, rest = m.group(1).lower(), m.group(2), m.group(3)
    if scheme == "file":
        return _file_url(text)
    if scheme not in REMOTE_SCHEMES:
        if len(slashes) >= 2:
            raise UsageError(f"{text}: unsupported URL scheme {scheme}://; use {SUPPORTED}")
        return Path(text)  # "name:with:colons" is a local name
    if len(slashes) < 2:
        raise UsageError(
            f"{text}: looks like a {scheme}:// URL that lost a slash (a pathlib.Path turns "
            f"s3://bucket into s3:/bucket); pass the URL as a string: {scheme}://{rest.lstrip('/')}"
        )
    return _remote(text, scheme)


def _file_url(text: str) -> Path:
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise UsageError(f"{text}: a file:// URL names this machine's files (file:///path)")
    return Path(parts.path)


def _remote(text: str, scheme: str) -> RemoteURL:
    parts = urlsplit(text)
    if not parts.netloc:
        raise UsageError(f"{text}: no bucket; expected {scheme}://BUCKET/PREFIX")
    if parts.query or parts.fragment:
        raise UsageError(f"{text}: a storage URL takes no ?query or #fragment")
    prefix = "/".join(p for p in parts.path.split("/") if p)
    return RemoteURL(scheme, parts.netloc, prefix)


def is_remote(where: str | os.PathLike) -> bool:
    return isinstance(parse_location(where), RemoteURL)


def require_local(where: str | os.PathLike, hint: str = "") -> Path:
    """`where` as a local Path; a URL is a UsageError (with `hint`: what to do instead)."""
    loc = parse_location(where)
    if isinstance(loc, RemoteURL):
        raise UsageError(f"{loc}: needs a local path here" + (f"; {hint}" if hint else ""))
    return loc
