"""Committing parts: the source read in fixed ranges of items, each range saved as one
staged part (parts/part-NNNNNN.npz, gpufeed.formats.parts) that a resume keeps.

A fresh tar or LMDB pack writes each sample once: into the format's files as its part is
committed (gpufeed.write.assemble.Stream), the part keeping only where each sample is
(Part.where), not fsynced; a resume checks every such part against the streamed files by its
crc32s (gpufeed.write.direct) and redoes the parts that do not check. Other parts hold
their samples' bytes and are fsynced. A resume redoes the parts that are missing, and reads
again a part any of whose source files changed since it was committed, so the pack cannot
depend on where a run stopped.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gpufeed.errors import SourceError
from gpufeed.formats.inplace.tree import Source
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec
from gpufeed.write import progress
from gpufeed.write.direct import check_part
from gpufeed.write.items import STAMP_FIELDS, stamp_changed
from gpufeed.write.options import positive_int
from gpufeed.write.pool import default_workers, ordered_map

__all__ = [
    "PartBuilder",
    "commit_parts",
    "drop_changed_parts",
    "drop_torn_parts",
    "first_spec",
    "items_of",
    "part_path",
    "say_resumed",
    "spec_text",
]


def spec_text(spec: dict) -> str:
    if spec["kind"] != "array":
        return "encoded bytes"
    return "x".join(str(s) for s in spec["shape"]) + " " + np.dtype(spec["dtype"]).name


class PartBuilder:
    """One part's samples and skips, gathered item by item, then built into a Part."""

    def __init__(self):
        self.payloads: list[bytes] = []
        self.labels: list[int] = []
        self.crcs: list[int] = []
        self.items: list[int] = []
        self.exts: list[str] = []
        self.skip_items: list[int] = []
        self.skip_errors: list[str] = []
        self.stamps: list[tuple[int, ...]] = []
        self.spec: dict | None = None

    def add(self, i: int, result: tuple, spec: dict | None, src: Source):
        """Take source item ``i``'s load_item ``result``: (the pack's sample spec so far, the
        error that keeps the item out, or None when it was added)."""
        self.stamps.append(result[1])
        if result[0] == "error":
            return spec, result[2]
        payload, item_spec, ext, crc = result[2:6]
        if spec is None:
            spec = item_spec
        elif item_spec != spec:
            hint = " (try --encode keep or --resize)" if src.kind != "arrays" else ""
            return spec, (
                f"sample is {spec_text(item_spec)}, but earlier samples are "
                f"{spec_text(spec)}; every sample must match" + hint
            )
        self.payloads.append(payload)
        self.labels.append(int(src.labels[i]))
        self.crcs.append(crc)
        self.items.append(i)
        self.exts.append(ext)
        self.spec = self.spec or spec
        return spec, None

    def skip(self, i: int, error: str) -> None:
        self.skip_items.append(i)
        self.skip_errors.append(error)

    def build(self) -> Part:
        sizes = np.fromiter(
            (len(p) for p in self.payloads), dtype=np.int64, count=len(self.payloads)
        )
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        payload = np.frombuffer(b"".join(self.payloads), dtype=np.uint8)
        return Part(
            payload=payload,
            offsets=offsets,
            labels=np.asarray(self.labels, dtype=np.int64),
            crc32=np.asarray(self.crcs, dtype=np.uint32),
            items=np.asarray(self.items, dtype=np.int64),
            exts=np.asarray(self.exts, dtype="<U8"),
            skip_items=np.asarray(self.skip_items, dtype=np.int64),
            skip_errors=np.asarray(self.skip_errors, dtype=str),
            spec=SampleSpec.from_json(self.spec) if self.spec else None,
            stamps=np.asarray(self.stamps, dtype=np.int64).reshape(-1, len(STAMP_FIELDS)),
        )


def part_path(parts_dir: Path, p: int) -> Path:
    return parts_dir / f"part-{p:06d}.npz"


def first_spec(parts_dir: Path, nparts: int) -> dict | None:
    for p in range(nparts):
        path = part_path(parts_dir, p)
        if path.exists():
            with np.load(path) as z:
                spec = json.loads(str(z["spec"]))
            if spec:
                return spec
    return None


def items_of(p: int, part_size: int, n: int) -> range:
    return range(p * part_size, min((p + 1) * part_size, n))


def drop_torn_parts(parts_dir: Path, nparts: int, partial: Path, say) -> None:
    """On resume: a kept part that does not read back whole, or whose samples (in the part,
    or in the streamed files its Part.where names) do not match their crc32s, is redone.
    Parts are fixed ranges of source items: each one is checked, and redone, on its own."""
    torn = [
        p
        for p in range(nparts)
        if part_path(parts_dir, p).exists() and check_part(part_path(parts_dir, p), partial) is None
    ]
    for p in torn:
        part_path(parts_dir, p).unlink()
    if torn:
        more = f" (and {len(torn) - 1} more)" if len(torn) > 1 else ""
        say(f"{part_path(parts_dir, torn[0]).name}{more}: torn or its samples lost; reading again")


def drop_changed_parts(src: Source, parts_dir: Path, nparts: int, part_size: int, say) -> None:
    """On resume: a committed part any of whose source files changed (size, mtime, ctime or
    inode: gpufeed.write.items.stamp) since it was read is read again, never kept stale.
    Parts of older gpufeeds (no stamps) are kept."""
    for p in range(nparts):
        path = part_path(parts_dir, p)
        if not path.exists():
            continue
        with np.load(path) as z:
            stamps = z["stamps"] if "stamps" in z.files else None
        if stamps is None:
            continue
        items = items_of(p, part_size, len(src))
        if len(stamps) != len(items):  # not what this part's range records: read again
            changed = list(items)
        else:
            changed = [
                i
                for i, was in zip(items, stamps.tolist(), strict=True)
                if stamp_changed(src.paths[i], was)
            ]
        if changed:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            say(
                f"{src.paths[changed[0]]}{more}: changed since it was read; reading "
                f"{path.name} again"
            )
            path.unlink()


def say_resumed(parts_dir: Path, nparts: int, part_size: int, count: int, say) -> None:
    """What a resume keeps (committed parts whose files did not change) and what it reads
    (again), in one line."""
    kept = [p for p in range(nparts) if part_path(parts_dir, p).exists()]
    items = sum(len(items_of(p, part_size, count)) for p in kept)
    say(
        f"resuming: {len(kept)} of {nparts} part(s) kept ({items} of {count} source files, "
        f"as committed earlier); {nparts - len(kept)} part(s) to read"
    )


# image sizes commit_parts keeps: enough to show that they vary (mixed_sizes_message)
_MAX_SIZES = 4


def _note_size(sizes: list[tuple[int, int]], result: tuple) -> None:
    """Add a load_item result's image size (kept encoded) to ``sizes``, if new and there is
    room (_MAX_SIZES)."""
    size = result[6] if result[0] == "ok" else None
    if size is not None and size not in sizes and len(sizes) < _MAX_SIZES:
        sizes.append(size)


def commit_parts(src, parts_dir, nparts, part_size, load_opts, workers, on_error, quiet, stream):
    """Read every part not committed yet, hand it to ``stream`` (gpufeed.write.assemble.Stream:
    the format's files written as the parts come) and commit it, in a thread of its own
    while the next part's items are read (one part at a time, in order).

    Returns:
        The (height, width) sizes of the images kept encoded among the items read (up to
        _MAX_SIZES, in the order seen): more than one says the pack's image sizes vary.
    """
    for tmp in parts_dir.glob("*.tmp"):
        tmp.unlink()
    todo = [p for p in range(nparts) if not part_path(parts_dir, p).exists()]
    done_items = sum(
        min(part_size, len(src) - p * part_size) for p in range(nparts) if p not in set(todo)
    )
    sizes: list[tuple[int, int]] = []
    if not todo:
        return sizes
    spec = first_spec(parts_dir, nparts)
    auto = workers is None
    workers = default_workers() if auto else max(0, positive_int("workers", workers))
    todo_count = sum(len(items_of(p, part_size, len(src))) for p in todo)
    slow = float(os.environ.get("GPUFEED_TEST_SLOW_MS", "0") or 0) / 1000.0

    def items_in(p):
        return items_of(p, part_size, len(src))

    todo_items = (i for p in todo for i in items_in(p))
    results = ordered_map(
        (src.paths[i] for i in todo_items),
        load_opts,
        workers,
        measure_total=todo_count if auto else None,
    )
    bar = progress.progress_bar(len(src), done_items, quiet, "pack")
    committer = _Committer(parts_dir, stream)
    skipped = 0
    try:
        for p in todo:
            builder = PartBuilder()
            for i in items_in(p):
                res = next(results)
                if slow:
                    time.sleep(slow)
                spec, error = builder.add(i, res, spec, src)
                if error is None:
                    _note_size(sizes, res)
                else:
                    if on_error == "stop":
                        raise SourceError(f"{src.paths[i]}: {error}")
                    builder.skip(i, error)
                    skipped += 1
                    bar.set_postfix(skipped=skipped, refresh=False)
                bar.update(1)
            committer.submit(p, builder)
        committer.wait()
        return sizes
    finally:
        committer.close()
        bar.close()
        results.close()


class _Committer:
    """Parts built, streamed and saved in one thread, in order, while the next part's items
    are read; at most one part in it (memory stays bounded). An error there is raised by
    the next submit or by wait."""

    def __init__(self, parts_dir: Path, stream):
        self.parts_dir = parts_dir
        self.stream = stream
        self.pool: ThreadPoolExecutor | None = None
        self.job: Future | None = None

    def submit(self, p: int, builder: PartBuilder) -> None:
        self.wait()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-commit")
        self.job = self.pool.submit(self._commit, p, builder)

    def _commit(self, p: int, builder: PartBuilder) -> None:
        part = builder.build()
        # the stream first, so a part never names bytes not yet written; a part that says
        # where its samples are keeps no copy of them and is not fsynced (gpufeed.write.direct)
        part.where = self.stream.feed(p, part)
        part.save(part_path(self.parts_dir, p), sync=part.where is None)

    def wait(self) -> None:
        job, self.job = self.job, None
        if job is not None:
            job.result()

    def close(self) -> None:
        """Wait for the part being committed (it is kept; its error, if any, is dropped here:
        the pack is being left on another error, or wait() raised it already)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool, self.job = None, None
