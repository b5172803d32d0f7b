"""Where a pack's bytes come from: local paths, or object storage through a local cache.

    from gpufeed.storage import open_pack, upload_pack
    upload_pack("/data/train", "s3://bucket/train")              # manifest last
    pack = open_pack("s3://bucket/train", cache_dir="/cache", cache_limit="50GB")
    with pack.fetch_ahead(names_in_sampler_order) as files:       # fetched ahead, in order
        for pin in files:
            read(pin.path); pin.release()                         # evictable again

Modules: urls (local path or URL), store (the obstore client), download (streamed, hashed,
retried), cache (atomic landing, LRU, flock-shared), fetch_ahead (bounded pool ahead of an
order), growing_file (a download readable while in progress), remote (a pack in the store),
upload (a pack into the store). docs/object-storage.md says why.
"""

from gpufeed.errors import (
    BucketNotFoundError,
    CacheFullError,
    ChecksumError,
    CredentialsError,
    ObjectNotFoundError,
    StorageError,
)
from gpufeed.storage.cache import Cache, FileEntry, Pin
from gpufeed.storage.fetch_ahead import FetchAhead
from gpufeed.storage.remote import RemotePack, open_pack
from gpufeed.storage.retry import RetryPolicy
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import ObjectStore
from gpufeed.storage.upload import upload_pack
from gpufeed.storage.urls import RemoteURL, is_remote, parse_location, require_local
from gpufeed.system.sizes import parse_size

__all__ = [
    "BucketNotFoundError",
    "Cache",
    "CacheFullError",
    "ChecksumError",
    "CredentialsError",
    "FileEntry",
    "ObjectNotFoundError",
    "ObjectStore",
    "Pin",
    "FetchAhead",
    "RemotePack",
    "RemoteURL",
    "RetryPolicy",
    "StorageError",
    "StorageStats",
    "is_remote",
    "open_pack",
    "parse_location",
    "parse_size",
    "require_local",
    "upload_pack",
]
