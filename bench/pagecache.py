"""The suite's page-cache checks and the one root-only way to empty the cache. Imports no
torch (of gpufeed only its torch-free page-cache rule): the root helper of a row read as
another user (bench/read_as.py) runs them in a small interpreter of its own."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from gpufeed.pagecache.probe import mincore_sees

__all__ = ["NOT_COLD", "drop_all_caches", "resident_fraction"]

# a cold pass with more of its files still cached after the eviction is marked "not cold"
NOT_COLD = 0.05


def resident_fraction(paths: list[str]) -> float:
    """The share of ``paths``' pages in the page cache (mincore), to check that an eviction
    worked: pages a process still maps are skipped by posix_fadvise(DONTNEED) and even by
    drop_caches (FFCV keeps its .beton mapped for the life of the process: its "cold" passes
    read from memory).

    NaN when it cannot tell: for a file the caller neither owns nor may write, the kernel
    reports every page resident (mm/mincore.c, can_do_mincore: no page-cache side channel),
    e.g. a bench user in a container reading data the host's root wrote."""
    if any(not mincore_sees(p) for p in paths):
        return float("nan")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    cached = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            pages = (size + page - 1) // page
            vec = np.zeros(pages, dtype=np.uint8)
            view = np.frombuffer(m, dtype=np.uint8)
            failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), size, vec.ctypes.data)
            del view  # the map cannot close while a view exports it
            if failed:
                return float("nan")
            cached += int(np.count_nonzero(vec & 1))
            total += pages
    return cached / total if total else 0.0


def drop_all_caches() -> None:
    """``echo 3 > /proc/sys/vm/drop_caches`` (root): dentries and inodes too."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
