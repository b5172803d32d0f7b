"""What one stored sample is (the manifest's ``sample``), and the on-disk layout version."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.errors import DataError, UsageError
from gpufeed.formats.schema import MAX_DIMS, MAX_SAMPLE_BYTES, Schema

# the file that makes a folder a finished pack (gpufeed.formats.manifest reads and writes it)
MANIFEST_NAME = "manifest.json"

__all__ = ["FIELDS_FORMAT_VERSION", "FORMAT_VERSION", "SampleSpec"]

# The newest on-disk layout version this gpufeed reads (the manifest's format_version).
# Image and array packs are written as version 1 (unchanged, so older gpufeeds read them);
# multi-field packs as version 2, which older gpufeeds refuse by name instead of misreading.
FORMAT_VERSION = 2
FIELDS_FORMAT_VERSION = 2
KINDS = ("array", "encoded", "fields")


@dataclass(frozen=True)
class SampleSpec:
    """What one stored sample is.

    kind "array": every sample is an array of `dtype` and `shape` (decoded images are uint8 CHW).
    kind "encoded": every sample is an encoded file's bytes (JPEG, PNG, ...), decoded on read.
    kind "fields": every sample is a dict of named fields (`schema`), stored as one record
    (gpufeed.formats.record). The first two are the (image, label) packs.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    schema: Schema | None = None

    @property
    def nbytes(self) -> int:
        if self.kind != "array":
            raise ValueError(f"{self.kind} samples have no fixed size")
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    @property
    def format_version(self) -> int:
        return FIELDS_FORMAT_VERSION if self.kind == "fields" else 1

    def to_json(self) -> dict[str, Any]:
        if self.kind == "array":
            return {"kind": "array", "dtype": self.dtype, "shape": list(self.shape)}
        if self.kind == "fields":
            return {"kind": "fields", "fields": self.schema.to_json()}
        return {"kind": "encoded"}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SampleSpec:
        kind = d.get("kind") if isinstance(d, dict) else None
        if kind not in KINDS:
            raise DataError(f"unknown sample kind {kind!r} in the manifest; expected {KINDS}")
        if kind == "array":
            dtype = _fixed_dtype(d.get("dtype"))
            return cls("array", d["dtype"], _shape(d.get("shape"), dtype.itemsize))
        if kind == "fields":
            try:
                return cls("fields", schema=Schema.from_json(d.get("fields")))
            # UsageError names the field; the others come of entries of the wrong JSON type
            except (UsageError, AttributeError, KeyError, TypeError, ValueError) as e:
                raise DataError(f"the manifest's sample schema is invalid: {e}") from None
        return cls("encoded")

    def describe(self) -> str:
        """For inspect and repr: 'uint8[3, 64, 64]', 'encoded', or the fields."""
        if self.kind == "array":
            return f"{np.dtype(self.dtype).name}{list(self.shape)}"
        if self.kind == "fields":
            return self.schema.describe()
        return "encoded"


def _fixed_dtype(value: Any) -> np.dtype:
    """sample.dtype: a numpy dtype name of fixed, non-zero size without Python objects."""
    try:
        dtype = np.dtype(value) if isinstance(value, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.hasobject or dtype.itemsize == 0:
        raise DataError(
            f"sample.dtype is {value!r} in the manifest; expected a numpy dtype name of fixed "
            "size such as 'uint8' or 'float32'"
        )
    return dtype


def _shape(value: Any, itemsize: int) -> tuple[int, ...]:
    """sample.shape: a list of non-negative ints, of a size numpy can hold."""
    ok = isinstance(value, list) and len(value) <= MAX_DIMS
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    if not ok or math.prod(value) * itemsize > MAX_SAMPLE_BYTES:
        shown = repr(value)[:80]
        raise DataError(
            f"sample.shape is {shown} in the manifest; expected a list of at most {MAX_DIMS} "
            f"non-negative ints whose sample is under {MAX_SAMPLE_BYTES:,} bytes"
        )
    return tuple(value)
