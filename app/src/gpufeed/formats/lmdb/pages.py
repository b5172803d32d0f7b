"""Where each record's value lies in data.mdb, read from LMDB's B-tree pages in numpy (the
writer's value table, lmdb.values): a level of the tree at a time, every page of a level in
one array operation, instead of a lookup and a Python call per record (a million lookups
were a third of a streamed LMDB pack's close).

The layout is LMDB 0.9's on a 64-bit little-endian build (lmdb.h, mdb.c; a data file of
another version has another ``version`` in its meta page and is not read): a page starts
with its number (8 bytes), 2 bytes of padding, its flags, and ``lower`` (the end of its
array of node offsets, which follows at byte 16); a node is ``lo``, ``hi`` (the data's
size, or with ``flags`` a branch's child page number), ``flags``, the key's size, the key
and, in a leaf, the data: inline, or (F_BIGDATA) the number of the overflow page whose
bytes after its 16-byte header hold it. The root is the main database's in the meta page
(page 0 or 1) of the higher transaction id.

Nothing found here is trusted as it is: a page or node that is not what the layout says
(a flag, an offset or a page number out of place) raises Layout before any read outside
the file, and the writer checks what is found against what it wrote (every key and size:
lmdb.values.paged_table) and three records against LMDB's lookups before it is used.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

__all__ = ["Layout", "gather", "leaf_values", "mapped"]

PAGE_HEADER = 16  # PAGEHDRSZ
NODE_HEADER = 8  # NODESIZE
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01
MAGIC, DATA_VERSION = 0xBEEFC0DE, 1
LEAF_CHUNK = 4096  # leaf pages read at a time (up to ~150 records each: 600k rows)
BRANCH_CHUNK = 256  # branch pages read at a time (a few hundred children each)

_DB = np.dtype(
    [
        ("pad", "<u4"),
        ("flags", "<u2"),
        ("depth", "<u2"),
        ("branch_pages", "<u8"),
        ("leaf_pages", "<u8"),
        ("overflow_pages", "<u8"),
        ("entries", "<u8"),
        ("root", "<u8"),
    ]
)
_META = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u4"),
        ("address", "<u8"),
        ("mapsize", "<u8"),
        ("free", _DB),
        ("main", _DB),
        ("last_pgno", "<u8"),
        ("txnid", "<u8"),
    ]
)


class Layout(ValueError):
    """A page that is not where or what LMDB's layout says."""


def mapped(path: Path) -> tuple[mmap.mmap, np.ndarray]:
    """A read-only map of the file and a uint8 array over it (the array released before the
    map is closed)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    return m, np.frombuffer(m, dtype=np.uint8)


def gather(data: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """uint8 [len(at), width]: the ``width`` bytes at each byte offset of ``at`` (one
    gather from the map seen as overlapping rows, row k at byte k)."""
    if len(at) and (int(at.min()) < 0 or int(at.max()) + width > len(data)):
        raise Layout("a field past the end of the file")
    rows = np.lib.stride_tricks.as_strided(
        data, shape=(len(data) - width + 1, width), strides=(1, 1), writeable=False
    )
    return rows[at]


def meta(data: np.ndarray, psize: int) -> np.void:
    """The current meta page's fields (_META): of pages 0 and 1, the higher transaction's."""
    if len(data) < 2 * psize:
        raise Layout("shorter than its two meta pages")
    metas = [data[p * psize + PAGE_HEADER :][: _META.itemsize].view(_META)[0] for p in (0, 1)]
    best = metas[int(metas[0]["txnid"] < metas[1]["txnid"])]
    if int(best["magic"]) != MAGIC or int(best["version"]) != DATA_VERSION:
        raise Layout("not an LMDB 0.9 data file of this byte order")
    return best


def _field(word: np.ndarray, byte: int, width: int) -> np.ndarray:
    """The ``width``-byte field at ``byte`` of little-endian 8-byte words, as int64."""
    return ((word >> np.uint64(8 * byte)) & np.uint64((1 << (8 * width)) - 1)).astype(np.int64)


def _slots(count: np.ndarray) -> np.ndarray:
    """0..count[i]-1 for each i, one after the other."""
    return np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)


class _Pages:
    """The pages of a map of data.mdb (``data``) up to page ``last``, read in numpy: every
    field a gather of the 8 bytes that start at it (the map seen as one unaligned 8-byte
    word at each byte: a page's header, a node's header, an overflow page number, each
    one gather)."""

    def __init__(self, data: np.ndarray, psize: int, last: int):
        if len(data) < 8 or (last + 1) * psize > len(data):
            raise Layout("its last page past the end of the file")
        self.data, self.psize, self.last = data, psize, last
        self.words = np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))

    def word(self, at: np.ndarray) -> np.ndarray:
        """The 8 bytes at each byte offset of ``at``, as a little-endian uint64."""
        if len(at) and (int(at.min()) < 0 or int(at.max()) >= len(self.words)):
            raise Layout("a field past the end of the file")
        return self.words[at]

    def nodes(self, pages: np.ndarray, flag: int) -> tuple[np.ndarray, np.ndarray]:
        """(page offset of each node, node offset) of ``pages`` in order, every page of
        ``flag``'s kind with at least one node, every node inside its page after the
        array of node offsets."""
        if len(pages) and (int(pages.min()) < 2 or int(pages.max()) > self.last):
            raise Layout("a page number past the last page")
        base = pages * self.psize
        head = self.word(base + 8)  # pad, flags, lower, upper
        lower = _field(head, 4, 2)
        count = (lower - PAGE_HEADER) >> 1
        if np.any(_field(head, 2, 2) != flag) or np.any(count < 1) or np.any(lower > self.psize):
            raise Layout(f"a page that is not of kind {flag:#x} or holds no node")
        ptr = self._offsets(base, count)
        owner = np.repeat(base, count)
        if np.any(ptr < np.repeat(lower, count)) or np.any(ptr + NODE_HEADER > self.psize):
            raise Layout("a node outside its page")
        return owner, owner + ptr

    def _offsets(self, base: np.ndarray, count: np.ndarray) -> np.ndarray:
        """The node offsets (2 bytes each from byte 16) of pages at ``base`` holding
        ``count`` nodes, in order: four a gather (one cache line with the page's header)."""
        words = (count + 3) >> 2
        slot = _slots(words)
        lanes = self.word(np.repeat(base, words) + PAGE_HEADER + 8 * slot).view("<u2")
        held = 4 * slot[:, None] + np.arange(4) < np.repeat(count, words)[:, None]
        return lanes.reshape(-1, 4)[held].astype(np.int64)

    def children(self, pages: np.ndarray) -> np.ndarray:
        """The child page numbers of branch ``pages``, in key order."""
        _, node = self.nodes(pages, P_BRANCH)
        return _field(self.word(node), 0, 6)  # lo, hi, flags: a 48-bit page number

    def leaves(self, pages: np.ndarray) -> np.ndarray:
        """int64 [nodes, 4]: each node's (key offset, key size, value offset, value size)
        of leaf ``pages``, in key order."""
        owner, node = self.nodes(pages, P_LEAF)
        head = self.word(node)  # lo, hi, flags, key size
        size, flags, ksize = _field(head, 0, 4), _field(head, 4, 2), _field(head, 6, 2)
        key = node + NODE_HEADER
        value = key + ksize
        big = flags == F_BIGDATA
        if np.any((flags != 0) & ~big):
            raise Layout("a record that is a sub-database or duplicates")
        inline = ~big
        if np.any(value[inline] + size[inline] > owner[inline] + self.psize):
            raise Layout("an inline value past its page")
        if np.any(value[big] + 8 > owner[big] + self.psize):
            raise Layout("an overflow page number past its page")
        value[big] = self._overflow(self.word(value[big]).astype(np.int64), size[big])
        return np.stack([key, ksize, value, size], axis=1)

    def _overflow(self, pages: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Where values of ``sizes`` bytes on overflow ``pages`` start (after the page's
        header), each page one and the value inside the file."""
        if len(pages) and (int(pages.min()) < 2 or int(pages.max()) > self.last):
            raise Layout("an overflow page past the last page")
        head = self.word(pages * self.psize + 8)
        start = pages * self.psize + PAGE_HEADER
        if np.any(_field(head, 2, 2) != P_OVERFLOW) or np.any(start + sizes > len(self.data)):
            raise Layout("a value's overflow page is not one, or ends past the file")
        return start


def leaf_values(data: np.ndarray, psize: int, txnid: int):
    """Every record of the main database of map ``data`` (the file, psize-byte pages) as of
    transaction ``txnid``: yields int64 [nodes, 4] blocks of (key offset, key size, value
    offset, value size), in key order. Layout where the file is not as LMDB writes it, or
    its last transaction is another."""
    head = meta(data, psize)
    if int(head["txnid"]) != txnid:
        raise Layout(f"transaction {int(head['txnid'])}, not {txnid}")
    main, pages = head["main"], _Pages(data, psize, int(head["last_pgno"]))
    depth, root = int(main["depth"]), int(main["root"])
    if depth > 0:
        yield from _level(pages, np.array([root], dtype=np.int64), depth - 1)


def _level(pages: _Pages, numbers: np.ndarray, above: int):
    """leaf_values of the subtrees of pages ``numbers``, ``above`` levels above the leaves,
    a chunk of pages at a time (the arrays made stay small in a pack of any size)."""
    chunk = LEAF_CHUNK if above == 0 else BRANCH_CHUNK
    for lo in range(0, len(numbers), chunk):
        part = numbers[lo : lo + chunk]
        if above == 0:
            yield pages.leaves(part)
        else:
            yield from _level(pages, pages.children(part), above - 1)
