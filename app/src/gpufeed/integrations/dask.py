"""``write_partitions``: a Dask bag or DataFrame written as one gpufeed pack.

    import dask.bag as db
    from gpufeed.integrations.dask import write_partitions
    bag = db.read_text("/shared/captions-*.jsonl").map(json.loads)
    write_partitions(bag, "/shared/caps.pack", format="tar",
                     schema={"image": "jpeg", "caption": "str"}, to_sample=make_sample)

Each partition's task writes its rows as a part, a complete pack, under DEST.parts/ (a
folder every worker writes and the client reads: a shared file system), at a name of that
attempt's own; the computed results (one per partition) name the parts, which the client
merges in partition order into DEST, then removes DEST.parts/. A task that the scheduler
retries (``retries=``) or computes again (a worker lost after it finished) wrote a folder
of its own that is never merged: no sample twice, none missing
(gpufeed.integrations.parts). It runs on the scheduler ``dask.compute`` uses (a
distributed Client when one is active).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import dask

from gpufeed.integrations.parts import PartWriter, merge_parts, parts_folder

__all__ = ["write_partitions"]


def write_partitions(
    collection: Any,
    dest: str | os.PathLike,
    *,
    format: str = "tar",  # noqa: A002 - the public name, as in gpufeed.Writer
    schema: Mapping[str, Any],
    to_sample: Callable[[Any], Mapping[str, Any]] | None = None,
    overwrite: bool = False,
    keep_parts: bool = False,
    compute: Mapping[str, Any] | None = None,
    **writer_options: Any,
) -> dict[str, Any]:
    """Write ``collection`` (a ``dask.bag.Bag`` or ``dask.dataframe.DataFrame``) into a pack
    at ``dest``: a part per partition, merged in partition order (see the module docstring).

    Args:
        collection: a Bag (its elements are samples, dicts) or a DataFrame (its rows are:
            a column a field); anything whose ``to_delayed()`` gives its partitions.
        dest: the pack's folder, on a file system every worker and the client share.
        format: hdf5 | lmdb | tar | mmap.
        schema: the sample schema (gpufeed.formats.schema); required, so every part (an
            empty one too) agrees.
        to_sample: makes a sample dict of an element or row (it runs on the workers).
        overwrite: replace a pack already at ``dest`` (otherwise refused, as gpufeed.merge).
        keep_parts: leave DEST.parts/ after the merge (the merged pack does not need it).
        compute: keyword arguments of ``dask.compute`` (``scheduler=``, ``retries=`` with
            a distributed Client, ...).
        writer_options: more gpufeed.Writer options (compression, shard_size, ...).

    Returns:
        The merged pack's manifest.
    """
    write = PartWriter(str(parts_folder(dest)), format, schema, to_sample, writer_options)
    partitions = collection.to_delayed()
    if not partitions:  # no partition: DEST is a pack of no samples
        results = [write(0, [])]
    else:
        task = dask.delayed(_write_partition, pure=False)
        tasks = [task(write, index, part) for index, part in enumerate(partitions)]
        results = list(dask.compute(*tasks, **dict(compute or {})))
    count = max(len(partitions), 1)
    return merge_parts(results, count, dest, overwrite=overwrite, keep_parts=keep_parts)


def _write_partition(write: PartWriter, index: int, partition: Any) -> dict[str, Any]:
    return write(index, _rows(partition))


def _rows(partition: Any) -> Iterable[Any]:
    """A partition's samples: a pandas DataFrame's rows as dicts, a bag's elements as
    they are."""
    if hasattr(partition, "columns") and hasattr(partition, "to_dict"):
        return partition.to_dict(orient="records")
    return partition
