"""LMDB environments shared by the readers of one process."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from gpufeed.errors import DataError
from gpufeed.pagecache.maps import KEEP_MAPS, covers, on_forget

__all__ = ["DATA_FILE", "DEFAULT_READAHEAD", "acquire_env", "lmdb_error", "release_env"]

DATA_FILE = "data.mdb"

# LMDB forbids opening one environment twice in a process, so readers of the same files in
# one process (two datasets, a dataset and verify) share it: data.mdb's (device, inode) ->
# [pid, env, users, readahead, path]. A reader's key is its path and that identity (what py-lmdb
# itself tells environments apart by), and the identity picks the environment: a pack replaced
# at the same path is a new one, never the old environment's pages served as the new pack's,
# and a hard link of data.mdb elsewhere (a part of a merged pack, gpufeed.write.merge) is the
# same one. A reader made before data.mdb changed in place is refused at its first read
# (Reader.check_pinned: size and mtime).
_ENVS: dict[tuple, list] = {}

# Readahead on (LMDB leaves the map MADV_NORMAL): gpufeed reads whole blocks of neighbouring
# samples (the block shuffle, sorted batches), so the kernel's read-around fetches what the
# next samples need. torchvision's readahead=False (MADV_RANDOM) makes a cold read one 4 KiB
# page fault at a time: an order of magnitude slower cold, block-shuffled or fully random
# alike, no faster warm, and advising WILLNEED over a batch's values did not recover it
# (docs/performance/lmdb-reads.md). Pass readahead=False for purely random access to a dataset much
# bigger than RAM, where read-around would only evict useful pages.
DEFAULT_READAHEAD = True


def lmdb_error(path: Path, e: lmdb.Error) -> DataError:
    """An error of LMDB's (MDB_CORRUPTED, MDB_INVALID, MDB_PAGE_NOTFOUND, ...) as one naming
    the file and what to do."""
    return DataError(
        f"{path}: LMDB cannot read it ({type(e).__name__}: {e}); the file is damaged or not "
        "an LMDB environment: check it with gpufeed verify, or re-pack it"
    )


def acquire_env(key: tuple, readahead: bool = DEFAULT_READAHEAD):
    """The environment of `key` (path, device, inode of its data.mdb), opened or shared."""
    pid, ident = os.getpid(), key[1:]
    entry = _ENVS.get(ident)
    if entry is not None and entry[0] != pid:
        # Inherited through fork: LMDB handles must not be used across fork, and py-lmdb
        # refuses to open the path again while this one is registered. Closing it here only
        # unmaps the child's copy: the env is read-only with lock=False, so there is no
        # shared lock table the parent could notice.
        entry[1].close()
        entry = None
    if entry is not None and entry[2] <= 0 and entry[3] != readahead:
        del _ENVS[ident]  # a kept idle env opened the other way: open it as asked
        entry[1].close()
        entry = None
    if entry is None:
        for other in [k for k, e in _ENVS.items() if e[4] == key[0] and e[2] <= 0]:
            _ENVS.pop(other)[1].close()  # an idle env of the file this path held before
        try:
            env = lmdb.open(
                key[0],
                subdir=True,
                readonly=True,
                lock=False,
                readahead=readahead,
                meminit=False,
                max_readers=1024,
            )
        except lmdb.Error as e:  # py-lmdb's messages name no file
            raise lmdb_error(Path(key[0]) / DATA_FILE, e) from None
        entry = _ENVS[ident] = [pid, env, 0, readahead, key[0]]
    _ENVS[ident] = _ENVS.pop(ident)  # the most recently used last: idle ones close oldest first
    entry[2] += 1
    return entry[1]


def release_env(key: tuple, env) -> None:
    entry = _ENVS.get(key[1:])
    if entry is None or entry[1] is not env or entry[0] != os.getpid():
        return
    entry[2] -= 1
    # An env nobody uses stays open (up to KEEP_MAPS of them) for the next reader of this file
    # in this process: a new one would map data.mdb anew, every warm page a fault again.
    idle = [k for k, e in _ENVS.items() if e[2] <= 0 and e[0] == entry[0]]
    for k in idle[: max(0, len(idle) - KEEP_MAPS)]:
        _ENVS.pop(k)[1].close()


def _close_idle_envs(path: str | None) -> None:
    """Close the kept envs nobody uses (of the pack whose data.mdb, folder or a folder
    above it is ``path``, when given)."""
    for key in [k for k, e in _ENVS.items() if e[2] <= 0 and e[0] == os.getpid()]:
        if covers(Path(_ENVS[key][4]) / DATA_FILE, path):
            _ENVS.pop(key)[1].close()


on_forget(_close_idle_envs)
