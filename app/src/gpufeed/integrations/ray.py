"""``PackSink``: a Ray Data Datasink that writes a gpufeed pack from a cluster.

    import ray, gpufeed.integrations.ray as gray
    ds = ray.data.read_parquet("s3://bucket/captions/")
    ds.write_datasink(gray.PackSink("/shared/caps.pack", format="tar",
                                    schema={"image": "jpeg", "caption": "str"}))

Each write task writes its blocks as one part, a complete pack of its own, at
DEST.parts/part-<task index> (DEST's file system: shared by every node), with
``gpufeed.Writer(..., overwrite=True)``. A task that fails and is retried by Ray (a worker or
node lost) has the same task index, so the retry replaces what the failed attempt left
(a partial part or a finished one): no sample twice, none missing. When every task is done,
the driver merges the parts in task order into DEST (gpufeed.merge: hard links, no sample
copied) and removes DEST.parts/. Rows are sample dicts (a column a field of ``schema``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    from ray.data import Datasink
    from ray.data.block import BlockAccessor
except ImportError as e:  # said here, once, for gpufeed.ray and this module alike
    raise ImportError(
        f"gpufeed.ray (PackSink) needs Ray Data, which is not installed ({e}); "
        "pip install 'ray[data]'",
        name=e.name,
    ) from e

from gpufeed.write.merge import merge
from gpufeed.write.ownership import remove_tree
from gpufeed.write.writer import Writer

__all__ = ["PackSink"]

PARTS_SUFFIX = ".parts"
PART_NAME = "part-{:06d}"


class PackSink(Datasink):
    """Write a Ray Dataset into a gpufeed pack at ``dest`` (see the module docstring).

    Args:
        dest: the pack's folder, on a file system every node writes (the parts go beside it
            in DEST.parts/, merged into DEST by hard links).
        format: hdf5 | lmdb | tar | mmap.
        schema: the sample schema (gpufeed.formats.schema), e.g. {"image": "jpeg",
            "label": "int"}; every part uses it, so parts always agree.
        keep_parts: leave DEST.parts/ after the merge (the merged pack does not need it).
        overwrite: replace a pack already at DEST (otherwise refused, as gpufeed.merge).
        writer_options: more gpufeed.Writer options (compression, shard_size, ...).
    """

    def __init__(
        self,
        dest: str | os.PathLike,
        *,
        format: str = "tar",  # noqa: A002 - the public name, as in gpufeed.Writer
        schema: Mapping[str, Any],
        keep_parts: bool = False,
        overwrite: bool = False,
        **writer_options: Any,
    ):
        self.dest = Path(dest).absolute()
        self.parts = self.dest.with_name(self.dest.name + PARTS_SUFFIX)
        self.format = format
        self.schema = dict(schema)
        self.keep_parts = keep_parts
        self.overwrite = overwrite
        self.writer_options = writer_options

    def on_write_start(self, schema=None) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)

    def rows(self, blocks: Iterable[Any]) -> Iterable[dict[str, Any]]:
        """The samples of a task's blocks, in order."""
        for block in blocks:
            yield from BlockAccessor.for_block(block).iter_rows(public_row_format=True)

    def write(self, blocks: Iterable[Any], ctx) -> dict[str, Any]:
        """One part: every row of this task's blocks (a retry of the task replaces it)."""
        path = self.parts / PART_NAME.format(ctx.task_idx)
        with Writer(
            path, format=self.format, schema=self.schema, overwrite=True, **self.writer_options
        ) as w:
            for row in self.rows(blocks):
                w.write(row)
        return {"task": int(ctx.task_idx), "path": str(path)}

    def on_write_complete(self, write_result) -> None:
        """Merge the parts in task order into DEST, then remove them (unless keep_parts)."""
        results = sorted(write_result.write_returns, key=lambda r: r["task"])
        paths = [r["path"] for r in results]
        merge(paths, self.dest, overwrite=self.overwrite)
        if not self.keep_parts:
            for path in paths:
                remove_tree(Path(path), "remove a merged part")
            if not any(self.parts.iterdir()):
                self.parts.rmdir()
