"""A part of multi-field samples as tar members, built a run of samples at a time.

Each field of a record becomes the member KEY.NAME.EXT (gpufeed.formats.record): a member's
bytes are an optional prefix (a .npy header, or the whole member for int and float fields,
whose text is made here) and then a run of the part's payload. The ustar headers of a run of
samples come from one numpy computation (gpufeed.formats.tar.members.member_headers), and the
run's bytes are assembled into one buffer written with one call: the writer process of
``gpufeed.pack(fn)`` spent the largest part of its CPU time building headers and write
buffers a member at a time (docs/performance/conversion.md, "The tar writer a run at a
time").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from gpufeed.formats.parts import Part
from gpufeed.formats.record import member_bytes, member_name, npy_header_for, split_joined
from gpufeed.formats.schema import Field, Schema
from gpufeed.formats.tar.members import BLOCK, member_headers

__all__ = ["PartMembers"]

# field types whose member is the stored bytes as they are
_AS_STORED = frozenset({"str", "bytes", "json", "image"})
_INT64 = np.dtype("<i8")


class FieldRuns(NamedTuple):
    """One field's members across a part: prefix (bytes for every sample, a list of bytes per
    sample, or b""), then payload[starts[j] : starts[j] + lens[j]]."""

    prefix: bytes | list[bytes]
    starts: np.ndarray  # int64 [n]
    lens: np.ndarray  # int64 [n]

    def sizes(self) -> np.ndarray:
        if isinstance(self.prefix, list):
            return np.fromiter(map(len, self.prefix), _INT64, len(self.prefix)) + self.lens
        return self.lens + len(self.prefix)


def _field_runs(field: Field, payload: np.ndarray, starts: np.ndarray, lens: np.ndarray):
    """Where field's members come from, given its stored bytes' starts and lengths."""
    kind = field.type
    if field.compression or kind in _AS_STORED:
        return FieldRuns(b"", starts, lens)
    if kind == "array":
        return FieldRuns(npy_header_for(field.dtype, field.shape), starts, lens)
    if kind == "ragged":
        nd = len(field.shape)
        shapes = payload[starts[:, None] + np.arange(8 * nd)].view(_INT64).reshape(-1, nd)
        found, which = np.unique(shapes, axis=0, return_inverse=True)
        heads = [npy_header_for(field.dtype, tuple(s)) for s in found.tolist()]
        prefix = heads[0] if len(heads) == 1 else [heads[k] for k in which.ravel().tolist()]
        return FieldRuns(prefix, starts + 8 * nd, lens - 8 * nd)
    # int and float: short text made from the stored value (member_bytes' rules)
    view = memoryview(payload)
    pairs = zip(starts.tolist(), lens.tolist(), strict=True)
    texts = [member_bytes(field, view[a : a + n]) for a, n in pairs]
    return FieldRuns(texts, starts, np.zeros_like(lens))


class PartMembers:
    """Every member of a part's samples: ``sample_bytes`` (each sample's bytes in a shard)
    and ``build`` (a run of samples' bytes). suffixes: each member's name after the key;
    runs: where each member's bytes come from (FieldRuns over ``payload``)."""

    def __init__(self, suffixes: list[str], runs: list[FieldRuns], payload: np.ndarray):
        self.payload = payload
        self.suffixes = suffixes
        self.fields = runs
        self.sizes = np.stack([f.sizes() for f in self.fields], axis=1)  # int64 [n, F]
        self.spans = BLOCK + self.sizes + (-self.sizes) % BLOCK  # header, data, padding
        self.sample_bytes = self.spans.sum(axis=1)

    @classmethod
    def of_fields(cls, schema: Schema, part: Part) -> PartMembers:
        """A multi-field part: KEY.NAME.EXT a field."""
        return cls([member_name("", f) for f in schema.fields], _split(schema, part), part.payload)

    @classmethod
    def of_samples(cls, part: Part, a: int, b: int, ext: str, header: bytes) -> PartMembers:
        """Samples a..b-1 of a (sample, label) part, of one extension: KEY.EXT (``header``,
        then the sample's bytes), then KEY.cls (the label in decimal)."""
        starts, lens = part.offsets[a:b], np.diff(part.offsets[a : b + 1])
        labels = [b"%d" % v for v in part.labels[a:b].tolist()]
        runs = [FieldRuns(header, starts, lens), FieldRuns(labels, starts, np.zeros_like(lens))]
        return cls([f".{ext}", ".cls"], runs, part.payload)

    def build(self, a: int, b: int, first_key: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples a..b-1, keyed from first_key: (their tar bytes, where each member's data
        starts in them: int64 [b - a, F])."""
        ends = np.cumsum(self.spans[a:b].ravel())
        heads = ends - self.spans[a:b].ravel()
        buf = np.zeros(int(ends[-1]), np.uint8)
        blocks = buf.reshape(-1, BLOCK)
        headers = member_headers(first_key, self.suffixes, self.sizes[a:b])
        blocks[heads // BLOCK] = headers.reshape(-1, BLOCK)
        data = (heads + BLOCK).reshape(b - a, -1)
        out, src = memoryview(buf), memoryview(self.payload)
        for k, runs in enumerate(self.fields):
            _copy_field(out, src, runs, a, b, data[:, k].tolist())
        return buf, data


def _copy_field(out: memoryview, src: memoryview, runs: FieldRuns, a: int, b: int, at: list):
    starts, lens = runs.starts[a:b].tolist(), runs.lens[a:b].tolist()
    prefix = runs.prefix
    if isinstance(prefix, list):
        for p, pre, s, n in zip(at, prefix[a:b], starts, lens, strict=True):
            q = p + len(pre)
            out[p:q] = pre
            out[q : q + n] = src[s : s + n]
        return
    if prefix:
        width = len(prefix)
        for p in at:
            out[p : p + width] = prefix
        at = [p + width for p in at]
    for p, s, n in zip(at, starts, lens, strict=True):
        out[p : p + n] = src[s : s + n]


def _split(schema: Schema, part: Part) -> list[FieldRuns]:
    """Each field's stored bytes in every record of the part (record.split_joined). A record
    whose sizes do not add up raises ValueError (as split_record)."""
    records = split_joined(schema, part.payload, part.offsets[:-1], np.diff(part.offsets))
    if records.bad:
        raise ValueError(records.bad[min(records.bad)])
    return [
        _field_runs(f, part.payload, records.starts[:, k], records.sizes[:, k])
        for k, f in enumerate(schema.fields)
    ]
