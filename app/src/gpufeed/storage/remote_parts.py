"""A merged pack of parts (hdf5, lmdb, mmap: layout.parts) read from object storage.

A merged pack in a bucket (gpufeed.write.merge_remote) is one prefix: its manifest lists
every part's files under parts/NNNNNN/ (each part's manifest.json too, with its sha256).
Each part is read by its format's own reader, as in a local merged pack (MultiPartReader),
its files coming through the merged pack's cache (PartFiles: the part's names with its
folder in front), so a file is fetched when a part first reads it, checked against the
merged manifest's sha256, and shared by every process through the cache.
"""

from __future__ import annotations

import json
from typing import Any

from gpufeed.errors import DataError
from gpufeed.formats.base import Reader
from gpufeed.formats.manifest import MANIFEST_NAME, check_manifest
from gpufeed.formats.multipart import MultiPartReader
from gpufeed.storage.retry import with_retries

__all__ = ["PartFiles", "RemoteMultiPartReader"]


class PartFiles:
    """One part's files for its reader: a remote pack's files (packs.RemoteFiles) under the
    part's folder, by the names the part's manifest gives them."""

    def __init__(self, files, folder: str):
        self.files = files
        self.folder = folder

    def _name(self, name: str) -> str:
        return f"{self.folder}/{name}"

    @property
    def pack(self):
        return self.files.pack

    @property
    def url(self):
        return self.files.url

    @property
    def stats(self):
        return self.files.stats

    def manifest(self) -> dict[str, Any]:
        """The part's manifest.json, checked as any manifest: fetched through the cache, so
        checked against the merged manifest's sha256, when that lists it (a merge made in
        the bucket); read from the store when it does not (a local merge uploaded whole,
        whose manifest lists the parts' data files only: the reader checks the part against
        the merged manifest, as for a local merged pack)."""
        name = self._name(MANIFEST_NAME)
        where = self.url.child(name)
        if name in self.pack.entries:
            path = self.fetch(MANIFEST_NAME)
            try:
                raw = path.read_bytes()
            finally:
                self.release(MANIFEST_NAME)
        else:
            store, pack = self.pack.store, self.pack
            raw = with_retries(lambda: store.read_bytes(name), pack.retry, pack.stats)
        try:
            return check_manifest(json.loads(raw), where)
        except ValueError as e:
            raise DataError(f"{where}: unreadable manifest: {e}") from None

    def check_name(self, name: str) -> None:
        self.files.check_name(self._name(name))

    def fetch(self, name: str):
        return self.files.fetch(self._name(name))

    def release(self, name: str) -> None:
        self.files.release(self._name(name))

    def warm(self, names: list[str]) -> None:
        self.files.warm([self._name(n) for n in names])

    def landing(self, name: str):
        return self.files.landing(self._name(name))

    def pin_budget(self) -> int:
        return self.files.pin_budget()

    def fetch_ahead(self, names: list[str], *, workers: int, ahead: int):
        return self.files.fetch_ahead([self._name(n) for n in names], workers=workers, ahead=ahead)

    def close(self) -> None:
        self.files.close()


class RemoteMultiPartReader(MultiPartReader):
    """MultiPartReader over a remote merged pack: made by ``with_source`` (a RemoteFiles of
    the merged pack), each part's reader made with a PartFiles of it."""

    def _open_part(self, cls, k: int, path: str, count: int, options: dict) -> Reader:
        files = PartFiles(self.source, path)
        part_manifest = files.manifest()
        self._check_part(k, path, part_manifest, count)
        return cls.with_source(files, self.root / path, part_manifest, **options)
