"""The environment thresholds shared with the shell preflight (``thresholds.env``).

``thresholds.env`` is the one home of these numbers: ``entrypoints/preflight.sh`` sources it,
this module parses it. An environment variable of the same name overrides the file, in both.
The file holds plain ``KEY=VALUE`` lines (optionally quoted values, ``#`` comments) so that a
POSIX shell can source it unchanged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["THRESHOLDS_FILE", "get", "get_float", "get_int", "min_shm_bytes", "read"]

THRESHOLDS_FILE = Path(__file__).with_name("thresholds.env")
_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def _parse(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(
                f"{path}:{lineno}: expected KEY=VALUE (a line a POSIX shell can source), "
                f"found {raw!r}"
            )
        key, value = m.group(1), m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def read(
    path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """All thresholds: the file's values, each overridden by an environment variable of the
    same name when that is set and not empty."""
    values = _parse(Path(path) if path is not None else THRESHOLDS_FILE)
    env = os.environ if environ is None else environ
    for key in values:
        override = env.get(key)
        if override is not None and override.strip() != "":
            values[key] = override.strip()
    return values


def get(name: str, path=None, environ=None) -> str:
    values = read(path, environ)
    if name not in values:
        raise KeyError(
            f"{name} is not defined in {path or THRESHOLDS_FILE}; known: {', '.join(values)}"
        )
    return values[name]


def _typed(name, kind, path, environ):
    value = get(name, path, environ)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not a valid {kind.__name__}; fix the environment variable "
            f"or {path or THRESHOLDS_FILE}"
        ) from None


def get_int(name: str, path=None, environ=None) -> int:
    return _typed(name, int, path, environ)


def get_float(name: str, path=None, environ=None) -> float:
    return _typed(name, float, path, environ)


def min_shm_bytes(path=None, environ=None) -> int:
    """``GPUFEED_MIN_SHM_MB`` in bytes: below this /dev/shm gets a warning."""
    return get_int("GPUFEED_MIN_SHM_MB", path, environ) << 20
