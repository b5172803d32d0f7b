"""The pack's options: what each may be, checked before anything is read or written."""

from __future__ import annotations

from gpufeed.errors import UsageError
from gpufeed.formats import FORMATS
from gpufeed.formats.mmap import CONTAINERS

__all__ = [
    "DEFAULT_PART_SIZE",
    "ENCODE_MODES",
    "MANIFEST_OPTIONS",
    "MAX_RESIZE",
    "ON_ERROR",
    "check_options",
    "parse_resize",
    "positive_int",
]

ENCODE_MODES = ("keep", "raw")
ON_ERROR = ("stop", "skip")
DEFAULT_PART_SIZE = 1024
# the pack options a manifest records (they shaped its bytes or its listing)
MANIFEST_OPTIONS = (
    "encode",
    "resize",
    "compression",
    "shard_size",
    "shard_bytes",
    "container",
    "follow_symlinks",
    "inferred_fields",  # a Writer's fields taken from the first sample, not declared
)
# The largest --resize side: one uint8 RGB sample of 16384x16384 is already 768 MiB.
MAX_RESIZE = 16384


def parse_resize(resize) -> tuple[int, int] | None:
    """'HxW' (or 'N', or a pair) -> (height, width), each side 1..MAX_RESIZE."""
    if resize is None:
        return None
    if isinstance(resize, str):
        parts = resize.lower().replace(",", "x").split("x")
        try:
            vals = [int(p) for p in parts]
        except ValueError:
            raise UsageError(f"--resize {resize!r}: expected HEIGHTxWIDTH, e.g. 224x224") from None
    else:
        try:
            vals = [int(v) for v in resize]
        except (TypeError, ValueError):
            raise UsageError(f"resize {resize!r}: expected HEIGHTxWIDTH, e.g. 224x224") from None
    if len(vals) == 1:
        vals = vals * 2
    if len(vals) != 2 or min(vals) <= 0:
        raise UsageError(f"resize {resize!r}: expected HEIGHTxWIDTH with positive sizes")
    if max(vals) > MAX_RESIZE:
        raise UsageError(f"resize {resize!r}: each side must be at most {MAX_RESIZE} pixels")
    return vals[0], vals[1]


def positive_int(name: str, value) -> int:
    """An option that is a whole number (an int, or text of one): a UsageError naming it
    otherwise (its sign is the caller's check)."""
    if isinstance(value, bool):
        raise UsageError(f"{name}: expected a whole number, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}: expected a whole number, got {value!r}") from None


def check_options(fmt, encode, on_error, compression, container, shard_size, shard_bytes, part):
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if encode not in ENCODE_MODES:
        raise UsageError(f"unknown encode mode {encode!r}; use keep or raw")
    if on_error not in ON_ERROR:
        raise UsageError(f"unknown on_error {on_error!r}; use stop or skip")
    if compression not in (None, "none") and fmt != "hdf5":
        raise UsageError(f"compression applies to hdf5 only, not {fmt}")
    if fmt == "hdf5":
        from gpufeed.formats.hdf5 import compression_args

        compression_args(compression)  # raises UsageError on a bad value
    if (shard_size or shard_bytes) and fmt != "tar":
        raise UsageError(f"--shard-size/--shard-bytes apply to tar only, not {fmt}")
    for name, value in (
        ("shard_size", shard_size),
        ("shard_bytes", shard_bytes),
        ("part_size", part),
    ):
        if value is not None and positive_int(name, value) <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    if fmt == "mmap" and container not in CONTAINERS:
        raise UsageError(f"unknown mmap container {container!r}; use npy or pt")
    return {
        "compression": None if compression in (None, "none") else compression,
        "shard_size": int(shard_size) if shard_size else None,
        "shard_bytes": int(shard_bytes) if shard_bytes else None,
        "container": container if fmt == "mmap" else None,
        "part_size": int(part or DEFAULT_PART_SIZE),
    }
