"""Staged parts: what a pack commits before any format file is written.

A part holds the samples read from a fixed range of source items. ``gpufeed.write`` commits
each as one file (parts/part-NNNNNN.npz) and a format writer assembles the committed parts
into its files in one pass (:meth:`gpufeed.formats.base.Writer.add`), after the last part
or, for a fresh tar pack, as each is committed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpufeed.formats.files import fsync_dir, no_space_is_an_error, preallocate
from gpufeed.formats.spec import SampleSpec

__all__ = ["Part"]

# parts larger than this reserve their space before writing (one ENOSPC, before any byte);
# reserving and giving back cost two metadata updates, most of a small part's save
RESERVE_ABOVE = 1 << 20
_ARRAYS = ("payload", "offsets", "labels", "crc32", "items", "exts", "skip_items", "skip_errors")


@dataclass
class Part:
    """A committed slice of the pack: samples read from a fixed range of source items.

    payload is every accepted sample's bytes concatenated; sample j is
    payload[offsets[j]:offsets[j+1]]. Array samples are stored as raw C-order bytes.
    """

    payload: np.ndarray  # uint8 [total]
    offsets: np.ndarray  # int64 [n+1]
    labels: np.ndarray  # int64 [n]
    crc32: np.ndarray  # uint32 [n]
    items: np.ndarray  # int64 [n] source item index of each sample
    exts: np.ndarray  # str [n] file extension to use for the sample (tar member names)
    skip_items: np.ndarray  # int64 [k]
    skip_errors: np.ndarray  # str [k]
    spec: SampleSpec | None  # None when every item in the part was skipped
    # int64 [items in the part's range, 4]: each source file's size, mtime_ns, ctime_ns and
    # inode when read ([.., 2]: size and mtime_ns, parts of older versions; -1 when it could
    # not be stat'ed): a resume re-reads a part whose files changed since
    stamps: np.ndarray | None = None
    # int64 [n, 3]: each sample's (shard, offset, size) in the tar shards a fresh pack streamed
    # (gpufeed.write.assemble.Stream); such a part is saved without its payload (the shard
    # holds it, written once), gpufeed.write.direct reads it back on resume
    where: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def sample(self, j: int) -> memoryview:
        return memoryview(self.payload)[self.offsets[j] : self.offsets[j + 1]]

    def arrays(self) -> dict[str, np.ndarray]:
        spec = self.spec.to_json() if self.spec else None
        arrays = {name: getattr(self, name) for name in _ARRAYS}
        arrays["spec"] = np.array(json.dumps(spec))
        for name in ("stamps", "where"):
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        if self.where is not None:
            arrays["payload"] = np.zeros(0, dtype=np.uint8)
        exts = self.exts
        if len(exts) > 1 and bool((exts == exts[0]).all()):
            arrays["exts"] = exts[:1]  # every sample's the same (load gives each its copy)
        return arrays

    def save(self, path: Path, sync: bool = True) -> None:
        """Write, fsync, rename. The space is reserved first (the arrays' bytes plus room for
        the zip and .npy headers), so a full disk is one DiskFullError naming the part.
        sync=False: no fsync (a kill loses nothing the page cache holds; a part torn by a
        power loss is found by :func:`check_part` when the pack resumes, and redone)."""
        tmp = path.with_name(path.name + ".tmp")
        arrays = self.arrays()
        room = sum(a.nbytes for a in arrays.values()) + 4096 * len(arrays)
        with no_space_is_an_error(tmp, room), open(tmp, "wb") as f:
            if room > RESERVE_ABOVE:  # a small part's write fails whole on a full disk anyway
                preallocate(f, room, tmp)
            np.savez(f, **arrays)
            if room > RESERVE_ABOVE:
                f.truncate(f.tell())  # give back what the headers did not use
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync:
            fsync_dir(path.parent)

    @classmethod
    def load(cls, path: Path) -> Part:
        with np.load(path, allow_pickle=False) as z:
            spec = json.loads(str(z["spec"]))
            arrays = {name: z[name] for name in _ARRAYS}
            if len(arrays["exts"]) == 1 and len(arrays["labels"]) > 1:  # one for every sample
                arrays["exts"] = np.repeat(arrays["exts"], len(arrays["labels"]))
            return cls(
                **arrays,
                spec=SampleSpec.from_json(spec) if spec else None,
                stamps=z["stamps"] if "stamps" in z.files else None,
                where=z["where"] if "where" in z.files else None,
            )
