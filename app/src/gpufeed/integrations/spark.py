"""``write_partitions``: a Spark DataFrame or RDD written as one gpufeed pack.

    from gpufeed.integrations.spark import write_partitions
    df = spark.read.parquet("/shared/captions/")
    write_partitions(df, "/shared/caps.pack", format="tar",
                     schema={"image": "jpeg", "caption": "str"})

Each partition's task writes its rows as a part, a complete pack, under DEST.parts/ (a
folder every executor writes and the driver reads: a shared file system), at a name of
that attempt's own; the tasks' results (collected by the driver, exactly one per partition:
Spark keeps the counted attempt's) name the parts, which the driver merges in partition
order into DEST, then removes DEST.parts/. A task Spark retries (``spark.task.maxFailures``)
or runs twice (``spark.speculation``) wrote a folder of its own that is never merged: no
sample twice, none missing (gpufeed.integrations.parts). The executors run the Python that
``PYSPARK_PYTHON`` names: gpufeed must be installed there. Classic Spark only: it maps the
partitions of the RDD API, which a Spark Connect session does not have.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from gpufeed.integrations.parts import PartWriter, merge_parts, parts_folder

__all__ = ["write_partitions"]


def write_partitions(
    data: Any,
    dest: str | os.PathLike,
    *,
    format: str = "tar",  # noqa: A002 - the public name, as in gpufeed.Writer
    schema: Mapping[str, Any],
    to_sample: Callable[[Any], Mapping[str, Any]] | None = None,
    overwrite: bool = False,
    keep_parts: bool = False,
    **writer_options: Any,
) -> dict[str, Any]:
    """Write ``data`` (a ``pyspark.sql.DataFrame`` or an RDD) into a pack at ``dest``: a part
    per partition, merged in partition order (see the module docstring).

    Args:
        data: a DataFrame (its rows, ``Row.asDict()``, are samples: a column a field) or an
            RDD (its elements are samples, dicts).
        dest: the pack's folder, on a file system every executor and the driver share.
        format: hdf5 | lmdb | tar | mmap.
        schema: the sample schema (gpufeed.formats.schema), e.g. {"image": "jpeg",
            "caption": "str"}; required, so every part (an empty one too) agrees.
        to_sample: makes a sample dict of a row or element (it runs on the executors);
            None: as said for ``data``.
        overwrite: replace a pack already at ``dest`` (otherwise refused, as gpufeed.merge).
        keep_parts: leave DEST.parts/ after the merge (the merged pack does not need it).
        writer_options: more gpufeed.Writer options (compression, shard_size, ...).

    Returns:
        The merged pack's manifest.
    """
    rdd = data.rdd if hasattr(data, "rdd") else data  # a DataFrame's rows, or the RDD
    if to_sample is None and rdd is not data:
        to_sample = _as_dict
    write = PartWriter(str(parts_folder(dest)), format, schema, to_sample, writer_options)
    partitions = rdd.getNumPartitions()
    if partitions == 0:  # an empty RDD: DEST is a pack of no samples
        results, partitions = [write(0, [])], 1
    else:
        results = rdd.mapPartitionsWithIndex(lambda index, rows: [write(index, rows)]).collect()
    return merge_parts(results, partitions, dest, overwrite=overwrite, keep_parts=keep_parts)


def _as_dict(row: Any) -> dict[str, Any]:
    return row.asDict()
