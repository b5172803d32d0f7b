"""Byte sizes as people write them (50GB is 10^9, 50GiB 2^30, 500M, or a plain int), and as
gpufeed prints them (:func:`format_size`: binary units)."""

from __future__ import annotations

import re

from gpufeed.errors import UsageError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(value: int | str | None, setting: str = "size") -> int | None:
    """Bytes as an int (None stays None); UsageError naming `setting` for anything else."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        if value is not None and value < 0:
            raise UsageError(f"{setting}={value}: must not be negative")
        return value
    m = _SIZE.match(str(value))
    if m is None or (m.group(3) and not m.group(2)):
        raise UsageError(
            f"{setting}={value!r}: expected bytes as an int or a size such as 50GB, 50GiB, 500MB"
        )
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    scale = 1024 ** "kmgtp".index(unit) * 1024 if binary else _UNITS[unit]
    return int(number * scale)


def format_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
