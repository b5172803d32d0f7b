"""Fetch one object into an open file: streamed in small chunks, retried and resumed."""

from __future__ import annotations

from typing import BinaryIO

from gpufeed.errors import ChecksumError
from gpufeed.storage.retry import RetryPolicy
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import ObjectStore, RangeIgnoredError, TransientError


def download(
    store: ObjectStore,
    name: str,
    out: BinaryIO,
    size: int,
    *,
    retry: RetryPolicy,
    stats: StorageStats,
) -> None:
    """Write object `name` (expected to be `size` bytes) to `out`, positioned at 0. A transient
    failure is retried after a backoff, resuming at the byte reached; a server that ignores
    byte ranges gets a fresh download from the start. The caller checks size and checksum."""
    got = 0
    attempt = 0
    while True:
        try:
            for chunk in store.stream(name, start=got):
                got += len(chunk)
                if got > size:
                    raise ChecksumError(
                        f"{store.url.child(name)}: more than the manifest's {size} bytes; "
                        "the object changed after the pack was made: upload the pack again"
                    )
                out.write(chunk)
                stats.add(bytes_fetched=len(chunk))
            return
        except TransientError as e:
            attempt += 1
            retry.after_failure(e, attempt, stats)
            if isinstance(e, RangeIgnoredError):
                got = 0
                out.seek(0)
