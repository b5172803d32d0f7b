"""``gpufeed.merge`` of parts in object storage: one pack in the bucket, the manifest last.

    gpufeed.merge(["s3://b/run/p0", "s3://b/run/p1"], "s3://b/run/merged")

How: the bucket copies the parts' objects under DEST's prefix itself (S3 CopyObject through
obstore's ``copy``: no sample byte passes through this process), laid out as a local merge
lays out its hard links (gpufeed.write.merge): tar shards renumbered shard-NNNNNN.tar with
one new index.npz; hdf5/lmdb/mmap parts whole under parts/NNNNNN/ (each its manifest too,
listed with its sha256 in the merged manifest, so the merged pack pins what each part was).

Why copies rather than a manifest that points at the parts where they lie: object storage
has no hard link, and a pack whose manifest named objects outside its prefix would break
two rules every reader relies on: a pack's names stay inside it (docs/security.md), and a
pack is one prefix that can be uploaded, copied, replaced or deleted whole (a part deleted
or re-packed after the merge would silently change the merged pack). A copy inside a bucket
is a request per object, not a transfer, and the parts may be deleted after the merge.
The price: S3's CopyObject copies at most 5 GiB an object, so a part file larger than that
is refused before anything is written (write such parts with smaller shards, or as more
parts), and the parts must be in DEST's bucket (a store copies within one bucket).

Everything read is untrusted: each part's manifest is checked (check_manifest; every file
name by unsafe_name's rule, with a size and a sha256), each file it lists must be listed by
the store at that size, and a tar part's index is read and checked by its own reader (as a
local merge does; only index.npz is fetched). Parts whose format, layout version, sample
spec, classes or gpufeed version differ are refused, naming the part.

Crash safety: a manifest already at DEST that is not this merge is deleted first (with
overwrite), the objects are copied, their sizes checked in a listing, and manifest.json is
written last, so a reader sees the old pack, no pack (NotPackedError: "unfinished"), or the
whole merge, never half of one. Merging again finishes an interrupted merge (objects whose
size and ETag already match their source's are not copied again) and returns a finished
one as it is (its manifest records each part's URL, count and manifest digest).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from gpufeed.errors import (
    BucketNotFoundError,
    DataError,
    NotPackedError,
    ObjectNotFoundError,
    StorageError,
    UsageError,
)
from gpufeed.formats import is_multipart
from gpufeed.formats.manifest import MANIFEST_NAME, SOURCES_NAME, check_manifest
from gpufeed.formats.tar.writer import INDEX_NAME
from gpufeed.storage.packs import open_reader_at
from gpufeed.storage.remote import check_remote_name
from gpufeed.storage.retry import RetryPolicy, with_retries
from gpufeed.storage.stats import StorageStats
from gpufeed.storage.store import ObjectStore
from gpufeed.storage.upload import check_destination, check_listed_sizes
from gpufeed.storage.urls import RemoteURL, parse_location
from gpufeed.write.merge_layout import (
    PART_DIR,
    check_agree,
    common_fields,
    index_bytes,
    renumbered_shards,
    tar_layout,
)

__all__ = ["merge_remote"]

# the largest object one S3 CopyObject request copies (a multipart copy would be needed past it)
S3_COPY_LIMIT = 5 << 30
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Part:
    url: RemoteURL
    raw: bytes  # its manifest.json as read: what the merge records and copies
    manifest: dict[str, Any]
    listed: dict[str, tuple[int, str | None]]  # its objects: name -> (size, ETag)


@dataclass
class Plan:
    """What the merged pack is made of: copies (source key, name under DEST), objects
    written from bytes (name -> bytes), and its manifest's files and layout."""

    copies: list[tuple[str, str]]
    puts: dict[str, bytes]
    files: dict[str, dict[str, Any]]
    layout: dict[str, Any]


class _Bucket:
    """The bucket's objects by full key, each request retried on a transient failure."""

    def __init__(self, url: RemoteURL):
        self.store = ObjectStore(RemoteURL(url.scheme, url.bucket, ""))
        self.retry, self.stats = RetryPolicy(), StorageStats()

    def __call__(self, method: str, *args):
        call = getattr(self.store, method)
        return with_retries(lambda: call(*args), self.retry, self.stats)

    def listing(self, url: RemoteURL) -> dict[str, tuple[int, str | None]]:
        """The objects under `url`'s prefix, by name relative to it."""
        head = url.prefix + "/"
        return {k[len(head) :]: v for k, v in self("list_tagged", url.prefix).items()}


def merge_remote(
    parts: list[str],
    dest: str,
    *,
    overwrite: bool = False,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
) -> dict[str, Any]:
    """gpufeed.merge(parts, dest) with every part and DEST in one bucket (module docstring)."""
    top, urls = _locations(parts, dest)
    bucket = _Bucket(top)
    read = [_read_part(bucket, url) for url in urls]
    manifests = [p.manifest for p in read]
    check_agree([str(u) for u in urls], manifests)
    merged_from = [_record(p) for p in read]
    existing = bucket.listing(top)
    done = _finished(bucket, top, existing, merged_from)
    if done is not None:
        return done
    if manifests[0]["format"] == "tar":
        plan = _plan_tar(read, cache_dir, cache_limit)
    else:
        plan = _plan_whole(read)
    names = frozenset(n for _, n in plan.copies) | frozenset(plan.puts)
    check_destination(top, {n: s for n, (s, _) in existing.items()}, overwrite, ours=names)
    _check_copyable(top, plan)
    if MANIFEST_NAME in existing:  # replaced: no reader may take the old manifest for new files
        bucket("delete", top.key(MANIFEST_NAME))
    _write_objects(bucket, top, read, plan, existing)
    listed = {name: size for name, (size, _) in bucket.listing(top).items()}
    sizes = {name: entry["bytes"] for name, entry in plan.files.items()}
    check_listed_sizes(top, sizes, listed, "merge")
    manifest = {"files": plan.files, "layout": plan.layout, **common_fields(manifests, merged_from)}
    bucket("put_bytes", top.key(MANIFEST_NAME), json.dumps(manifest, indent=1).encode())
    _remove_stale(bucket, top, existing, plan.files)
    return manifest


def _locations(parts: list[str], dest: str) -> tuple[RemoteURL, list[RemoteURL]]:
    """DEST and the parts as URLs: one bucket, each part once, none holding or inside DEST."""
    top = parse_location(dest)
    urls = [parse_location(p) for p in parts]
    assert isinstance(top, RemoteURL) and all(isinstance(u, RemoteURL) for u in urls)
    seen: set[str] = set()
    for url in urls:
        if (url.scheme, url.bucket) != (top.scheme, top.bucket):
            raise UsageError(
                f"{url}: not in DEST's bucket ({top.scheme}://{top.bucket}); a merge in object "
                "storage copies objects inside one bucket: write the parts there"
            )
        if url.url in seen:
            raise UsageError(f"{url}: given twice; give each part once")
        seen.add(url.url)
        if _inside(url.prefix, top.prefix) or _inside(top.prefix, url.prefix):
            raise UsageError(f"{url}: a part cannot be, hold or lie inside DEST {top}")
    return top, urls


def _inside(prefix: str, top: str) -> bool:
    """Whether key prefix `prefix` is `top` or lies under it ("" holds every prefix)."""
    return not top or prefix == top or prefix.startswith(top + "/")


def _read_part(bucket: _Bucket, url: RemoteURL) -> Part:
    """The part at `url`: its manifest, checked (a NotPackedError naming it when there is
    none), and its listing, which must hold every file the manifest names at its size."""
    where = url.child(MANIFEST_NAME)
    try:
        raw = bucket("read_bytes", url.key(MANIFEST_NAME))
    except ObjectNotFoundError as e:
        if isinstance(e, BucketNotFoundError):
            raise
        raise NotPackedError(
            f"part {url}: no {MANIFEST_NAME}; not a gpufeed pack, or its upload is unfinished"
        ) from None
    try:
        manifest = check_manifest(json.loads(raw), where)
    except ValueError as e:
        raise DataError(f"{where}: unreadable manifest: {e}") from None
    if is_multipart(manifest):
        raise UsageError(f"{url}: is itself a merged pack of parts; merge its parts instead")
    listed = bucket.listing(url)
    files = manifest.get("files") or {}
    if not files:
        raise DataError(f"{where}: lists no files")
    for name in files:  # every name first: nothing is looked up under an unsafe one
        check_remote_name(url, name)
    for name, entry in files.items():
        _check_entry(url, name, entry, listed)
    return Part(url, raw, manifest, listed)


def _check_entry(url: RemoteURL, name: str, entry: dict, listed: dict) -> None:
    """A part's file entry has a size and a sha256 (the merged pack's cache checks copies by
    it), and the store lists the object at that size."""
    size, sha = entry.get("bytes"), entry.get("sha256")
    if not isinstance(size, int) or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise DataError(
            f"{url.child(MANIFEST_NAME)}: files[{name!r}] lacks bytes or a sha256 "
            "(hex); re-pack or re-upload this part"
        )
    found = listed.get(name, (None, None))[0]
    if found != size:
        state = "is missing" if found is None else f"has {found:,} bytes"
        raise DataError(
            f"{url.child(name)}: {state}, the part's manifest says {size:,} bytes; the part is "
            "incomplete or changed: re-upload it"
        )


def _record(part: Part) -> dict[str, Any]:
    """What names a part in the merged manifest (as a local merge records a path)."""
    digest = hashlib.sha256(part.raw).hexdigest()
    return {"path": part.url.url, "count": part.manifest["count"], "manifest_sha256": digest}


def _finished(bucket: _Bucket, top: RemoteURL, existing: dict, merged_from: list) -> dict | None:
    """The manifest at DEST when it is the finished merge of these parts, else None (after
    removing objects a replaced pack left, when a merge was stopped before doing so)."""
    if MANIFEST_NAME not in existing:
        return None
    try:
        manifest = json.loads(bucket("read_bytes", top.key(MANIFEST_NAME)))
    except (ValueError, StorageError):  # a damaged or vanished manifest: not this merge
        return None
    if not isinstance(manifest, dict) or manifest.get("merged_from") != merged_from:
        return None
    manifest = check_manifest(manifest, top.child(MANIFEST_NAME))
    _remove_stale(bucket, top, existing, manifest.get("files") or {})
    return manifest


def _plan_tar(read: list[Part], cache_dir, cache_limit) -> Plan:
    """tar: each part's shards copied as the merged pack's, numbered on; a new index.npz
    from the parts' indexes, each read and checked by its TarReader through the cache."""
    readers = []
    try:
        for part in read:
            reader = open_reader_at(part.url.url, cache_dir=cache_dir, cache_limit=cache_limit)
            readers.append(reader)
            if reader.manifest != part.manifest:
                raise DataError(f"{part.url}: its manifest changed during the merge; merge again")
        names = renumbered_shards(readers)
        copies, files = [], {}
        for part, reader in zip(read, readers, strict=True):
            for old in reader.shards:
                new = names[len(copies)]
                copies.append((part.url.key(old), new))
                files[new] = _entry(part.manifest["files"][old])
        puts = {INDEX_NAME: index_bytes(readers)}
        sources = _sources(readers)
        if sources is not None:
            puts[SOURCES_NAME] = sources
    finally:
        for reader in readers:
            reader.close()
            reader.source.close()
    files.update({n: _bytes_entry(data) for n, data in puts.items()})
    layout = tar_layout([p.manifest for p in read], names)
    return Plan(copies, puts, dict(sorted(files.items())), layout)


def _sources(readers: list) -> bytes | None:
    """sources.txt of the merged tar pack: the parts' in order, when every part has one
    (each fetched through the cache, so checked against its sha256)."""
    lists = []
    for reader in readers:
        if SOURCES_NAME not in reader.manifest["files"]:
            return None
        path = reader.source.fetch(SOURCES_NAME)
        try:
            lists.append(path.read_bytes())
        finally:
            reader.source.release(SOURCES_NAME)
    return b"".join(d if not d or d.endswith(b"\n") else d + b"\n" for d in lists)


def _plan_whole(read: list[Part]) -> Plan:
    """hdf5, lmdb, mmap: each part copied whole under parts/NNNNNN/ with its manifest (the
    bytes this merge read and checked), read as one pack by MultiPartReader."""
    copies, puts, files, entries = [], {}, {}, []
    for k, part in enumerate(read):
        where = PART_DIR.format(k)
        for name, entry in sorted(part.manifest["files"].items()):
            copies.append((part.url.key(name), f"{where}/{name}"))
            files[f"{where}/{name}"] = _entry(entry)
        puts[f"{where}/{MANIFEST_NAME}"] = part.raw
        files[f"{where}/{MANIFEST_NAME}"] = _bytes_entry(part.raw)
        entries.append({"path": where, "count": part.manifest["count"]})
    return Plan(copies, puts, dict(sorted(files.items())), {"parts": entries})


def _entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {"bytes": int(entry["bytes"]), "sha256": str(entry["sha256"])}


def _bytes_entry(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _check_copyable(top: RemoteURL, plan: Plan) -> None:
    """Refused before anything is written: an object larger than one S3 copy request copies."""
    if top.scheme not in ("s3", "s3a"):
        return
    for name, entry in plan.files.items():
        if name not in plan.puts and entry["bytes"] > S3_COPY_LIMIT:
            source = next(src for src, dst in plan.copies if dst == name)
            raise UsageError(
                f"{top.scheme}://{top.bucket}/{source}: {entry['bytes']:,} bytes, more than "
                f"the {S3_COPY_LIMIT:,} one S3 copy request copies; re-pack that part with "
                "smaller files (tar: shard_bytes; or more, smaller parts), or merge locally "
                "and upload the merged pack"
            )


def _write_objects(bucket: _Bucket, top: RemoteURL, read: list[Part], plan: Plan, existing):
    """The copies (each skipped when DEST already holds its source's bytes: same size and
    ETag, from a merge that was stopped), then the objects written from bytes."""
    sources = {part.url.key(n): v for part in read for n, v in part.listed.items()}
    for src, name in plan.copies:
        size, tag = sources[src]
        if tag is not None and existing.get(name) == (size, tag):
            continue
        bucket("copy", src, top.key(name))
    for name, data in plan.puts.items():
        bucket("put_bytes", top.key(name), data)


def _remove_stale(bucket: _Bucket, top: RemoteURL, existing: dict, files: dict) -> None:
    """Objects under DEST that the merged pack does not list (a replaced pack's), removed
    after its manifest is written."""
    for name in sorted(set(existing) - set(files) - {MANIFEST_NAME}):
        bucket("delete", top.key(name))
