"""A part's samples as tar members, built a run of samples at a time.

Each field of a record becomes the member KEY.NAME.EXT (gpufeed.formats.record); a (sample,
label) pack's sample is KEY.EXT then KEY.cls. A member is either copied (an optional prefix:
a .npy header; then a run of the part's payload) or short text made here for a whole part at
once (int and float fields, labels: record.member_bytes' rules). The run's bytes are one
buffer, written with one call; per sample, the only Python left is the copy of a payload of
varying size. Where every sample of a part takes the same bytes in a shard (fixed-shape
arrays, ints, floats: the member sizes may vary, their 512-byte blocks do not), a run is a
[samples, bytes] array: one constant row (headers' fixed bytes, .npy headers, padding)
broadcast, then the keys, sizes, checksums, payload and text written a column range at a
time: no Python a sample at all (docs/performance/conversion.md, "The tar writer a run at a
time").
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from gpufeed.formats.parts import Part
from gpufeed.formats.record import member_bytes, member_name, npy_header_for, split_joined
from gpufeed.formats.schema import Field, Schema
from gpufeed.formats.tar.members import BLOCK, DEC4, HeaderFields, member_headers

__all__ = ["Copied", "PartMembers", "Scratch", "Text"]

# field types whose member is the stored bytes as they are
_AS_STORED = frozenset({"str", "bytes", "json", "image"})
_INT64 = np.dtype("<i8")
# a run's buffer is kept for the next run up to this size (a larger one is made each time)
KEEP_BYTES = 64 << 20
# Text members' chars are at least this wide (zeros after the text, inside the member's
# padding): wider than any int's or float's text, so that every run writes the same columns
TEXT_WIDTH = 32


class Copied(NamedTuple):
    """Members that are a prefix, then payload[starts[j] : starts[j] + lens[j]]. heads: the
    prefix of every sample (one entry; b"" for none), or with ``which`` that of sample j,
    heads[which[j]] (a ragged field's .npy header, one a shape)."""

    heads: list[bytes]
    which: np.ndarray | None  # int64 [n]
    starts: np.ndarray  # int64 [n]
    lens: np.ndarray  # int64 [n]

    def prefix_lens(self) -> np.ndarray | int:
        if self.which is None:
            return len(self.heads[0])
        return np.array([len(h) for h in self.heads], np.int64)[self.which]

    def sizes(self) -> np.ndarray:
        return self.lens + self.prefix_lens()


class Text(NamedTuple):
    """Short members made here: sample j's bytes are chars[j, :lens[j]] (zeros after)."""

    chars: np.ndarray  # uint8 [n, width]
    lens: np.ndarray  # int64 [n]

    def sizes(self) -> np.ndarray:
        return self.lens


class Scratch:
    """The buffers a writer builds its runs in, kept between runs (a fresh one a run cost its
    pages' faults and zeroing, as much as building the run). Two, used in turn: a run's is
    read by the hasher's thread (``hold``) while the next is built in the other, and waited
    for before it is built in again. ``rows`` keeps the rows it filled with a sample's
    constant bytes for the next run of the same layout."""

    def __init__(self) -> None:
        self._slots = [_Slot(), _Slot()]
        self._turn = 0

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of a buffer, to write anything into."""
        slot = self._next()
        slot.row, slot.ready = None, 0
        return slot.take(nbytes)

    def rows(self, row: np.ndarray, key: bytes | None, n: int) -> np.ndarray:
        """uint8 [n, len(row)], each row ``row`` where the run writes nothing. ``key`` (the
        row's layout and bytes, None: not so) says the run writes every other byte of every
        row: rows the last run of this key in this buffer filled are not filled again."""
        slot = self._next()
        nbytes = n * len(row)
        if key is None or key != slot.row or nbytes > len(slot.buf):
            slot.ready = 0
        out = slot.take(nbytes).reshape(n, len(row))
        out[slot.ready :] = row
        kept = nbytes <= KEEP_BYTES and key is not None
        slot.row, slot.ready = (key, max(slot.ready, n)) if kept else (None, 0)
        return out

    def hold(self, job: Future | None) -> None:
        """The buffer handed out last is read until ``job`` is done: not built in before."""
        self._slots[self._turn ^ 1].job = job

    def _next(self) -> _Slot:
        slot = self._slots[self._turn]
        self._turn ^= 1
        job, slot.job = slot.job, None
        if job is not None:
            job.result()
        return slot


class _Slot:
    """One of Scratch's buffers: ``row`` fills its first ``ready`` rows (but for what each
    run writes anew); ``job`` still reads it."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)
        self.row: bytes | None = None
        self.ready = 0
        self.job: Future | None = None

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > KEEP_BYTES:
            return np.empty(nbytes, np.uint8)
        if nbytes > len(self.buf):
            self.buf = np.empty(max(nbytes, min(2 * len(self.buf), KEEP_BYTES)), np.uint8)
            self.row, self.ready = None, 0
        return self.buf[:nbytes]


def text_of(joined: bytes, n: int) -> Text:
    """Text from ``n`` words joined by single spaces (the words hold none)."""
    if n == 0:
        return Text(np.zeros((0, 1), np.uint8), np.zeros(0, np.int64))
    flat = np.frombuffer(joined, np.uint8)
    seps = np.flatnonzero(flat == 32)
    starts = np.r_[0, seps + 1]
    lens = np.r_[seps, len(flat)] - starts
    width = max(int(lens.max()), TEXT_WIDTH)
    cols = np.arange(width)
    chars = np.r_[flat, np.zeros(width, np.uint8)][starts[:, None] + cols]
    chars[cols >= lens[:, None]] = 0
    return Text(chars, lens.astype(np.int64))


def int_text(values: np.ndarray) -> Text:
    """Integers in decimal (b"%d"). Those of 0..10**8 - 1 (labels, mostly) by numpy: the 8
    ASCII digits of each (two table lookups of 4) as one little-endian uint64, shifted by
    its leading zeros, is the text left-aligned with zeros after it."""
    if not len(values) or values.min() < 0 or values.max() >= 10**8:
        return text_of(" ".join(map(str, values.tolist())).encode("ascii"), len(values))
    values = values.astype(np.int64)
    lens = np.ones(len(values), np.int64)
    for power in range(1, 8):
        lens += values >= 10**power
    digits = DEC4[values // 10**4].astype(np.uint64) | DEC4[values % 10**4].astype(
        np.uint64
    ) << np.uint64(32)
    chars = np.zeros((len(values), TEXT_WIDTH), np.uint8)
    shifted = digits >> (np.uint64(8) * (8 - lens).astype(np.uint64))
    chars[:, :8] = shifted.astype("<u8").view(np.uint8).reshape(-1, 8)
    return Text(chars, lens)


def float_text(values: np.ndarray) -> Text:
    """Floats as record.member_bytes writes them: repr, and JSON's NaN and Infinity."""
    words = list(map(repr, values.tolist()))
    for j in np.flatnonzero(~np.isfinite(values)).tolist():
        words[j] = json.dumps(float(values[j]))
    return text_of(" ".join(words).encode("ascii"), len(values))


def _stored_text(field: Field, payload: np.ndarray, starts, lens) -> Text:
    """An int or float field's members from its stored int64 / float64 values; stored
    values of another size go through member_bytes (its errors, its bytes)."""
    if len(lens) and np.all(lens == 8):
        raw = payload[starts[:, None] + np.arange(8)]
        values = raw.view("<i8" if field.type == "int" else "<f8").ravel()
        return int_text(values) if field.type == "int" else float_text(values)
    view = memoryview(payload)
    pairs = zip(starts.tolist(), lens.tolist(), strict=True)
    texts = [member_bytes(field, view[a : a + n]) for a, n in pairs]
    return text_of(b" ".join(texts), len(texts))


def _field_runs(field: Field, payload: np.ndarray, starts: np.ndarray, lens: np.ndarray):
    """Where field's members come from, given its stored bytes' starts and lengths."""
    kind = field.type
    if field.compression or kind in _AS_STORED:
        return Copied([b""], None, starts, lens)
    if kind == "array":
        return Copied([npy_header_for(field.dtype, field.shape)], None, starts, lens)
    if kind == "ragged":
        nd = len(field.shape)
        shapes = payload[starts[:, None] + np.arange(8 * nd)].view(_INT64).reshape(-1, nd)
        found, which = np.unique(shapes, axis=0, return_inverse=True)
        heads = [npy_header_for(field.dtype, tuple(s)) for s in found.tolist()]
        which = None if len(heads) == 1 else which.ravel().astype(np.int64)
        return Copied(heads, which, starts + 8 * nd, lens - 8 * nd)
    return _stored_text(field, payload, starts, lens)  # int and float


class PartMembers:
    """Every member of a part's samples: ``sample_bytes`` (each sample's bytes in a shard)
    and ``build`` (a run of samples' bytes). suffixes: each member's name after the key;
    fields: where each member's bytes come from (Copied from ``payload``, or Text)."""

    def __init__(self, suffixes, runs, payload, scratch: Scratch | None = None):
        self.payload = payload
        self.suffixes = suffixes
        self.fields = runs
        self.scratch = scratch or Scratch()
        self.sizes = np.stack([f.sizes() for f in self.fields], axis=1)  # int64 [n, F]
        self.spans = BLOCK + self.sizes + (-self.sizes) % BLOCK  # header, data, padding
        self.sample_bytes = self.spans.sum(axis=1)
        self.headers = HeaderFields.of(suffixes)
        self.row = self._row() if self.headers is not None else None
        # every run of this part writes every byte of its rows but the row's own (Scratch.rows)
        self.row_key = None
        if self.row is not None and self._whole():  # the layout, and the bytes it keeps
            copied = [int(r.lens[0]) for r in self.fields if isinstance(r, Copied)]
            self.row_key = np.r_[self.spans[0], copied].tobytes() + self.row.tobytes()

    @classmethod
    def of_fields(cls, schema: Schema, part: Part, scratch: Scratch | None = None):
        """A multi-field part: KEY.NAME.EXT a field."""
        names = [member_name("", f) for f in schema.fields]
        return cls(names, _split(schema, part), part.payload, scratch)

    @classmethod
    def of_samples(cls, part: Part, a: int, b: int, ext: str, header: bytes, scratch=None):
        """Samples a..b-1 of a (sample, label) part, of one extension: KEY.EXT (``header``,
        then the sample's bytes), then KEY.cls (the label in decimal)."""
        starts, lens = part.offsets[a:b], np.diff(part.offsets[a : b + 1])
        runs = [Copied([header], None, starts, lens), int_text(part.labels[a:b])]
        return cls([f".{ext}", ".cls"], runs, part.payload, scratch)

    def _row(self) -> np.ndarray | None:
        """Where every sample spans the same bytes: one sample's constant bytes (the headers
        but for key, size and checksum; a prefix shared by all; zero padding). Else None."""
        spans = self.spans
        if not len(spans) or not (spans == spans[0]).all():
            return None
        row = np.zeros(int(self.sample_bytes[0]), np.uint8)
        at = 0
        for k, (runs, span) in enumerate(zip(self.fields, spans[0].tolist(), strict=True)):
            row[at : at + BLOCK] = self.headers.templates[k]
            if isinstance(runs, Copied) and runs.which is None and runs.heads[0]:
                row[at + BLOCK : at + BLOCK + len(runs.heads[0])] = _u8(runs.heads[0])
            at += span
        return row

    def _whole(self) -> bool:
        """Whether _build_rows writes every member's bytes whole but the row's: copied
        payloads of one size (and no prefix of their own), text as wide as TEXT_WIDTH."""
        for runs in self.fields:
            if isinstance(runs, Text):
                if runs.chars.shape[1] != TEXT_WIDTH:
                    return False
            elif runs.which is not None or not (runs.lens == runs.lens[0]).all():
                return False
        return True

    def build(self, a: int, b: int, first_key: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples a..b-1, keyed from first_key: (their tar bytes, where each member's data
        starts in them: int64 [b - a, F])."""
        numbers = None
        if self.row is not None:
            numbers = self.headers.numbers(first_key, self.sizes[a:b])
        if numbers is None:
            buf = self.scratch.take(int(self.sample_bytes[a:b].sum()))
            return buf, self._build_any(buf, a, b, first_key)
        rows = self.scratch.rows(self.row, self.row_key, b - a)
        return rows.reshape(-1), self._build_rows(rows, a, b, numbers)

    def _build_rows(self, rows: np.ndarray, a: int, b: int, numbers) -> np.ndarray:
        """Samples of one size: [samples, bytes] (each row self.row already), filled a
        column range at a time."""
        keys, sizes, checks = numbers
        width = len(self.row)
        buf = rows.reshape(-1)
        heads = np.cumsum(self.spans[a]) - self.spans[a]
        for k, h in enumerate(heads.tolist()):
            rows[:, h : h + keys.shape[1]] = keys
            rows[:, h + 124 : h + 135] = sizes[:, k]
            rows[:, h + 148 : h + 154] = checks[:, k]
        data = (np.arange(b - a, dtype=np.int64) * width)[:, None] + (heads + BLOCK)
        for k, runs in enumerate(self.fields):
            h = int(heads[k]) + BLOCK
            if isinstance(runs, Text):
                rows[:, h : h + runs.chars.shape[1]] = runs.chars[a:b]
            elif not _copy_columns(rows, h + len(runs.heads[0]), runs, self.payload, a, b):
                _copy_field(buf, self.payload, runs, a, b, data[:, k])
        return data

    def _build_any(self, buf: np.ndarray, a: int, b: int, first_key: int) -> np.ndarray:
        """Samples of any sizes: each member's header block, and the last block of its data
        zeroed (its padding), placed by a fancy index a field; then the data, payload copied
        a member at a time."""
        spans, sizes = self.spans[a:b], self.sizes[a:b]
        heads = (np.cumsum(spans.ravel()) - spans.ravel()).reshape(spans.shape) // BLOCK
        blocks = buf.reshape(-1, BLOCK)
        blocks[(heads + spans // BLOCK - 1)[sizes > 0]] = 0
        numbers = None if self.headers is None else self.headers.numbers(first_key, sizes)
        if numbers is None:  # long names, huge members
            headers = member_headers(first_key, self.suffixes, sizes)
            blocks[heads.ravel()] = headers.reshape(-1, BLOCK)
        else:
            keys, size_digits, checks = numbers
            for k, template in enumerate(self.headers.templates):
                at = heads[:, k]
                blocks[at] = template
                blocks[at, : keys.shape[1]] = keys
                blocks[at, 124:135] = size_digits[:, k]
                blocks[at, 148:154] = checks[:, k]
        data = heads * BLOCK + BLOCK
        for k, runs in enumerate(self.fields):
            at = data[:, k]
            if isinstance(runs, Text):
                buf[at[:, None] + np.arange(runs.chars.shape[1])] = runs.chars[a:b]
            else:
                _copy_field(buf, self.payload, runs, a, b, at)
        return data


def _copy_columns(rows: np.ndarray, col: int, runs: Copied, payload, a: int, b: int) -> bool:
    """Copied members of one size, their payload at one stride (fixed-size records), as one
    strided copy into rows[:, col:]; False where they are not."""
    lens, starts = runs.lens[a:b], runs.starts[a:b]
    if runs.which is not None or not (lens == lens[0]).all():
        return False
    n, size, first = len(lens), int(lens[0]), int(starts[0])
    stride = int(starts[1]) - first if n > 1 else size
    if n > 1 and not (np.diff(starts) == stride).all():
        return False
    # a view past the payload would read other memory: such a part takes the checked path
    if first < 0 or stride < 0 or size < 0 or first + (n - 1) * stride + size > len(payload):
        return False
    if size:
        src = np.lib.stride_tricks.as_strided(
            payload[first:], (n, size), (stride, 1), writeable=False
        )
        rows[:, col : col + size] = src
    return True


def _copy_field(buf: np.ndarray, payload: np.ndarray, runs: Copied, a: int, b: int, at):
    """Copied members at data positions ``at`` (int64 [b - a]): prefixes by a fancy index a
    prefix, payloads a member at a time."""
    heads, which = runs.heads, runs.which
    if which is None:
        if heads[0]:
            buf[at[:, None] + np.arange(len(heads[0]))] = _u8(heads[0])
        at = at + len(heads[0])
    else:
        which = which[a:b]
        for g, head in enumerate(heads):
            here = at[which == g]
            if len(here):
                buf[here[:, None] + np.arange(len(head))] = _u8(head)
        at = at + runs.prefix_lens()[a:b]
    out, src = memoryview(buf), memoryview(payload)
    pairs = zip(at.tolist(), runs.starts[a:b].tolist(), runs.lens[a:b].tolist(), strict=True)
    for p, s, n in pairs:
        out[p : p + n] = src[s : s + n]


def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


def _split(schema: Schema, part: Part) -> list:
    """Each field's stored bytes in every record of the part (record.split_joined). A record
    whose sizes do not add up raises ValueError (as split_record)."""
    records = split_joined(schema, part.payload, part.offsets[:-1], np.diff(part.offsets))
    if records.bad:
        raise ValueError(records.bad[min(records.bad)])
    return [
        _field_runs(f, part.payload, records.starts[:, k], records.sizes[:, k])
        for k, f in enumerate(schema.fields)
    ]
