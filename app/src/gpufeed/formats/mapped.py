"""What the readers whose samples lie in one mapped array share (mmap, mapped HDF5): their
read-ahead and their batch copy, in one place.

The samples are fixed-shape rows (``offsets`` None) or the encoded bytes ``offsets`` index.
A reader mixes :class:`MappedSamples` in before :class:`~gpufeed.formats.base.Reader`, keeps
a ``BlocksAhead`` as ``self.ahead`` (drained before its map can be unmapped) and says where
its samples are mapped (:meth:`MappedSamples.mapped_samples`).
"""

from __future__ import annotations

import numpy as np

from gpufeed.formats.base import span_views
from gpufeed.formats.spec import SampleSpec
from gpufeed.pagecache.advise import (
    BlocksAhead,
    advise_buffers,
    advise_rows,
    advise_samples,
    map_looks_warm,
)
from gpufeed.pagecache.copy import take_rows

__all__ = ["MappedSamples"]


class MappedSamples:
    """Read-ahead (``Reader.read_ahead``, ``read_ahead_ranges``, ``looks_warm``) and the copy
    of a batch (:meth:`read_mapped`) for samples in one mapped array."""

    ahead: BlocksAhead
    offsets: np.ndarray | None
    spec: SampleSpec

    reads_ranges_ahead = True

    def mapped_samples(self) -> np.ndarray | None:
        """The mapped array of the samples, or None where they are not mapped (read through
        a library's cache, or still downloading): nothing is read ahead then."""
        raise NotImplementedError

    def read_ahead(self, indices: np.ndarray) -> None:
        data = self.mapped_samples()
        if data is not None:
            advise_samples(data, self.offsets, indices, self.cached)

    def read_ahead_ranges(self, ranges) -> None:
        data = self.mapped_samples()
        if data is not None:
            self.ahead.announce_ranges(data, self.offsets, ranges)

    def looks_warm(self) -> bool:
        data = self.mapped_samples()
        return data is not None and map_looks_warm(data, self.cached)

    def read_mapped(self, data: np.ndarray, indices: np.ndarray):
        """Samples ``indices`` of the mapped array ``data``: a [B, ...] array copied out of
        it, or views of the encoded bytes (asked for ahead when large)."""
        self.ahead.ready(indices)  # its blocks resident: the copy faults nothing in
        if self.spec.kind == "array":
            advise_rows(data, indices, self.cached)
            out = np.empty((len(indices), *self.spec.shape), dtype=self.spec.dtype)
            take_rows(data, indices, out)
            return out
        views = span_views(data, self.offsets[indices], self.offsets[indices + 1])
        advise_buffers(views, cached=self.cached)
        return views
