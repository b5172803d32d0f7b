"""What one stored sample is (the manifest's ``sample``), and the on-disk layout version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FORMAT_VERSION", "SampleSpec"]

# The on-disk layout version every format writes (the manifest's format_version).
FORMAT_VERSION = 1


@dataclass(frozen=True)
class SampleSpec:
    """What one stored sample is.

    kind "array": every sample is an array of `dtype` and `shape` (decoded images are uint8 CHW).
    kind "encoded": every sample is an encoded file's bytes (JPEG, PNG, ...), decoded on read.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        if self.kind != "array":
            raise ValueError("encoded samples have no fixed size")
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_json(self) -> dict[str, Any]:
        if self.kind == "array":
            return {"kind": "array", "dtype": self.dtype, "shape": list(self.shape)}
        return {"kind": "encoded"}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SampleSpec:
        if d["kind"] == "array":
            return cls("array", str(d["dtype"]), tuple(int(x) for x in d["shape"]))
        return cls("encoded")
