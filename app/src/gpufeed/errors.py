"""Every error and warning gpufeed raises on purpose, in one place.

Errors are one clear line: what was expected, what was found (naming the file, sample or
setting) and what to do. ``exit_code`` is the ``gpufeed`` command's exit status for each.

    GpufeedError                 base of everything below
      UsageError                 the call is wrong (a bad option, an existing destination): 2
      DataError                  the data is wrong: 1
        SourceError              a source file cannot be read or decoded while packing
        CorruptSampleError       a stored sample fails its checksum or does not decode
        NotPackedError           not a finished pack (no manifest, or a partial one)
        DiskFullError            a write ran out of space (names the file)
        StalePackError           a pack's files changed after a reader opened it
        UnsafePathError          a manifest names a path outside the pack, or a non-file
        PackWorkerError          the pack's worker pool broke (the pack stays resumable)
        ChecksumError            a fetched file differs from the manifest
      StorageError               object storage or its local cache failed
        ObjectNotFoundError, BucketNotFoundError, CredentialsError, CacheFullError

Warnings: ShmBudgetWarning (/dev/shm too small for the planned workers), SysinfoWarning (a
cgroup file could not be read), ShardSplitWarning (whole shards split unevenly over workers
or ranks), TunedBatchSizeWarning (loader settings tuned at another batch size).
"""

from __future__ import annotations

import os

from gpufeed.system.disk import free_bytes


class GpufeedError(Exception):
    """Base of the errors gpufeed reports as one clear line."""

    exit_code = 1


class UsageError(GpufeedError):
    """The call itself is wrong (bad option, existing destination): exit code 2."""

    exit_code = 2


class DataError(GpufeedError):
    """The data is wrong (unreadable source file, corrupt record, failed verification)."""


class SourceError(DataError):
    """A source file could not be read or decoded while packing."""


class CorruptSampleError(DataError):
    """A stored sample does not match its checksum or does not decode."""

    def __init__(
        self, path: str | os.PathLike, index: int, problem: str, source: str | None = None
    ):
        self.path = str(path)
        self.index = int(index)
        self.problem = problem
        self.source = source
        where = f"sample {self.index}" + (f" (source {source})" if source else "")
        super().__init__(f"{self.path}: {where}: {problem}")


class NotPackedError(DataError):
    """The path is not a finished gpufeed dataset (no manifest, or a partial pack)."""


class DiskFullError(DataError):
    """A write ran out of space (or quota): names the file and what is free where."""

    def __init__(self, path: str | os.PathLike, need: int | None = None):
        self.path = str(path)
        free = free_bytes(self.path)
        needed = f" (needs about {need:,} more bytes)" if need else ""
        super().__init__(
            f"{self.path}: no space left on device{needed}; {free:,} bytes free there. "
            "Free some space (or pack to another disk); completed parts are kept, "
            "continue with --resume"
        )


class StalePackError(DataError):
    """A pack's files were replaced or changed after a reader of it was opened."""


class UnsafePathError(DataError):
    """A manifest names a path that leaves the pack, or something that is not a regular file."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{self.path}: {reason}")


class PackWorkerError(DataError):
    """The worker pool broke: the pack stops, its committed parts stay resumable."""


class ChecksumError(DataError):
    """A fetched file's size or sha256 differs from the pack's manifest."""


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


class ShmBudgetWarning(UserWarning):
    """/dev/shm is too small for the planned workers: they would die with "Bus error"."""


class SysinfoWarning(UserWarning):
    """A cgroup or /dev/shm file could not be read; the value it would give is ignored."""


class ShardSplitWarning(UserWarning):
    """A tar stream split by whole shards (``split="shards"``) is uneven: some workers get no
    shard (they idle), or ranks get different sample counts (DDP would wait on the shortest)."""


class TunedBatchSizeWarning(UserWarning):
    """A loader settings file tuned at one batch size is applied at another: its worker count
    and prefetch were measured for the batch size it names."""
