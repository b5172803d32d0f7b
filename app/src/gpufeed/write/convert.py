"""``gpufeed.pack(fn, inputs, dest)``: a pack made by a function of yours, in parallel.

    def convert(path):                      # one input -> a sample dict (or yield several)
        return {"image": open(path, "rb").read(), "caption": captions[path]}

    gpufeed.pack(convert, paths, "/workspace/caps.lmdb", format="lmdb", workers=8)

``fn(inputs[i])`` runs in worker processes (forked where the platform forks, so ``fn`` may be
a lambda or a closure; spawned elsewhere, where fn and inputs must pickle), a few chunks per
worker in flight (memory stays bounded); each sample is encoded into its record there too.
``inputs`` that are not a Sequence (a generator) are consumed as they are written, never
held whole.
The samples are written in input order through a :class:`~gpufeed.write.writer.Writer`, so
the pack is crash-safe and resumable in the same way: ``resume=True`` keeps the committed
inputs and converts the rest. ``on_error="stop"`` raises a SourceError naming the input (the
partial pack stays resumable); ``"skip"`` leaves the input out and lists it in the
manifest's ``skipped``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from typing import Any

import numpy as np

from gpufeed.errors import PackWorkerError, SourceError, UsageError
from gpufeed.formats.checksums import crc32
from gpufeed.formats.schema import Schema, infer_schema, sniff_image
from gpufeed.storage.urls import is_remote
from gpufeed.write import progress
from gpufeed.write.options import ON_ERROR, positive_int
from gpufeed.write.pool import chunk_inputs, default_workers, die_with_parent
from gpufeed.write.records import encoded
from gpufeed.write.sources import item_name
from gpufeed.write.writer import PART_BYTES, Writer

__all__ = ["as_sample", "pack_function", "pack_in_place"]

CHUNK = 32  # inputs in each of the first chunks a worker converts
_JOB: dict[str, Any] = {}  # in a worker: fn, inputs, schema (set by _start_worker)


def _samples(out: Any) -> list[Mapping]:
    """fn's output: one dict, or an iterable of dicts (a generator yielding several)."""
    if isinstance(out, Mapping):
        return [out]
    if out is None or isinstance(out, (str, bytes)):
        raise UsageError(f"fn returned {type(out).__name__}; return a sample dict or yield dicts")
    return list(out)


def as_sample(obj: Any) -> Mapping:
    """A sample given as itself (``gpufeed.pack(samples, DEST)``): a dict of fields as it
    is; an array or tensor as field ``x``; a pair (array, tensor or image bytes; int) as
    ``x`` (or ``image``) and ``label``. Anything else: say how to name its fields."""
    if isinstance(obj, Mapping):
        return obj
    if _is_array(obj):
        return {"x": obj}
    if isinstance(obj, tuple) and len(obj) == 2 and _is_label(obj[1]):
        value, label = obj
        if _is_array(value):
            return {"x": value, "label": int(label)}
        if isinstance(value, (bytes, bytearray, memoryview)) and sniff_image(bytes(value[:16])):
            return {"image": bytes(value), "label": int(label)}
    raise UsageError(
        f"a sample is a dict of named fields (or an array, or an (array, int label) pair), "
        f"got {type(obj).__name__}: e.g. gpufeed.pack([{{'image': jpeg_bytes, 'caption': "
        "text}, ...], DEST)"
    )


def _is_array(obj: Any) -> bool:
    import torch

    return isinstance(obj, (np.ndarray, np.generic, torch.Tensor))


def _is_label(obj: Any) -> bool:
    return isinstance(obj, (int, np.integer)) and not isinstance(obj, bool)


def _convert(fn, item, schema: Schema) -> tuple:
    """("ok", [(record, label)]) or ("error", message) for one input."""
    try:
        samples = _samples(fn(item))
        return "ok", [encoded(schema, s) for s in samples]
    except Exception as e:  # noqa: BLE001 - any failure of the user's fn is that input's error
        return "error", f"{type(e).__name__}: {e}"


def _add(w: Writer, i: int, fn, item, on_error: str) -> None:
    """Input i converted in-process and encoded by the Writer, whose schema rules then hold
    (taken from the first sample, a partial one completed, an inferred size that varies
    made ragged); a failure of fn or of a sample's encoding is that input's error."""
    try:
        records = w.encode_samples(_samples(fn(item)))
    except Exception as e:  # noqa: BLE001 - as _convert
        _take(w, i, ("error", f"{type(e).__name__}: {e}"), w.item_names, on_error)
        return
    w.add_records(i, records)


def _start_worker(fn, inputs: Sequence | None, schema, parent: int) -> None:
    die_with_parent(parent)
    _JOB.update(fn=fn, inputs=inputs, schema=schema)


def _run(lo: int, hi: int) -> list[tuple]:
    fn, inputs, schema = _JOB["fn"], _JOB["inputs"], _JOB["schema"]
    return [_convert(fn, inputs[i], schema) for i in range(lo, hi)]


def _run_items(items: list) -> list[tuple]:
    """_run for inputs a worker does not hold (an iterable's: sent with the chunk)."""
    fn, schema = _JOB["fn"], _JOB["schema"]
    return [_convert(fn, item, schema) for item in items]


def _numbered(inputs: Iterable, start: int, names: list[str] | None):
    """(i, input) from input ``start`` on, an iterable consumed lazily (never held whole:
    those before ``start`` are read and passed over). ``names``: filled with what each
    path input is called, as they come (others are '#i': gpufeed.write.sources.item_name)."""
    if isinstance(inputs, Sequence):
        yield from ((i, inputs[i]) for i in range(start, len(inputs)))
        return
    for i, item in enumerate(inputs):
        if names is not None and isinstance(item, (str, os.PathLike)):
            names.extend(f"#{j}" for j in range(len(names), i))
            names.append(_name(item, i))
        if i >= start:
            yield i, item


def _results(fn, inputs: Iterable, items, schema: Schema, workers: int, part_size: int):
    """(index, result) for each (index, input) of ``items`` (_numbered), in order; workers
    processes, or in-process. A Sequence's inputs are the workers' own (inherited or sent
    once); an iterable's are sent with each chunk, a bounded number of chunks in flight."""
    if workers <= 1:
        for i, item in items:
            yield i, _convert(fn, item, schema)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    size = [CHUNK]  # inputs a chunk: re-sized from the records that come back
    chunks = _chunks(items, size)
    held = inputs if isinstance(inputs, Sequence) else None
    with ProcessPoolExecutor(
        workers,
        mp_context=mp.get_context(method),
        initializer=_start_worker,
        initargs=(fn, held, schema, os.getpid()),
    ) as ex:

        def submit(chunk: list) -> tuple:
            lo = chunk[0][0]
            if held is not None:
                return lo, ex.submit(_run, lo, lo + len(chunk))
            return lo, ex.submit(_run_items, [item for _, item in chunk])

        pending = deque(submit(c) for c in islice(chunks, workers * 4))
        while pending:
            lo, future = pending.popleft()
            try:
                chunk = future.result()
            except BrokenProcessPool:
                raise PackWorkerError(
                    "a pack worker process died (killed or out of memory); the committed "
                    "inputs are kept: rerun with resume=True"
                ) from None
            size[0], window = _chunking(workers, part_size, chunk)
            for nxt in islice(chunks, max(0, window - len(pending))):
                pending.append(submit(nxt))
            yield from enumerate(chunk, lo)


def _chunks(items, size: list[int]):
    """Lists of consecutive (i, input) from ``items``, each size[0] long when it is made."""
    while True:
        chunk = list(islice(items, size[0]))
        if not chunk:
            return
        yield chunk


def _chunking(workers: int, part_size: int, chunk: list[tuple]) -> tuple[int, int]:
    """(inputs a chunk, chunks in flight), from the record bytes a chunk of inputs gave
    (gpufeed.write.pool.chunk_inputs). The chunks in flight cover one part (while the writer
    commits a part, the workers go on converting the next), but never more than PART_BYTES
    of records (memory stays bounded however large the samples), and at least a couple per
    worker."""
    nbytes = sum(len(sample[0]) for res in chunk if res[0] == "ok" for sample in res[1])
    size = chunk_inputs(nbytes, len(chunk))
    per_input = max(nbytes / max(len(chunk), 1), 1.0)
    by_bytes = int(PART_BYTES // (size * per_input))
    return size, max(workers * 2, min(by_bytes, -(-part_size // size)))


def _name(item: Any, i: int) -> str:
    return os.fspath(item) if isinstance(item, (str, os.PathLike)) else f"#{i}"


def pack_function(
    fn: Callable[[Any], Any],
    inputs: Iterable,
    dest: str | os.PathLike,
    format: str = "hdf5",  # noqa: A002 - the public name
    *,
    schema: Schema | Mapping[str, Any] | None = None,
    workers: int | None = None,
    on_error: str = "stop",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    names: Sequence[str] | None = None,
    **writer_options: Any,
) -> dict[str, Any]:
    """Pack ``fn(input)`` for every input into DEST (see the module docstring); returns the
    manifest. schema: as for Writer (None: from the first sample). workers: processes (None:
    default_workers(); 0 or 1: in-process). names: what sources.txt, errors and skipped
    entries call each input (default: the input if it is a path, else '#i').
    writer_options: compression, shard_size, shard_bytes, container, part_size, classes (as
    Writer takes them: classes=["cat", "dog"] names the labels)."""
    if on_error not in ON_ERROR:
        raise UsageError(f"unknown on_error {on_error!r}; use stop or skip")
    sized = isinstance(inputs, Sequence)  # else an iterable: consumed as it is written
    workers = default_workers() if workers is None else max(0, positive_int("workers", workers))
    if names is not None and sized and len(names) != len(inputs):
        raise UsageError(f"names: {len(names)} for {len(inputs)} inputs")
    w = Writer(
        dest, format, schema, resume=resume, overwrite=overwrite, quiet=quiet, **writer_options
    )
    if names is not None:
        w.item_names = list(names)
    elif sized and any(isinstance(x, (str, os.PathLike)) for x in inputs):
        w.item_names = [_name(x, i) for i, x in enumerate(inputs)]
    elif sized:
        w.item_names = None  # no input has a name: each is '#i' (gpufeed.write.sources)
    else:
        w.item_names = []  # filled as the inputs come (_numbered)
    total = len(inputs) if sized else None
    bar = progress.progress_bar(total, w.inputs_done, quiet, "pack", unit="input")
    with _writing(w, bar):
        sink = None if sized or names is not None else w.item_names
        items = _numbered(inputs, w.inputs_done, sink)
        if workers <= 1:
            for i, item in items:
                _add(w, i, fn, item, on_error)
                bar.update(1)
            return w.close()
        if w.schema is None:  # the first sample says the schema
            for i, item in items:
                _take(w, i, _first(fn, item), w.item_names, on_error)
                bar.update(1)
                if w.schema is not None:
                    break
        for i, result in _results(fn, inputs, items, w.schema, workers, w.state["part_size"]):
            _take(w, i, result, w.item_names, on_error)
            bar.update(1)
        return w.close()


@contextlib.contextmanager
def _writing(w: Writer, bar):
    """A conversion's Writer: left resumable (abandoned, not finished) on any error."""
    try:
        yield
    except BaseException:
        w.abandon()
        raise
    finally:
        bar.close()


def _first(fn, item) -> tuple:
    try:
        samples = _samples(fn(item))
    except Exception as e:  # noqa: BLE001 - as _convert
        return "error", f"{type(e).__name__}: {e}"
    if not samples:
        return "ok", []
    schema = infer_schema(samples[0])
    return "ok", [encoded(schema, s) for s in samples], schema


def _take(w: Writer, i: int, result: tuple, names: Sequence[str], on_error: str) -> None:
    if result[0] == "error":
        if on_error == "stop":
            raise SourceError(
                f"input {i} ({item_name(names, i)}): {result[1]}; the inputs before it are "
                "committed: fix it and rerun with resume=True (gpufeed pack: --resume), or "
                "pass on_error='skip' (--on-error skip)"
            )
        w.skip(i, result[1])
        return
    if len(result) == 3 and w.schema is None:
        w.set_schema(result[2])
    w.add_records(i, result[1])


READ_BATCH = 256


def pack_in_place(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    format: str = "hdf5",  # noqa: A002 - the public name
    *,
    datasets=None,
    index_dir: str | os.PathLike | None = None,
    on_error: str = "stop",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    encode: str = "keep",
    resize=None,
    workers: int | None = None,  # noqa: ARG001 - read in-process: the reads are sequential
    log=None,  # noqa: ARG001 - as pack_files takes it
    follow_symlinks: bool = False,  # noqa: ARG001 - as pack_files takes it
    **writer_options: Any,
) -> dict[str, Any]:
    """Pack data read in place (WebDataset shards, an HDF5 file given ``datasets``, Parquet:
    gpufeed.formats.inplace) into DEST: its records copied as they are read, in order,
    through a Writer (crash-safe, ``resume=True`` goes on after the committed samples)."""
    from gpufeed.formats.open import open_in_place

    if encode != "keep" or resize is not None:
        raise UsageError(
            "--encode raw and --resize apply to image folders, not to shards, HDF5 or Parquet"
        )
    if is_remote(source):  # Parquet or Arrow objects in storage, through the cache
        from gpufeed.storage.parquet_remote import open_parquet_at

        reader = open_parquet_at(source)
    else:
        reader = open_in_place(source, datasets=datasets, index_dir=index_dir)
    if reader is None:
        raise UsageError(
            f"{source}: not WebDataset shards or Parquet (pass datasets= for an HDF5 file)"
        )
    w = Writer(
        dest, format, reader.spec.schema, resume=resume, overwrite=overwrite, quiet=quiet,
        **writer_options,
    )  # fmt: skip
    w.item_names = [f"{reader.location(i)}#{i}" for i in range(reader.count)]
    bar = progress.progress_bar(reader.count, w.inputs_done, quiet, "pack")
    # a reader's unit of I/O (a Parquet row group) read whole: one read a block, not a row
    step = max(READ_BATCH, int(getattr(reader, "preferred_block_size", READ_BATCH)))
    with _writing(w, bar):
        for lo in range(w.inputs_done, reader.count, step):
            hi = min(lo + step, reader.count)
            for i, result in _read_block(reader, lo, hi):
                _take(w, i, result, w.item_names, on_error)
            bar.update(hi - lo)
        return w.close()


def _read_block(reader, lo: int, hi: int):
    """(i, result) for samples lo..hi-1, read in one read_batch; when that fails, one
    sample at a time, so the error is the failing sample's and the others are kept."""
    try:
        records = reader.read_batch(np.arange(lo, hi, dtype=np.int64))
    except Exception:  # noqa: BLE001 - told apart sample by sample below
        yield from ((i, _read_one(reader, i)) for i in range(lo, hi))
        return
    for i, record in enumerate(records, lo):
        yield i, ("ok", [(record, int(reader.labels[i]), crc32(record))])


def _read_one(reader, i: int) -> tuple:
    try:
        record = reader.read_batch(np.array([i], dtype=np.int64))[0]
    except Exception as e:  # noqa: BLE001 - a sample that cannot be read is that input's error
        return "error", f"{type(e).__name__}: {e}"
    return "ok", [(record, int(reader.labels[i]), crc32(record))]
