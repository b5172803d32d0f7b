"""The LMDB format's writer (the layout: gpufeed.formats.lmdb)."""

from __future__ import annotations

import hashlib
import json
import mmap
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import numpy as np

from gpufeed.errors import DataError, DiskFullError
from gpufeed.formats.base import Writer, make_room
from gpufeed.formats.files import is_disk_full
from gpufeed.formats.lmdb.envs import (
    DATA_FILE,
)
from gpufeed.formats.lmdb.keys import CRC_KEY, LABELS_KEY, LOCK_FILE, META_KEY, keys
from gpufeed.formats.lmdb.pages import mapped
from gpufeed.formats.lmdb.values import (
    SNAPSHOT,
    VALUES_FILE,
    fitted_delta,
    paged_table,
    snapshot,
    value_table,
    write_value_table,
)
from gpufeed.formats.npy import npy_bytes
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec

TXN_RECORDS = 4096
TXN_BYTES = 64 << 20
# The map size a pack starts with, doubled whenever it fills. LMDB records it in the file (and
# never lowers it there), so it must not depend on what the writer knew up front: a pack
# written as its parts are committed (gpufeed.write.assemble.Stream) and the same pack
# assembled after a resume are byte-identical. Mapping 1 GiB costs address space, not memory.
FIRST_MAP_SIZE = 1 << 30


class LMDBWriter(Writer):
    format_name = "lmdb"

    def __init__(self, out, spec, count, total_bytes, options):
        super().__init__(out, spec, count, total_bytes, options)
        self.spec = spec or SampleSpec("encoded")
        self.map_size = FIRST_MAP_SIZE
        self.current_file = self.out / DATA_FILE
        # meminit stays on: pages are zeroed before use, so the file's bytes depend only on
        # what was written, and two packs of the same data are byte-identical. sync=True:
        # each transaction's pages are on disk when it is committed, so a resume may read a
        # streamed pack's records back from it (gpufeed.write.direct). metasync=False: its
        # meta page is flushed with the next transaction's pages (one device flush a
        # transaction, not two): a power loss may undo the last transaction, never damage
        # the file (LMDB's MDB_NOMETASYNC), and a resume redoes the parts whose records are
        # missing; finish's env.sync(True) flushes the last one before the manifest is made
        self.env = lmdb.open(
            str(self.out),
            subdir=True,
            map_size=self.map_size,
            meminit=True,
            sync=True,
            metasync=False,
            lock=True,
        )
        rows = count if count is not None else 1024
        self.labels = np.empty(rows, dtype=np.int64)
        self.crcs = np.empty(rows, dtype=np.uint32)
        self.sizes = np.empty(rows, dtype=np.int64)  # what the value table is checked against
        self.n = 0
        self.pending: list[tuple[bytes, memoryview]] = []
        self.pending_bytes = 0

    def _put_all(self, items: list[tuple[bytes, bytes]]) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    txn.cursor().putmulti(items, append=True, dupdata=False, overwrite=False)
                return
            except lmdb.MapFullError:
                self.map_size *= 2
                self.env.set_mapsize(self.map_size)
            except lmdb.Error as e:
                # LMDB reports a full disk as "mdb_txn_commit: Input/output error"
                need = sum(len(v) for _, v in items)
                if is_disk_full(e, self.current_file, need):
                    raise DiskFullError(self.current_file, need) from None
                raise DataError(f"{self.current_file}: {e}") from None

    def abort(self) -> None:
        """Close; the records added so far are committed first when that still works (a
        streamed pack's parts name them: gpufeed.write.direct)."""
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - the write that failed: those parts are redone
            pass
        self.env.close()

    def placed(self, count: int) -> np.ndarray:
        """int64 [count, 3]: the last ``count`` samples' (-1, key index, -1) rows (shard -1:
        a record under an LMDB key, gpufeed.write.direct)."""
        rows = np.full((count, 3), -1, dtype=np.int64)
        rows[:, 1] = np.arange(self.n - count, self.n)
        return rows

    def add(self, part: Part) -> None:
        # Transactions are cut by record count and bytes, never by part: LMDB's file bytes
        # depend on the transaction sequence, and the pack's bytes must not depend on parts.
        make_room(self, ("labels", "crcs", "sizes"), self.n + len(part))
        self.labels[self.n : self.n + len(part)] = part.labels
        self.crcs[self.n : self.n + len(part)] = part.crc32
        offsets = part.offsets
        self.sizes[self.n : self.n + len(part)] = np.diff(offsets)
        names = keys(np.arange(self.n, self.n + len(part)))
        view = memoryview(part.payload)
        j, n = 0, len(part)
        while j < n:
            # the records up to the one that fills the transaction (TXN_RECORDS, TXN_BYTES),
            # as adding them one at a time and flushing when full would cut it
            room = TXN_RECORDS - len(self.pending)
            filled = np.searchsorted(
                offsets[j + 1 : n + 1] - offsets[j], TXN_BYTES - self.pending_bytes
            )
            k = min(n, j + room, j + int(filled) + 1)
            ends = offsets[j : k + 1].tolist()
            self.pending += [
                (names[i], view[a:b])
                for i, a, b in zip(range(j, k), ends[:-1], ends[1:], strict=True)
            ]
            self.pending_bytes += ends[-1] - ends[0]
            self.n += k - j
            j = k
            if len(self.pending) >= TXN_RECORDS or self.pending_bytes >= TXN_BYTES:
                self._flush()
        # no view of the part's payload outlives add (a Writer fills its buffer again): the
        # records carried into the next transaction are copied
        self.pending = [(k, bytes(v)) for k, v in self.pending]

    def _flush(self) -> None:
        if self.pending:
            self._put_all(self.pending)
        self.pending = []
        self.pending_bytes = 0

    def finish(self) -> dict[str, Any]:
        assert self.count is None or self.n == self.count
        self._flush()
        self.labels, self.crcs = self.labels[: self.n], self.crcs[: self.n]
        meta = {
            "format_version": self.spec.format_version,
            "count": self.n,
            "sample": self.spec.to_json(),
            "classes": self.options.get("classes"),
            "key_format": "%010d",
        }
        meta_bytes = json.dumps(meta, sort_keys=True).encode()
        self._put_all(
            [
                (CRC_KEY, npy_bytes(self.crcs)),
                (META_KEY, meta_bytes),
                (LABELS_KEY, npy_bytes(self.labels)),
            ]
        )
        self.env.sync(True)
        files = [DATA_FILE]
        layout = {"key_format": "%010d", "meta_keys": ["__gpufeed__", "__labels__", "__crc32__"]}
        m, data = mapped(self.current_file)
        try:  # the file is final: hashed on a thread (hashlib lets go of the GIL) meanwhile
            with ThreadPoolExecutor(1, thread_name_prefix="gpufeed-lmdb-sha256") as pool:
                digest = pool.submit(_sha256, m)
                found = self._value_table(data)
            digests = {DATA_FILE: digest.result()}
        finally:
            del data  # the map's one export
            _close(m)
        self.env.close()
        if found is not None:
            shot, table = found
            files.append(VALUES_FILE)
            layout[SNAPSHOT] = shot
            digests[VALUES_FILE] = write_value_table(self.out / VALUES_FILE, table)
        (self.out / LOCK_FILE).unlink(missing_ok=True)
        return {"files": files, "layout": layout, "sha256": digests}

    def _value_table(self, data: np.ndarray) -> tuple[dict[str, int], np.ndarray] | None:
        """The value table (lmdb.values) and the snapshot of the environment it describes,
        found while the file is still in memory: from its pages (``data``, a map of the
        file), else by a lookup per record; None where no record is found."""
        if self.n == 0:
            return None
        shot = snapshot(self.env)
        psize = self.env.stat()["psize"]
        table = paged_table(data, psize, shot["txnid"], self.sizes[: self.n])
        with self.env.begin(buffers=True) as txn:
            if table is not None:  # three records where LMDB says, as the reader checks
                at = [0, self.n // 2, self.n - 1]
                if fitted_delta(txn, table, keys(np.array(at)), at) is None:
                    table = None
            if table is None:
                table = value_table(txn, self.n, keys)
        return None if table is None else (shot, table)


def _close(m: mmap.mmap) -> None:
    """Close the map, unless an error on its way out still holds a view of it (its
    traceback's frames): then it is closed when they are collected, and that error, not
    BufferError, is the one raised."""
    try:
        m.close()
    except BufferError:
        pass


def _sha256(m: mmap.mmap) -> str:
    """The file's sha256 from the map its value table is found in (read once, not again
    through a buffer by the manifest's file_entry)."""
    m.madvise(mmap.MADV_SEQUENTIAL)  # read ahead far where its pages are not cached
    return hashlib.sha256(m).hexdigest()


# Blocks read ahead (Reader.read_ahead_ranges). gpufeed appends the records in key order, so
# value i lies about i x stride bytes after value 0 (leaf pages between them): a block's bytes
