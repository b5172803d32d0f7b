"""Token windows: a pack of token documents read as fixed windows of one token stream.

A token pack is a multi-field pack whose samples hold a ragged 1-D integer field (the
document's token ids; ``field=`` names it when the schema has several such fields). The
stream is the documents concatenated in pack order, ``eos`` appended after each document
when given. A pack that ``pack_tokens`` wrote with ``eos`` holds it already (its manifest's
``tokens.eos``): ``eos=`` the same id appends none, another id is a UsageError.
:class:`TokenWindows` is a map-style Dataset over it:

- ``boundaries=False`` (the default): item ``i`` is ``stream[i * B : (i + 1) * B]``, a 1-D
  tensor of the stored dtype (uint16 stays uint16: no int64 conversion, do
  ``x.long()`` on the GPU), ``len = total_tokens // B`` (the last partial window is left
  out). A window spanning documents is gathered from consecutive samples.
- ``boundaries=True``: windows start at document starts. Each document (with its ``eos``)
  is cut into windows of ``B`` tokens from its first token; a document's last window is
  padded to ``B`` with ``pad_id``. Item ``i`` is ``{"tokens": [B], "mask": [B] bool}``
  (mask False on padding); ``len = sum(ceil(len_d / B))`` (an empty document gives none).

Document lengths are known when the dataset is made: from the record spans of the index
where the format keeps them (mmap, HDF5: no data read) and the field is the record's only
one, uncompressed; otherwise by reading every record once, a batch at a time (LMDB, tar,
several fields, zstd), cached in the index folder of data read in place
($GPUFEED_INDEX_DIR, else ~/.cache/gpufeed/index) for the very files they were read from.
Pickled to workers, the lengths go with the dataset (numpy arrays: no copy-on-read growth).

``__getitems__`` (what the DataLoader and make_loader call with a batch of window indices)
reads a batch as one gather: its windows are copied into one [W, B] array whose rows it
hands out (a list, as PyTorch's contract says; default_collate stacks them). Where the pack
is one uncompressed token field (mmap, HDF5), each window is a slice of the pack's bytes:
of the map (mmap, contiguous HDF5: one slice copy per piece of a document a window holds),
or, through h5py (chunked or compressed HDF5), of one read of the batch's byte spans; other
packs (LMDB, tar, several fields, zstd) read every document the batch touches in one
``read_batch``. A batch is planned first (:meth:`TokenWindows.plan`), its reads started,
then copied (:meth:`TokenWindows.fill`): a mixture of token windows starts every source's
reads before it waits on any and fills one array from all of them (gpufeed.data.mixture).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpufeed.data.reading import PythonIndexing, as_index_array
from gpufeed.data.token_reads import (
    HEAD_BYTES,
    document_lengths,
    document_tokens,
    read_h5_spans,
)
from gpufeed.errors import CorruptSampleError, DataError, UsageError
from gpufeed.pagecache.advise import advise_willneed, looks_cached
from gpufeed.storage.packs import open_reader_at
from gpufeed.write.tokens import MANIFEST_KEY

__all__ = ["TokenWindows", "WindowPlan", "token_field"]

# how a pack's windows are read (TokenWindows._read_mode): slices of its map, slices of one
# h5py read of the batch's byte spans, or from the documents a read_batch returns
MAPPED, H5_SPANS, RECORDS = "mapped", "h5 spans", "records"


def token_field(path, spec, field: str | None):
    """(index, Field) of the pack's token field: ``field`` or the one ragged 1-D integer
    field; a UsageError naming the pack otherwise."""
    if spec.kind != "fields":
        raise UsageError(
            f"{path}: block_size= reads token documents: samples holding a ragged integer "
            f"field (schema={{'tokens': 'uint16[-1]'}}); this pack holds {spec.describe()}"
        )
    fields = spec.schema.fields
    fit = [
        k
        for k, f in enumerate(fields)
        if f.type == "ragged" and len(f.shape) == 1 and np.dtype(f.dtype).kind in "iu"
    ]
    if field is not None:
        names = [f.name for f in fields]
        if field not in names:
            raise UsageError(f"{path}: field={field!r} is not a field of this pack: {names}")
        k = names.index(field)
        if k not in fit:
            raise UsageError(
                f"{path}: field {field!r} is {fields[k].describe()}; token windows need a "
                "ragged 1-D integer field, e.g. uint16[*]"
            )
        return k, fields[k]
    if len(fit) != 1:
        found = [fields[k].name for k in fit]
        what = "none" if not fit else f"several: {found}; name one with field="
        raise UsageError(
            f"{path}: token windows need one ragged 1-D integer field (uint16[*]); found {what}"
        )
    return fit[0], fields[fit[0]]


class WindowPlan:
    """One batch of windows of a TokenWindows, planned (:meth:`TokenWindows.plan`): each
    window's stream span ``[lo, hi)`` and the documents ``first..last`` it touches; where the
    pack's bytes are sliced (MAPPED, H5_SPANS), its pieces, one a document a window holds
    (TokenWindows._pieces)."""

    __slots__ = ("first", "hi", "last", "lo", "pieces")

    def __init__(self, lo, hi, first, last, pieces):
        self.lo, self.hi, self.first, self.last, self.pieces = lo, hi, first, last, pieces

    def __len__(self) -> int:
        return len(self.lo)


class TokenWindows(PythonIndexing, Dataset):
    """Fixed windows of a token pack's stream (module docstring). Build it with
    ``gpufeed.open_dataset(path, block_size=B, field=None, eos=None, boundaries=False)``."""

    def __init__(
        self,
        path: str | os.PathLike,
        block_size: int,
        *,
        field: str | None = None,
        eos: int | None = None,
        boundaries: bool = False,
        pad_id: int = 0,
        **reader_options: Any,
    ):
        self.path = str(path)
        self.reader = open_reader_at(path, **reader_options)
        self.block_size = _positive(self.path, "block_size", block_size)
        self.field_index, self.field = token_field(self.path, self.reader.spec, field)
        self.dtype = np.dtype(self.field.dtype).newbyteorder("=")
        # the id pack_tokens already ended each document with (the manifest says): never
        # appended twice
        self.stream_eos = self._stream_eos()
        self.eos = None if eos is None else self._fits("eos", eos)
        if self.eos is not None and self.stream_eos is not None:
            if self.eos != self.stream_eos:
                raise UsageError(
                    f"{self.path}: its documents already end with eos {self.stream_eos} "
                    f"(manifest {MANIFEST_KEY}.eos); eos={self.eos} would add another: "
                    "open it without eos="
                )
            self.eos = None
        self.pad_id = self._fits("pad_id", pad_id)
        self.boundaries = bool(boundaries)
        lengths = document_lengths(self.reader, self.field_index, self.field)
        self.stored = lengths  # tokens stored per document (no eos)
        self._map = None
        self.mode = self._read_mode()
        if self.mode != RECORDS:  # where each document's tokens start, counted in tokens
            self.token_at = (self.reader.offsets[:-1] + HEAD_BYTES) // self.dtype.itemsize
        self.lengths = lengths + (0 if self.eos is None else 1)  # tokens per document
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))  # [N + 1] in the stream
        self.total_tokens = int(self.starts[-1])
        if self.boundaries:
            per_doc = -(-self.lengths // self.block_size)
            # window w: document doc_of[w], from token first[w] of it
            self.doc_of = np.repeat(np.arange(len(per_doc), dtype=np.int64), per_doc)
            first_window = np.concatenate(([0], np.cumsum(per_doc)))[:-1]
            self.first = (np.arange(len(self.doc_of)) - first_window[self.doc_of]) * block_size

    def _fits(self, name: str, value) -> int:
        value = int(value)
        info = np.iinfo(self.dtype)
        if not int(info.min) <= value <= int(info.max):
            raise UsageError(
                f"{self.path}: {name}={value} does not fit the token field's {self.dtype.name}"
            )
        return value

    def _stream_eos(self) -> int | None:
        """The eos id the pack's writer (pack_tokens) put at the end of every document of
        this field, from the manifest (checked: an integer the token dtype holds), or None."""
        record = self.reader.manifest.get(MANIFEST_KEY)
        if not isinstance(record, dict) or record.get("field", self.field.name) != self.field.name:
            return None
        eos = record.get("eos")
        if eos is None:
            return None
        if isinstance(eos, bool) or not isinstance(eos, int):
            raise DataError(
                f"{self.path}: manifest {MANIFEST_KEY}.eos is {eos!r}, not a token id; re-pack it"
            )
        try:
            return self._fits(f"manifest {MANIFEST_KEY}.eos", eos)
        except UsageError as e:
            raise DataError(f"{e}; re-pack it") from None

    def __len__(self) -> int:
        if self.boundaries:
            return len(self.doc_of)
        return self.total_tokens // self.block_size

    def _read_mode(self) -> str:
        """MAPPED or H5_SPANS where every record is the one uncompressed native-order field
        and starts at a multiple of the token size (its tokens are then slices of the pack's
        bytes): mmap and contiguous HDF5 packs are mapped, other HDF5 ones read through h5py.
        RECORDS otherwise."""
        reader, offsets = self.reader, getattr(self.reader, "offsets", None)
        plain = (
            len(reader.spec.schema.fields) == 1
            and not self.field.compression
            and np.dtype(self.field.dtype).isnative
            and isinstance(offsets, np.ndarray)
            and bool((offsets % self.dtype.itemsize == 0).all())
        )
        if plain and reader.format_name == "mmap":
            return MAPPED
        if plain and reader.format_name == "hdf5":
            return MAPPED if reader.mmap_offset is not None else H5_SPANS
        return RECORDS

    def plan(self, indices, *, checked: bool = False) -> WindowPlan:
        """The windows at ``indices`` (checked as Python checks them unless ``checked``: an
        int64 array in range already), planned."""
        idx = indices if checked else as_index_array(indices, len(self), self.path)
        if self.boundaries:
            docs = self.doc_of[idx]
            lo = self.starts[docs] + self.first[idx]
            hi = np.minimum(self.starts[docs + 1], lo + self.block_size)
        else:
            lo = idx * self.block_size
            hi = lo + self.block_size
        first = np.searchsorted(self.starts, lo, side="right") - 1
        last = np.searchsorted(self.starts, np.maximum(hi - 1, lo), side="right") - 1
        pieces = None if self.mode == RECORDS else self._pieces(lo, hi, first, last)
        return WindowPlan(lo, hi, first, last, pieces)

    def read_ahead(self, indices) -> None:
        """Start reading the windows at ``indices`` into the page cache without waiting (a
        hint)."""
        self.start(self.plan(indices))

    def start(self, plan: WindowPlan) -> None:
        """Start the reads of a planned batch, not waiting for them: the page cache is asked
        for every piece of a mapped pack at once, a reader that reads ahead for the
        documents. A mixture starts each of its sources before it fills from any."""
        if self.mode == MAPPED:
            _, doc, src, n, _, _, begins = plan.pieces
            self._read_ahead(self._mapped(), doc[begins], src, n)
        elif self.mode == RECORDS and callable(getattr(self.reader, "read_ahead", None)):
            self.reader.read_ahead(_ranges(plan.first, plan.last))

    def new_rows(self, count: int) -> np.ndarray:
        """An array for ``count`` windows, [count, B], the padding already in (windows
        without boundaries are whole: nothing to pad)."""
        shape = (count, self.block_size)
        if not self.boundaries:
            return np.empty(shape, dtype=self.dtype)
        return np.full(shape, self.pad_id, dtype=self.dtype)

    def fill(self, plan: WindowPlan, out: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Copy the planned windows into rows ``rows`` of ``out`` (from new_rows; default
        its first rows, in order)."""
        if self.mode != RECORDS:
            self._fill_pieces(plan.pieces, out, rows, len(plan))
        else:
            self._fill_records(plan, out, np.arange(len(plan)) if rows is None else rows)

    def as_items(self, out: np.ndarray, spans: np.ndarray) -> list:
        """The items of filled windows: the rows of ``out`` (tensors sharing its memory),
        or with boundaries ``{"tokens", "mask"}`` dicts (``spans``: each window's tokens)."""
        rows = list(torch.from_numpy(out))
        if not self.boundaries:
            return rows
        mask = torch.from_numpy(np.arange(self.block_size) < spans[:, None])
        return [{"tokens": t, "mask": m} for t, m in zip(rows, mask, strict=True)]

    def __getitems__(self, indices) -> list:
        """The windows at ``indices``, one gather (module docstring). make_loader's batches
        name the batch after them (``ahead``): its reads start now."""
        ahead = getattr(indices, "ahead", None)
        if ahead:
            self.read_ahead(ahead)
        ranges = getattr(indices, "ranges", None)
        if ranges and self.mode == MAPPED:
            self._read_ahead_blocks(ranges)
        plan = self.plan(indices)
        self.start(plan)
        out = self.new_rows(len(plan))
        self.fill(plan, out)
        return self.as_items(out, plan.hi - plan.lo)

    def _fill_records(self, plan: WindowPlan, out: np.ndarray, rows: np.ndarray) -> None:
        """RECORDS: every document the windows touch read in one read_batch, each window's
        part of each copied."""
        docs = _ranges(plan.first, plan.last)
        tokens = self._read(docs)
        # per document touched: its tokens, where it starts in the stream, its length
        stream = (tokens, self.starts[docs].tolist(), self.lengths[docs].tolist())
        at = np.searchsorted(docs, plan.first).tolist()
        spans = zip(plan.lo.tolist(), plan.hi.tolist(), at, rows.tolist(), strict=True)
        for a, b, j, r in spans:
            self._fill(out[r], a, b, j, stream)

    def _fill(self, row: np.ndarray, a: int, b: int, j: int, stream) -> None:
        """Stream tokens [a, b), starting in the j-th document read, into ``row``."""
        tokens, starts, lengths = stream
        filled = 0
        while a < b:
            doc = tokens[j]
            off = a - starts[j]
            take = min(b - a, lengths[j] - off)
            body = min(take, max(0, len(doc) - off))  # tokens of the document; then its eos
            row[filled : filled + body] = doc[off : off + body]
            if take > body:
                row[filled + body] = self.eos
            filled, a, j = filled + take, a + take, j + 1

    def _read(self, docs: np.ndarray) -> list[np.ndarray]:
        """The token arrays of documents ``docs`` (sorted, distinct): one read_batch."""
        records = self.reader.read_batch(docs)
        parts = document_tokens(self.reader, self.field_index, self.field, records, docs)
        self._check_lengths(parts, docs)
        return parts

    def _mapped(self) -> np.ndarray:
        """The pack's record bytes as one plain uint8 array (slicing a np.memmap costs more
        than the copy of a window), of the map the reader opened in this process."""
        handle = self.reader.handle  # opened (again) in this process, checked by the reader
        if self._map is None or self._map[0] is not handle:
            self._map = (handle, np.asarray(handle).reshape(-1).view(np.uint8))
        return self._map[1]

    def _pieces(self, lo, hi, first, last):
        """Each window's pieces, one a document it touches: (window, document, first token
        in the file's tokens, tokens to copy, whether the eos follows, place in the window,
        whether it is the document's start)."""
        counts = last - first + 1
        win = np.repeat(np.arange(len(lo)), counts)
        doc = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        doc += first[win]
        begin = self.starts[doc]
        start = np.maximum(lo[win], begin)
        a = start - begin  # within the document
        b = np.minimum(hi[win], self.starts[doc + 1]) - begin
        n = np.maximum(np.minimum(b, self.stored[doc]) - a, 0)
        eos = b > self.stored[doc]
        return win, doc, self.token_at[doc] + a, n, eos, start - lo[win], a == 0

    def _fill_pieces(self, pieces, out: np.ndarray, rows, count: int) -> None:
        """MAPPED, H5_SPANS: each piece one slice copy into the flat ``out`` (rows of B),
        out of the map or out of one read of the batch's byte spans (with every document's
        head, checked)."""
        win, doc, src, n, eos, at, begins = pieces
        # the heads of the documents whose start a window holds: they lie just before their
        # piece, in its page (a head of every document touched was one more random read
        # cold, a window starting mid-document)
        headed = doc[begins]
        itemsize, heads = self.dtype.itemsize, self.reader.offsets[headed]
        if self.mode == MAPPED:
            data = self._mapped()
        else:  # the pieces' bytes and the heads, one h5py read; positions in its buffer
            starts = np.concatenate((src * itemsize, heads))
            sizes = np.concatenate((n * itemsize, np.full(len(heads), HEAD_BYTES)))
            data, spans = read_h5_spans(self.reader.handle, starts, sizes, self.reader.path)
            src = spans.locate(src * itemsize) // itemsize
            heads = spans.locate(heads)
        self._check_heads(data, headed, heads)
        tokens = data.view(self.dtype)
        if not self.boundaries:
            self._concatenate(tokens, src, n, eos, out, rows, count)
            return
        rows = np.arange(count) if rows is None else rows
        dst = rows[win] * self.block_size + at
        flat = out.reshape(-1)
        for d, a, k in zip(dst.tolist(), src.tolist(), n.tolist(), strict=True):
            flat[d : d + k] = tokens[a : a + k]
        if self.eos is not None:
            flat[(dst + n)[eos]] = self.eos

    def _concatenate(self, tokens, src, n, eos, out: np.ndarray, rows, count: int) -> None:
        """Whole windows: their pieces (each followed by its eos where one follows) lie back
        to back in the windows' rows, so one concatenate copies them all (which refuses a
        total other than the rows' size)."""
        parts = [tokens[a : a + k] for a, k in zip(src.tolist(), n.tolist(), strict=True)]
        if self.eos is not None and eos.any():
            sep = np.full(1, self.eos, dtype=self.dtype)
            for j in np.flatnonzero(eos)[::-1].tolist():
                parts.insert(j + 1, sep)
        if rows is None:
            np.concatenate(parts, out=out[:count].reshape(-1))
        else:
            out[rows] = np.concatenate(parts).reshape(count, self.block_size)

    def _read_ahead_blocks(self, ranges) -> None:
        """make_loader's blocks of the order to come (window ranges ``[a, b)``): each one
        WILLNEED over the bytes of the documents it spans, one large read a block instead of
        a fault a window, unless its first bytes look cached."""
        ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        ends = np.stack((ranges[:, 0], np.maximum(ranges[:, 1] - 1, ranges[:, 0])), axis=1)
        plan = self.plan(np.minimum(ends.reshape(-1), len(self) - 1), checked=True)
        first, last = plan.first[0::2], plan.last[1::2]
        begin, end = self.reader.offsets[first], self.reader.offsets[last + 1]
        flat = self._mapped()
        base = flat.ctypes.data
        cached = self.reader.cached or looks_cached
        spans = zip(begin.tolist(), (end - begin).tolist(), strict=True)
        advise_willneed((base + a, k) for a, k in spans if k and not cached(base + a, k))

    def _read_ahead(self, flat, doc, src, n) -> None:
        """WILLNEED for every piece's bytes and the heads of documents ``doc``, unless the
        first piece looks cached: the reads then run together, not one fault after another."""
        itemsize, base = self.dtype.itemsize, flat.ctypes.data
        cached = self.reader.cached or looks_cached  # mincore, or the file where it cannot
        if not len(src) or cached(base + int(src[0]) * itemsize, int(n[0]) * itemsize):
            return
        head = self.reader.offsets[doc]
        starts = np.concatenate((head, src * itemsize)).tolist()
        sizes = np.concatenate((np.full(len(head), HEAD_BYTES), n * itemsize)).tolist()
        advise_willneed((base + a, k) for a, k in zip(starts, sizes, strict=True) if k)

    def _check_heads(self, data: np.ndarray, docs: np.ndarray, at: np.ndarray) -> None:
        """The records' two int64 heads (the field size, the length; at ``at`` in
        ``data``) checked at once against the lengths counted at open: a record that
        disagrees is an error."""
        k = self.dtype.itemsize  # the heads gathered as tokens (records start at a multiple)
        words = data.view(self.dtype)[(at // k)[:, None] + np.arange(HEAD_BYTES // k)]
        heads = words.view("<i8").reshape(-1, 2)
        n = self.stored[docs]
        size = self.reader.offsets[docs + 1] - self.reader.offsets[docs] - 8
        bad = (heads[:, 0] != size) | (heads[:, 1] != n)
        if bad.any():
            j = int(np.argmax(bad))
            doc = int(docs[j])
            raise CorruptSampleError(
                self.reader.location(doc),
                doc,
                f"field {self.field.name!r}: its record heads {heads[j].tolist()} do not hold "
                f"a document of {int(n[j])} tokens: re-pack it",
            )

    def _check_lengths(self, parts: list[np.ndarray], docs: np.ndarray) -> None:
        """A document read must hold the tokens counted when the dataset was made: else the
        windows would shift silently."""
        want = self.lengths[docs] - (0 if self.eos is None else 1)
        for j, (p, n) in enumerate(zip(parts, want.tolist(), strict=True)):
            if len(p) != n:
                doc = int(docs[j])
                raise CorruptSampleError(
                    self.reader.location(doc),
                    doc,
                    f"holds {len(p)} tokens, {n} when the dataset was opened: the pack "
                    "changed or is damaged (open it again; check it with gpufeed verify)",
                )

    def close(self) -> None:
        """Close the reader and drop this process's map (its pages can then be evicted)."""
        self._map = None
        self.reader.close()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_map"] = None  # the map is this process's (the reader opens its own)
        return state

    def __repr__(self) -> str:
        how = ", boundaries" if self.boundaries else ""
        return (
            f"TokenWindows({self.path!r}, {len(self)} windows of {self.block_size} "
            f"{self.dtype.name} tokens{how}, {len(self.lengths)} documents)"
        )


def _positive(path: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise UsageError(f"{path}: {name} must be a positive integer, got {value!r}")
    return int(value)


def _ranges(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """The distinct integers of the ranges [first[j], last[j]], sorted."""
    counts = last - first + 1
    starts = np.repeat(first - np.concatenate(([0], np.cumsum(counts)))[:-1], counts)
    return np.unique(starts + np.arange(int(counts.sum())))
