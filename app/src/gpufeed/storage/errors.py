"""What can go wrong between gpufeed and object storage, each as one clear line."""

from __future__ import annotations

from gpufeed.formats.common import DataError, GpufeedError


class StorageError(GpufeedError):
    """Object storage or the local cache failed (after the retries that were due)."""


class ObjectNotFoundError(StorageError):
    """The object (or the bucket) is not there."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket (or container) itself is not there."""


class CredentialsError(StorageError):
    """The store refused the credentials, or found none."""


class CacheFullError(StorageError):
    """The cache cannot hold the file: its disk is full, or cache_limit is too small."""


class ChecksumError(DataError):
    """A fetched file's size or sha256 differs from the pack's manifest."""
