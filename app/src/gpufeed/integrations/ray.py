"""``PackSink``: a Ray Data Datasink that writes a gpufeed pack from a cluster.

    import ray, gpufeed.integrations.ray as gray
    ds = ray.data.read_parquet("s3://bucket/captions/")
    ds.write_datasink(gray.PackSink("/shared/caps.pack", format="tar",
                                    schema={"image": "jpeg", "caption": "str"}))

Each write task writes its blocks as one part, a complete pack of its own, under DEST.parts/
(DEST's file system: shared by every node), at a name of its attempt's own, and the driver
merges one part a task, in task order, into DEST (hard links, no sample copied), then removes
DEST.parts/: the protocol the Spark and Dask writers share (gpufeed.integrations.parts), so a
task that Ray retries (a worker or node lost) leaves no sample twice and none missing. Rows
are sample dicts (a column a field of ``schema``).
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

from gpufeed.integrations.parts import PartWriter, merge_parts, parts_folder

__all__ = ["PackSink"]


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
        self.parts = parts_folder(self.dest)
        self.keep_parts = keep_parts
        self.overwrite = overwrite
        self.part = PartWriter(str(self.parts), format, dict(schema), options=writer_options)

    def on_write_start(self, schema=None) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)

    def rows(self, blocks: Iterable[Any]) -> Iterable[dict[str, Any]]:
        """The samples of a task's blocks, in order."""
        for block in blocks:
            yield from BlockAccessor.for_block(block).iter_rows(public_row_format=True)

    def write(self, blocks: Iterable[Any], ctx) -> dict[str, Any]:
        """One part: every row of this task's blocks, at a name of this attempt's own."""
        return self.part(ctx.task_idx, self.rows(blocks))

    def on_write_complete(self, write_result) -> None:
        """Merge one part a task, in task order, into DEST; then remove DEST.parts/ (unless
        keep_parts)."""
        results = write_result.write_returns
        merge_parts(
            results, len(results), self.dest, overwrite=self.overwrite, keep_parts=self.keep_parts
        )
