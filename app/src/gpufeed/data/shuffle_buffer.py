"""A stream's shuffle buffer: the samples read and not yet handed out.

Fixed-shape samples are copied once into a bounded heap buffer of slots (``SlotPool``) and
gathered from there: a batch drawn from ~20 runs read through a shard's memory map costs
the copy its page faults, from the heap it is one np.take (docs/performance/tar-stream.md,
"Tar read like mmap"). Encoded and multi-field samples, and buffers too big to copy
(``SLOT_POOL_MAX_BYTES``), are held as references to the runs as read (``SamplePool``).
Where the reader can gather samples in any order from its kept maps (a local tar pack of
fixed-shape samples at one stride a shard, formats/tar/rows.py), the pool holds only their
indices (``RowPool``): a batch is gathered once, like the mmap reader's, with no copy into
slots first.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from gpufeed.pagecache.copy import take_rows

__all__ = ["SLOT_POOL_MAX_BYTES", "RowPool", "SamplePool", "SlotPool", "make_pool"]

# the most heap one reading process copies its shuffle buffer into; a bigger buffer (a long
# shuffle_buffer of large samples) stays as references to the page cache
SLOT_POOL_MAX_BYTES = 256 << 20


def make_pool(payloads, capacity: int, shuffled: bool = True, gather=None):
    """The pool for a stream whose first run read is ``payloads``, holding up to
    ``capacity`` samples at once. ``gather(indices)``: the reader's own gather of samples
    in any order (RowPool), where it has one. Unshuffled, batches are runs in storage
    order: copied straight from the runs as read, once (SamplePool)."""
    if shuffled and gather is not None and isinstance(payloads, np.ndarray):
        return RowPool(gather)
    if shuffled and isinstance(payloads, np.ndarray) and payloads.ndim >= 1:
        row_bytes = payloads.dtype.itemsize * int(np.prod(payloads.shape[1:]))
        if capacity * row_bytes <= SLOT_POOL_MAX_BYTES:
            return SlotPool(payloads.shape[1:], payloads.dtype, capacity)
    return SamplePool()


class SlotPool:
    """Fixed-shape samples in one heap buffer of ``capacity`` slots: ``put`` copies a run
    in (one sequential read of its pages), ``take`` gathers slots into a new array (one
    np.take: no page faults, no intra-op threads) and frees them. ``positions`` index the
    samples held in the order they were put."""

    def __init__(self, shape: tuple, dtype, capacity: int):
        self.slots = np.empty((capacity, *shape), dtype=dtype)
        self.index = np.empty(capacity, dtype=np.int64)  # the sample in each slot
        self.live = np.empty(0, dtype=np.int64)  # slots held, in the order put
        self.free = np.arange(capacity, dtype=np.int64)

    @property
    def size(self) -> int:
        return len(self.live)

    def put(self, idx: np.ndarray, payloads: np.ndarray) -> None:
        n = len(idx)
        if n > len(self.free):
            raise ValueError(f"a run of {n} samples overfills the pool ({len(self.free)} free)")
        slots, self.free = self.free[:n], self.free[n:]
        first = int(slots[0]) if n else 0
        if n and int(slots[-1]) - first == n - 1 and np.all(np.diff(slots) == 1):
            self.slots[first : first + n] = payloads  # one sequential copy
        else:
            self.slots[slots] = payloads
        self.index[slots] = idx
        self.live = np.concatenate([self.live, slots])

    def take(self, positions: np.ndarray):
        """(indices, samples) at ``positions``, in that order, removed from the pool."""
        slots, self.live = _removed(self.live, positions)
        out = np.empty((len(slots), *self.slots.shape[1:]), dtype=self.slots.dtype)
        take_rows(self.slots, slots, out)
        self.free = np.concatenate([self.free, np.sort(slots)])
        return self.index[slots], out


class RowPool:
    """The samples read and not yet handed out, held as their indices only (in the order
    put): ``take`` gathers the drawn ones with ``gather(indices)`` (TarReader.read_rows:
    one fancy index a shard of its kept maps, whose pages the stream's read of each run
    made resident). What ``take`` returns is what SlotPool's would: the same samples in
    the order drawn."""

    def __init__(self, gather):
        self.gather = gather
        self.live = np.empty(0, dtype=np.int64)  # indices held, in the order put

    @property
    def size(self) -> int:
        return len(self.live)

    def put(self, idx: np.ndarray, payloads) -> None:
        self.live = np.concatenate([self.live, idx])

    def take(self, positions: np.ndarray):
        """(indices, samples) at ``positions``, in that order, removed from the pool."""
        idx, self.live = _removed(self.live, positions)
        return idx, self.gather(idx)


def _removed(live: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(live[positions] in that order, the rest of live in its order)."""
    keep = np.ones(len(live), dtype=bool)
    keep[positions] = False
    return live[positions], live[keep]


class SamplePool:
    """The samples read and not yet handed out, held as references, not copies: which chunk
    (as read) and which row in it. ``take`` gathers from each chunk its positions point
    into, once, straight into the batch: one copy per sample. A chunk is dropped when no
    position points into it any more."""

    def __init__(self) -> None:
        self.chunk = np.empty(0, dtype=np.int64)
        self.row = np.empty(0, dtype=np.int64)
        self.index = np.empty(0, dtype=np.int64)  # each held sample's index
        self.chunks: dict[int, list] = {}  # id -> [payloads, torch rows, live]
        self._next = 0

    @property
    def size(self) -> int:
        return len(self.chunk)

    def put(self, idx: np.ndarray, payloads) -> None:
        cid, self._next = self._next, self._next + 1
        rows = None
        if isinstance(payloads, np.ndarray) and not payloads.flags.c_contiguous:
            # members at a fixed stride in a read-only map: torch's index_select reads such
            # rows in place, where np.take would first copy the whole chunk
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "not writable": only read
                rows = torch.from_numpy(payloads.reshape(len(idx), -1).view(np.uint8))
        self.chunks[cid] = [payloads, rows, len(idx)]
        self.chunk = np.concatenate([self.chunk, np.full(len(idx), cid, dtype=np.int64)])
        self.row = np.concatenate([self.row, np.arange(len(idx), dtype=np.int64)])
        self.index = np.concatenate([self.index, np.asarray(idx, dtype=np.int64)])

    def take(self, positions: np.ndarray):
        """(indices, payloads) at ``positions``, removed from the pool, grouped by the chunk
        they were read in (storage order when ``positions`` is sorted)."""
        chunk_of, rows = self.chunk[positions], self.row[positions]
        order = np.argsort(chunk_of, kind="stable")
        chunk_of, rows = chunk_of[order], rows[order]
        out_idx = self.index[positions][order]
        keep = np.ones(self.size, dtype=bool)
        keep[positions] = False
        self.chunk, self.row, self.index = self.chunk[keep], self.row[keep], self.index[keep]
        ids, starts, counts = np.unique(chunk_of, return_index=True, return_counts=True)
        first = self.chunks[int(ids[0])][0]
        if not isinstance(first, np.ndarray):
            return out_idx, self._take_references(chunk_of, rows, ids, counts)
        n = len(positions)
        out = np.empty((n, *first.shape[1:]), dtype=first.dtype)
        out_rows = torch.from_numpy(out.reshape(n, -1).view(np.uint8))
        for cid, a, k in zip(ids.tolist(), starts.tolist(), counts.tolist(), strict=True):
            entry = self.chunks[cid]
            r = rows[a : a + k]
            if entry[1] is not None:
                # an unshuffled stream's runs too: torch's intra-op threads copy them faster
                # than a numpy slice copy (docs/performance/tar-stream.md)
                torch.index_select(entry[1], 0, torch.from_numpy(r), out=out_rows[a : a + k])
            else:
                take_rows(entry[0], r, out[a : a + k])
            self._release(cid, k)
        return out_idx, out

    def _take_references(self, chunk_of, rows, ids, counts) -> list:
        """take's samples held as a list each (encoded, fields): one Python lookup a sample
        (a numpy slice and index a run cost more: docs/performance/jpeg-decode.md)."""
        chunks = self.chunks
        out = [chunks[c][0][r] for c, r in zip(chunk_of.tolist(), rows.tolist(), strict=True)]
        for cid, k in zip(ids.tolist(), counts.tolist(), strict=True):
            self._release(cid, k)
        return out

    def _release(self, cid: int, taken: int) -> None:
        """``taken`` samples of chunk ``cid`` handed out: dropped once none is left."""
        entry = self.chunks[cid]
        entry[2] -= taken
        if entry[2] == 0:
            del self.chunks[cid]
