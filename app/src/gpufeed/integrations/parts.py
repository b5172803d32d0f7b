"""Parts written by an engine's tasks, merged by its driver: the protocol the Spark and Dask
writers share (gpufeed.integrations.spark, gpufeed.integrations.dask).

Each attempt of a partition's task writes a complete pack of its own under DEST.parts/, at a
name no other attempt uses (part-<partition index>-<random>), through gpufeed.Writer (built
in its NAME.partial, renamed into place when finished), and returns what it wrote as its
task result: {"index", "path", "count"}. An engine hands its driver exactly one result per
partition, that of the attempt it counted; the driver merges those parts in partition order
(gpufeed.merge: hard links, no sample copied) and removes DEST.parts/. A failed attempt, or
a speculative or recomputed copy that finished too, wrote a folder of its own that is never
merged: whatever the engine retried, no sample is there twice and none is missing. (A
fixed name a partition, replaced by each attempt, is not enough: a speculative copy still
running when the job ends could replace the part while the driver merges it.)
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.errors import UsageError
from gpufeed.storage.urls import require_local
from gpufeed.write.merge import merge
from gpufeed.write.ownership import is_pack, is_partial, remove_tree
from gpufeed.write.writer import Writer

__all__ = ["PartWriter", "merge_parts", "parts_folder", "remove_parts"]

PARTS_SUFFIX = ".parts"
PART_NAME = "part-{:06d}-{}"  # partition index, then a random tag of this attempt


def parts_folder(dest: str | os.PathLike) -> Path:
    """Where the parts of the pack at ``dest`` are written: DEST.parts/ beside it (on DEST's
    file system, so the merge links their files instead of copying them). A URL is refused
    here, on the driver, before any task runs."""
    hint = "write to a shared folder, then gpufeed.storage.upload_pack(DEST, URL)"
    dest = require_local(dest, hint).absolute()
    return dest.with_name(dest.name + PARTS_SUFFIX)


@dataclass(frozen=True)
class PartWriter:
    """A partition task's body: ``PartWriter(...)(index, rows)`` writes ``rows`` as one part.

    Args:
        parts: the parts' folder (:func:`parts_folder` of DEST), on a file system every
            worker writes and the driver reads.
        format: hdf5 | lmdb | tar | mmap.
        schema: the sample schema; required, so that every part (an empty one too) has the
            same one and the merge accepts them.
        to_sample: makes a sample dict of a row (None: the rows are sample dicts).
        options: more gpufeed.Writer options (compression, shard_size, ...).
    """

    parts: str
    format: str
    schema: Mapping[str, Any]
    to_sample: Callable[[Any], Mapping[str, Any]] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, index: int, rows: Iterable[Any]) -> dict[str, Any]:
        """Write the partition ``index``'s rows as a part of this attempt's own.

        Returns:
            {"index": index, "path": the part's folder, "count": its samples}.
        """
        path = Path(self.parts) / PART_NAME.format(index, secrets.token_hex(6))
        with Writer(path, format=self.format, schema=self.schema, **self.options) as w:
            for row in rows:
                w.write(row if self.to_sample is None else self.to_sample(row))
        return {"index": int(index), "path": str(path), "count": int(w.manifest["count"])}


def merge_parts(
    results: Sequence[Mapping[str, Any]],
    partitions: int,
    dest: str | os.PathLike,
    *,
    overwrite: bool = False,
    keep_parts: bool = False,
) -> dict[str, Any]:
    """Merge the counted attempts' parts, one per partition ``0..partitions-1``, in that
    order, into ``dest``; then remove DEST.parts/ (unless ``keep_parts``).

    Returns:
        The merged pack's manifest.

    Raises:
        UsageError: a partition without a result or with two (an engine that lost or
            doubled a task's result), naming it.
    """
    paths = _one_part_each(results, partitions)
    manifest = merge(paths, dest, overwrite=overwrite)
    if not keep_parts:
        remove_parts(parts_folder(dest))
    return manifest


def _one_part_each(results: Sequence[Mapping[str, Any]], partitions: int) -> list[str]:
    """The parts' paths in partition order, checked: exactly one result a partition."""
    by_index: dict[int, str] = {}
    for result in results:
        index = int(result["index"])
        if not 0 <= index < partitions:
            raise UsageError(f"a part of partition {index}: there are {partitions} partitions")
        if index in by_index:
            raise UsageError(
                f"partition {index}: two results ({by_index[index]}, {result['path']}); "
                "give each partition's counted attempt only"
            )
        by_index[index] = str(result["path"])
    missing = [k for k in range(partitions) if k not in by_index]
    if missing:
        raise UsageError(f"partitions {missing[:10]}: no part written; rerun the job")
    return [by_index[k] for k in range(partitions)]


def remove_parts(folder: Path) -> None:
    """Remove the parts' folder: every attempt's pack or unfinished NAME.partial in it
    (gpufeed's own, checked by remove_tree); anything else is left, and the folder with it."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for entry in folder.iterdir():
        if is_pack(entry) or is_partial(entry):
            remove_tree(entry, "remove a merged pack's parts")
    if not any(folder.iterdir()):
        folder.rmdir()
