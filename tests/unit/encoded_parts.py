"""A committed part of encoded records, as the format writers' tests feed them."""

from __future__ import annotations

import numpy as np

from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec


def encoded_part(payload: np.ndarray, sizes) -> Part:
    """A part of records of these sizes, back to back in ``payload`` (labels and inputs
    0..n-1, crc32s not checked by the writers)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    n = len(sizes)
    return Part(
        payload=payload,
        offsets=offsets,
        labels=np.arange(n, dtype=np.int64),
        crc32=np.zeros(n, np.uint32),
        items=np.arange(n, dtype=np.int64),
        exts=np.full(n, "bin", "<U8"),
        skip_items=np.zeros(0, np.int64),
        skip_errors=np.zeros(0, str),
        spec=SampleSpec("encoded"),
    )
