"""``gpufeed.Writer``: a pack written from Python objects, one sample dict at a time.

    with gpufeed.Writer("caps.pack", format="tar", schema={"image": "jpeg", "caption": "str"}) as w:
        for jpeg, text in data:
            w.write({"image": jpeg, "caption": text})

It is a pack like any other, made the same crash-safe way (gpufeed.write.pack): samples
are committed in parts under DEST.partial/ (each part written and renamed, in a thread of its
own while the next part's samples come; not fsynced: a resume reads each part back and checks
its samples' crc32, and redoes a torn part and every part after it), the
format's files are assembled from the committed parts when the writer closes without an
error (a fresh pack in a streamed format, gpufeed.write.assemble.streams: written as each
part is committed, gpufeed.write.assemble.Stream), the
manifest is written last, and DEST appears by one rename. Until then DEST does
not exist and ``open_dataset(DEST)`` raises NotPackedError saying so. The lock on
DEST.partial keeps a second writer (or pack) out.

After a crash (kill -9 included) ``Writer(DEST, ..., resume=True)`` keeps every committed
part and says how many samples they hold (``written``): write from that sample on. Samples
written after the last committed part are lost with the process (``flush()`` commits a part
now). ``overwrite=True`` starts over (and replaces a finished pack gpufeed made). A writer
left by an exception is not finished: the partial pack stays, resumable.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed._version import __version__
from gpufeed.errors import UsageError
from gpufeed.formats.checksums import row_crcs
from gpufeed.formats.files import atomic_write_json
from gpufeed.formats.lock import PackLock
from gpufeed.formats.manifest import PARTIAL_SUFFIX
from gpufeed.formats.parts import Part
from gpufeed.formats.record import decode_record
from gpufeed.formats.schema import Schema, infer_schema, inferred_names, parse_schema, widened
from gpufeed.formats.spec import SampleSpec
from gpufeed.storage.urls import require_local
from gpufeed.write.assemble import Stream, assemble
from gpufeed.write.direct import check_part, keep_streamed
from gpufeed.write.items import STAMP_FIELDS, stamp, stamp_changed
from gpufeed.write.options import check_options
from gpufeed.write.ownership import (
    PARTS_DIR,
    STATE_NAME,
    check_removable,
    clear_partial,
    occupied,
    remove_partial,
)
from gpufeed.write.records import (
    Pending,
    batch_length,
    batch_records,
    encoded,
    label_of,
    sample_encoder,
)
from gpufeed.write.sources import (
    Listing,
    WrittenSource,
    check_classes,
    check_label,
    item_name,
)
from gpufeed.write.staging import part_path

__all__ = ["PART_BYTES", "Writer", "encoded", "label_of"]

# a part is committed every part_size samples (WRITER_PART_SIZE unless given) or PART_BYTES
# bytes, whichever comes first: what a crash can lose. A part's fixed costs (its index file,
# the format's transaction, the handoff to the commit thread) are about a millisecond, so
# parts of thousands of samples keep them far below a microsecond a sample.
WRITER_PART_SIZE = 8192
PART_BYTES = 16 << 20
# a part's records are gathered in one buffer this large (touched only as they come): room
# for the record that takes it past PART_BYTES without a copy
PENDING_BYTES = 2 * PART_BYTES


class Writer:
    """Write sample dicts into a new pack at ``path`` (see the module docstring).

    Use it as a context manager (``with Writer(...) as w: w.write(sample)``): leaving the
    block closes the pack, or on an error keeps the committed parts for ``resume=True``.

    Args:
        path: the pack's local folder (write locally, then
            gpufeed.storage.upload_pack(it, URL)).
        format: "hdf5" (the default), "lmdb", "tar" or "mmap".
        schema: the fields' types, e.g. ``{"image": "jpeg", "tokens": "int32[-1]"}``
            (gpufeed.formats.schema), or None to take it from the first sample. A schema
            naming only some of the first sample's fields declares those, the others are
            inferred. An inferred array whose size varies becomes ragged (-1 in that
            dimension) while no part is committed yet (the first ``part_size`` samples);
            later it is an error saying what to declare. The manifest lists the inferred
            fields (``options.inferred_fields``).
        compression: as for ``gpufeed.pack``.
        shard_size: as for ``gpufeed.pack``.
        shard_bytes: as for ``gpufeed.pack``.
        container: as for ``gpufeed.pack`` (mmap: "npy" or "raw").
        part_size: samples per committed part (what a crash can lose; default 8,192, and
            never more than 16 MiB of records: PART_BYTES).
        resume: go on from a pack of ``path`` left unfinished (``inputs_done`` says where).
        overwrite: replace ``path`` if it is a pack gpufeed made.
        quiet: no progress messages (the default).
        listing: the listed files the samples come from (a :class:`Listing`; gpufeed.pack
            of a folder of .txt, .wav or .pt dicts passes it): recorded in the manifest,
            checked on resume.
        classes: the class names (label i is classes[i]; HF ``ClassLabel.names``), kept in
            the manifest (``dataset.classes``); every "label" written is then below
            len(classes), or -1.

    Raises:
        UsageError: ``path`` is a URL, or already exists and ``overwrite`` is not set.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        format: str = "hdf5",  # noqa: A002 - the public name, as in pack
        schema: Schema | Mapping[str, Any] | None = None,
        *,
        compression: str | None = None,
        shard_size: int | None = None,
        shard_bytes: int | None = None,
        container: str = "npy",
        part_size: int | None = None,
        resume: bool = False,
        overwrite: bool = False,
        quiet: bool = True,
        listing: Listing | None = None,
        classes: Sequence[str] | None = None,
    ):
        require_local(path, "write into a local folder, then gpufeed.storage.upload_pack(it, URL)")
        opts = check_options(
            format,
            "keep",
            "stop",
            compression,
            container,
            shard_size,
            shard_bytes,
            part_size or WRITER_PART_SIZE,
        )
        self._part_size_given = part_size is not None
        self.dest = Path(path).absolute()
        self.partial = self.dest.with_name(self.dest.name + PARTIAL_SUFFIX)
        self.schema = parse_schema(schema) if schema is not None else None
        self.classes = check_classes(classes, listing)
        self.quiet = quiet
        self.state = {
            "gpufeed": __version__,
            "writer": True,
            "source_digest": "",
            "format": format,
            "on_error": "stop",
            **opts,
            **({"listing": listing.digest, "source": listing.path} if listing else {}),
            **({"classes": self.classes} if classes is not None else {}),
        }
        self.listing = listing
        self._lock: PackLock | None = None
        self._inferred: list[str] = []  # the fields taken from the first sample
        self._open(resume, overwrite)

    # -- opening -------------------------------------------------------------------------
    def _open(self, resume: bool, overwrite: bool) -> None:
        if occupied(self.dest):
            if not overwrite:
                raise UsageError(
                    f"{self.dest}: already exists; pass overwrite=True to replace it "
                    "(only a pack gpufeed made is replaced)"
                )
            check_removable(self.dest, "replace it (overwrite=True)")
        self._lock = PackLock(self.dest, self.partial).__enter__()
        try:
            self._prepare(resume, overwrite)
        except BaseException as e:
            self._lock.__exit__(type(e), e, None)
            self._lock = None
            raise
        self.manifest: dict[str, Any] | None = None

    def _prepare(self, resume: bool, overwrite: bool) -> None:
        state_path = self.partial / STATE_NAME
        self.parts = 0
        self.written = 0
        self.skipped: list[tuple[int, str]] = []
        # what each input was (sources.txt); gpufeed.pack(fn, inputs) sets it
        self.item_names: list[str] | None = None
        self._pending = Pending(PENDING_BYTES)  # the samples of the next part
        # the buffer of the part being written, and one free to fill again (Pending)
        self._writing: np.ndarray | None = None
        self._spare: np.ndarray | None = None
        self._stamps: dict[int, tuple[int, ...]] = {}  # item -> its listed file's stamp
        # write()'s encoder, made for the schema it was made for (_fast)
        self._one, self._one_schema = None, None
        self._items = 0  # inputs done: gpufeed.pack(fn, inputs) goes on from here
        # parts are written (and fed to the stream) in one thread while the next part's
        # samples come: at most one part in it, in order; flush() and close() wait for it
        self._committer: ThreadPoolExecutor | None = None
        self._committing: Future | None = None
        # a fresh pack's format files are written as its parts are committed; a resumed one
        # assembles them from every part when it closes
        self._stream = Stream(self.partial, self.state, self.classes, on=not resume)
        if state_path.exists() and resume:
            self._resume(json.loads(state_path.read_text()))
            return
        if state_path.exists() and not overwrite:
            raise UsageError(
                f"{self.partial}: an unfinished pack is there; pass resume=True to continue "
                "it or overwrite=True to start over"
            )
        clear_partial(self.partial, "start the pack over")
        (self.partial / PARTS_DIR).mkdir()
        self._save_state()

    def _save_state(self) -> None:
        schema = self.schema.to_json() if self.schema else None
        self.state["schema"] = schema
        self.state["source_digest"] = (
            self.listing.digest
            if self.listing is not None
            else hashlib.sha256(json.dumps(schema).encode()).hexdigest()
        )
        atomic_write_json(self.partial / STATE_NAME, self.state)

    def _resume(self, old: dict) -> None:
        if not old.get("writer"):
            raise UsageError(f"{self.partial}: an unfinished `gpufeed pack`, not a Writer's")
        old_schema = parse_schema({d["name"]: d for d in old["schema"]}) if old["schema"] else None
        if _declared_part(self.schema, old_schema, old.get("inferred_fields") or []):
            self.schema = old_schema  # the rest was inferred from the first sample, as now
        if self.schema is not None and old_schema is not None and self.schema != old_schema:
            raise UsageError(
                f"{self.partial}: was started with schema {old_schema.describe()}; resume with "
                "the same one, or pass overwrite=True to start over"
            )
        if not self._part_size_given and "part_size" in old:  # the size it was started with
            self.state["part_size"] = old["part_size"]
        diff = [k for k in self.state if k not in ("gpufeed",) and old.get(k) != self.state[k]]
        diff = [k for k in diff if k not in ("schema", "source_digest")]
        if diff:
            what = ", ".join(f"{k}: {old.get(k)!r} -> {self.state[k]!r}" for k in diff)
            raise UsageError(f"{self.partial}: was started with different settings ({what})")
        self.schema = self.schema or old_schema
        self._inferred = list(old.get("inferred_fields") or [])
        self.classes = old.get("classes", self.classes)  # given, they were found the same
        self.state = {**old, "gpufeed": __version__}
        parts_dir = self.partial / PARTS_DIR
        for tmp in parts_dir.glob("*.tmp"):
            tmp.unlink()
        keep_streamed(self.partial)
        while part_path(parts_dir, self.parts).exists():
            part = check_part(part_path(parts_dir, self.parts), self.partial)
            if part is None:  # torn (not fsynced, then a power loss): redone, as those after
                self._say(f"{part_path(parts_dir, self.parts).name}: torn; writing it again")
                break
            changed = self._changed(part)
            if changed is not None:  # never kept stale: redone, as those after
                name = part_path(parts_dir, self.parts).name
                self._say(f"{changed}: changed since it was read; reading {name} again")
                break
            self.written += len(part)
            items = np.concatenate([part.items, part.skip_items])
            self._items = max(self._items, int(items.max()) + 1 if len(items) else 0)
            self.parts += 1
        redo = 0
        for stale in parts_dir.glob("part-*.npz"):
            if int(stale.stem.removeprefix("part-")) >= self.parts:
                stale.unlink()  # after a gap: not part of the committed run, written again
                redo += 1
        self._say(
            f"{self.partial}: resuming: {self.parts} part(s) kept ({self.written} samples of "
            f"{self._items} inputs, as committed earlier), {redo} dropped to be written "
            f"again; going on from input {self._items}"
        )

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr)

    # -- writing -------------------------------------------------------------------------
    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample dict: every field of the schema, nothing else.

        Args:
            sample: field name -> value (an array, bytes, a str or a number, as the schema
                says).

        Raises:
            UsageError: the writer is closed, or the sample does not fit the schema (the
                message names the sample by its place).
        """
        one = self._fast()
        if one is None:
            return self.add_item(self._items, [sample])
        try:
            record, label, crc = one(sample)
        except Exception:  # noqa: BLE001 - the general way refuses it, naming field and sample
            return self.add_item(self._items, [sample])
        item = self._items
        if self.classes is not None and not -1 <= label < len(self.classes):
            return self.add_records(item, [(record, label, crc)])  # refused, named there
        self._pending.add(item, record, label, crc)
        self.written += 1
        self._items = item + 1
        if self._pending.count >= self._part_size or self._pending.nbytes >= PART_BYTES:
            self._commit(wait=False)
        return None

    def _fast(self):
        """write()'s encoder for the current schema (sample_encoder: every sample it does not
        take goes the general way, add_item), or None where write() goes that way anyway: no
        schema yet, samples from listed files (their stamps), a closed writer."""
        if self._one_schema is not self.schema:
            self._one_schema = self.schema
            self._one = sample_encoder(self.schema) if self.schema is not None else None
        if self.listing is not None or self._lock is None:
            return None
        return self._one

    @property
    def _part_size(self) -> int:
        return self.state["part_size"]

    def write_batch(self, columns: Mapping[str, Any]) -> None:
        """Add a batch of samples given as columns: field name -> its values for every sample
        of the batch (``{"x": uint8 array [B, 1024], "label": int array [B]}``). The same
        samples, parts and pack as ``write`` of each row; an extra for speed: where every
        field is an uncompressed fixed-shape array given as one array of the field's dtype
        ``[B, *shape]``, or an int or float field as a 1-d integer or float array, the
        batch's records are made with numpy at once. Any other batch is written a row at a
        time (through every check of ``write``).

        Args:
            columns: field name -> a sequence of B values (arrays, lists).

        Raises:
            UsageError: the writer is closed, the columns' lengths differ, or a sample does
                not fit the schema (named by its place, as by ``write``).
        """
        self._check_open()
        count = batch_length(self.dest, columns)
        if not count:
            return
        if self.schema is None:  # taken from the first row, as write() does
            self.write({k: v[0] for k, v in columns.items()})
            return self.write_batch({k: v[1:] for k, v in columns.items()})
        got = None
        if self.listing is None and sorted(columns) == sorted(self.schema.names):
            got = batch_records(self.schema, columns, count)
        if got is None:
            for j in range(count):
                self.write({k: v[j] for k, v in columns.items()})
            return None
        payload, size, labels = got
        self._check_labels(labels)
        self._add_block(payload, size, labels, row_crcs(payload.reshape(count, size)))
        return None

    def _check_labels(self, labels: np.ndarray) -> None:
        """A batch's labels are the classes' (check_label's refusal, naming the first
        sample that is not)."""
        if self.classes is None or not len(labels):
            return
        bad = np.flatnonzero((labels < -1) | (labels >= len(self.classes)))
        if len(bad):
            j = int(bad[0])
            where = f"{self.dest}: sample {self.written + j} ({item_name(None, self._items + j)})"
            check_label(self.classes, int(labels[j]), where)

    def _add_block(self, payload: np.ndarray, size: int, labels, crcs) -> None:
        """A batch of records of ``size`` bytes each, cut where a part is due (part_size
        samples or PART_BYTES), one item each."""
        count, j = len(labels), 0
        while j < count:
            room = min(
                self._part_size - self._pending.count,
                (PART_BYTES - self._pending.nbytes) // max(size, 1),
            )
            take = min(count - j, max(room, 1))
            items = np.arange(self._items, self._items + take, dtype=np.int64)
            self._pending.add_block(
                payload[j * size : (j + take) * size],
                np.full(take, size, np.int64),
                labels[j : j + take],
                crcs[j : j + take],
                items,
            )
            self.written += take
            self._items += take
            j += take
            if self._pending.count >= self._part_size or self._pending.nbytes >= PART_BYTES:
                self._commit(wait=False)

    @property
    def inputs_done(self) -> int:
        """Inputs committed or written so far (after a resume: where to go on from)."""
        return self._items

    def set_schema(self, schema: Schema) -> None:
        """The schema, once (from the first sample when none was given)."""
        if self.schema is None:
            self.schema = schema
            self._inferred = list(schema.names)
            self.state["inferred_fields"] = self._inferred
            self._save_state()

    def add_item(self, item: int, samples: list) -> None:
        """The samples of one input (``gpufeed.pack(fn, inputs)``: fn's output for
        inputs[item]); a part is committed only between inputs, so a resume restarts at an
        input boundary."""
        self._check_open()
        self.add_records(item, self.encode_samples(samples))

    def encode_samples(self, samples: list) -> list[tuple[bytes, int, int]]:
        """One input's samples encoded, (record, label, crc32) each, under this Writer's
        schema rules (taken from the first sample, a partial one completed, an inferred
        size that varies widened); a UsageError names the sample that does not fit."""
        self._check_open()
        if samples and self._infers_from(samples[0]):
            declared = self.schema.to_json_dict() if self.schema is not None else None
            self.schema = infer_schema(samples[0], declared)
            self._inferred = inferred_names(self.schema, declared)
            self.state["inferred_fields"] = self._inferred
            self._save_state()
        return [self._encoded(s, k) for k, s in enumerate(samples)]

    def _infers_from(self, sample: Any) -> bool:
        """Whether the schema is (partly) taken from this sample: none was given, or one
        naming only some of its fields, and nothing is written yet."""
        if self.schema is None:
            return True
        if self.written or self.parts or not isinstance(sample, Mapping):
            return False
        return set(self.schema.names) < set(sample)

    def _encoded(self, sample: Mapping[str, Any], k: int) -> tuple[bytes, int, int]:
        """encoded(), its refusal naming the sample (the k-th of this input); an inferred
        array whose size varies is widened first, while that is possible (_widen)."""
        try:
            return encoded(self.schema, sample)
        except UsageError as e:
            if self._widen(sample):
                return self._encoded(sample, k)
            hint = ""
            if self._inferred and ("wider dtype" in str(e) or "varies" in str(e)):
                hint = (
                    " (this Writer took the schema from the first sample: pass schema= "
                    "naming this field; the others may be left out)"
                )
            raise UsageError(f"{self.dest}: sample {self.written + k}: {e}{hint}") from None

    def _widen(self, sample: Any) -> bool:
        """Make the inferred array fields whose sizes ``sample`` does not fit ragged (-1
        there), the samples not yet committed encoded again; False where none widens or a
        part is committed already (its records hold the fixed shape)."""
        if not self._inferred or self.parts or not isinstance(sample, Mapping):
            return False
        old = self.schema
        fields = [
            (widened(f, sample[f.name]) if f.name in self._inferred and f.name in sample else None)
            or f
            for f in old.fields
        ]
        if tuple(fields) == old.fields:
            return False
        self.schema = Schema(tuple(fields))
        pending, self._pending = self._pending, Pending(PENDING_BYTES)
        for item, record, _, _ in pending.rows():
            self._pending.add(item, *encoded(self.schema, decode_record(old, record)))
        self._save_state()
        return True

    def add_records(self, item: int, records: list[tuple[bytes, int, int]]) -> None:
        """Encoded samples of input ``item``: (record, label, crc32) each (add_item's
        work, done in a worker process by gpufeed.pack(fn, inputs))."""
        self._check_open()
        if self.classes is not None:
            for k, (_, label, _) in enumerate(records):
                where = f"{self.dest}: sample {self.written + k} "
                check_label(self.classes, label, where + f"({item_name(self.item_names, item)})")
        self._stamp(item)
        pending = self._pending
        for record, label, crc in records:
            pending.add(item, record, label, crc)
        self.written += len(records)
        self._items = max(self._items, item + 1)
        if pending.count >= self._part_size or pending.nbytes >= PART_BYTES:
            self._commit(wait=False)

    def skip(self, item: int, error: str) -> None:
        """Record input ``item`` as left out (pack's on_error="skip")."""
        self._check_open()
        self._stamp(item)
        self.skipped.append((item, error))
        self._items = max(self._items, item + 1)

    @property
    def _listed(self) -> list[str] | None:
        """The listed files input i comes from (None: samples from Python objects)."""
        return self.listing.paths if self.listing is not None else None

    def _stamp(self, item: int) -> None:
        """The listed file's stamp (gpufeed.write.items.stamp), taken as its samples arrive
        (just after the read: a change inside that moment is not seen; one before a resume
        is)."""
        if self._listed is not None:
            self._stamps.setdefault(item, stamp(self._listed[item]))

    def _part_stamps(self, pending: Pending, skipped: list) -> np.ndarray | None:
        """int64 [items, 4]: the stamps of a part's items (written and skipped), in item
        order; None where the samples come from no listed files."""
        if self._listed is None:
            return None
        items = sorted(set(pending.arrays()[4].tolist()) | {i for i, _ in skipped})
        stamps = [self._stamps.pop(i) for i in items]
        return np.asarray(stamps, np.int64).reshape(-1, len(STAMP_FIELDS))

    def _changed(self, part: Part) -> str | None:
        """The first listed file of a committed part that changed since it was read (a
        part whose stamps do not match its items is taken as changed: read again)."""
        if self._listed is None or part.stamps is None:
            return None
        items = sorted(set(part.items.tolist()) | set(part.skip_items.tolist()))
        if len(items) != len(part.stamps):
            return self._listed[items[0]] if items else None
        for i, was in zip(items, part.stamps.tolist(), strict=True):
            if stamp_changed(self._listed[i], was):
                return self._listed[i]
        return None

    def flush(self, empty: bool = False) -> None:
        """Commit the samples written so far as one part (what a resume keeps); ``empty``:
        even none (a pack of no samples still records its schema in a part)."""
        self._commit(empty, wait=True)

    def _commit(self, empty: bool = False, wait: bool = True) -> None:
        """The pending samples as the next part, written in the commit thread (the part
        before it finished first: an error there is raised here); ``wait``: until written."""
        self._check_open()
        self._wait_committed()  # the part before: written (its buffer free again)
        pending, skipped = self._pending, self.skipped
        self._pending, self.skipped = Pending(PENDING_BYTES, self._spare), []
        self._spare = None
        if pending.count or skipped or empty:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-commit")
            stamps = self._part_stamps(pending, skipped)
            job = self._committer.submit(
                self._write_part, self.parts, pending, skipped, self.schema, wait, stamps
            )
            self._committing, self._writing = job, pending.buffer
            self.parts += 1
        else:
            self._spare = pending.buffer
        if wait:
            self._wait_committed()

    def _wait_committed(self) -> None:
        """Wait for the part being written (its error raised here); its buffer is then the
        next Pending's (no format writer keeps a part's payload past its add)."""
        job, self._committing = self._committing, None
        if job is not None:
            job.result()
            self._spare, self._writing = self._writing, None

    def _write_part(
        self,
        index: int,
        pending: Pending,
        skipped: list,
        schema,
        durable: bool = False,
        stamps=None,
    ) -> None:
        """Part ``index`` saved (its samples fed to the stream first); ``durable``: with its
        payload even where the stream could point at it (flush(): committed now, whatever the
        format's writer still holds)."""
        payload, sizes, labels, crcs, items = pending.arrays()
        n = len(sizes)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        part = Part(
            payload=payload,
            offsets=offsets,
            labels=labels,
            crc32=crcs,
            items=items,
            exts=np.full(n, "rec", dtype="<U8"),
            skip_items=np.asarray([i for i, _ in skipped], dtype=np.int64),
            skip_errors=np.asarray([e for _, e in skipped], dtype=str),
            spec=SampleSpec("fields", schema=schema) if schema else None,
            stamps=stamps,
        )
        # a streamed pack's samples are written once, into its shards or data.mdb: the part
        # keeps their places (gpufeed.write.direct); the stream first, so a part never
        # names bytes not yet written
        where = self._stream.feed(index, part)
        part.where = where if not durable else None
        part.save(part_path(self.partial / PARTS_DIR, index), sync=False)

    def _check_open(self) -> None:
        if self._lock is None:
            raise UsageError(f"{self.dest}: this Writer is closed")

    # -- finishing -----------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Commit what is left, assemble the pack, write the manifest, rename it into place.

        Returns:
            The finished pack's manifest (a dict, as written to manifest.json); a closed
            writer's close returns it again.

        Raises:
            UsageError: no sample was written and no schema given (no pack is made).
        """
        if self._lock is None:
            return self.manifest
        self.flush()
        if self.schema is None:
            self._close_empty()
        if self.parts == 0:
            self.flush(empty=True)
        src = WrittenSource(count=self._items, names=self.item_names, classes=self.classes)
        if self.listing is not None:
            src.path, src.kind = self.listing.path, self.listing.kind
            src.problems = list(self.listing.problems)
        try:
            self.manifest = assemble(
                src, self.dest, self.partial, self.parts, self.state, self.quiet, self._stream
            )
        except BaseException:  # the parts stay and the lock goes: resume=True goes on at once
            self.abandon()
            raise
        remove_partial(self.partial, self._lock)
        self._release()
        return self.manifest

    def _close_empty(self) -> None:
        """No sample and no schema: no pack is made; DEST.partial (nothing in it to resume)
        is removed and the lock released, so DEST is free for the next writer."""
        skipped = f" ({self._items} input(s), every one skipped)" if self._items else ""
        self._stop_committer()
        self._stream.stop()
        remove_partial(self.partial, self._lock)
        self._release()
        raise UsageError(
            f"{self.dest}: no sample was written{skipped}; nothing to pack (no pack made, "
            "its staging folder removed); pass schema= to write a pack of no samples"
        )

    def abandon(self) -> None:
        """Stop without finishing: committed parts stay (resume=True continues)."""
        self._stop_committer()
        if self._lock is not None:
            self._stream.stop()
        self._release()

    def _stop_committer(self) -> None:
        """Wait for the part being written (it is kept; its error, if any, is dropped: the
        writer is being left on another error, or closed after waiting for it)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer, self._committing = None, None

    def _release(self) -> None:
        self._stop_committer()
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __enter__(self) -> Writer:
        """Enter a ``with`` block.

        Returns:
            This writer (``with Writer(...) as w``).
        """
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close on success; on an error, keep the committed parts (``resume=True`` goes on)."""
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _declared_part(given: Schema | None, old: Schema | None, inferred: list[str]) -> bool:
    """Whether a partial schema given again on resume is the one the pack started with:
    its fields as the pack has them, the pack's others inferred."""
    if given is None or old is None or not set(given.names) < set(old.names):
        return False
    names = set(old.names)
    return all(n in inferred for n in names - set(given.names)) and all(
        old[f.name] == f for f in given.fields
    )
