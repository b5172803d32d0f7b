"""The LMDB format's keys: zero-padded sample indices (b"%010d") and the index keys, which
sort after every sample key."""

from __future__ import annotations

import numpy as np

LOCK_FILE = "lock.mdb"
META_KEY = b"__gpufeed__"
LABELS_KEY = b"__labels__"
CRC_KEY = b"__crc32__"
KEY_BYTES = 10  # a sample key's length


def key(index: int) -> bytes:
    return b"%010d" % index  # KEY_BYTES


KEY_PLACES = 10 ** np.arange(KEY_BYTES - 1, -1, -1, dtype=np.int64)  # each digit's worth


def keys(indices: np.ndarray) -> list[bytes]:
    """key(i) for every index, built in numpy: a Python format per key cost a third of a warm
    batch's read (docs/performance/index.md, "Measurements behind the code")."""
    digits = (np.asarray(indices, dtype=np.int64)[:, None] // KEY_PLACES) % 10 + ord("0")
    return digits.astype(np.uint8).view("S10").ravel().tolist()
