"""The environment thresholds, shared with the shell preflight: one file per CUDA major
(``thresholds-cuda12.env``, ``thresholds-cuda13.env`` beside this module) holds the driver
floors, the CUDA-to-driver table, the /dev/shm floor and its fix.

Which file (:func:`thresholds_file`, the same rule as ``entrypoints/preflight.sh``): the one
``GPUFEED_THRESHOLDS`` names (the image points it at /etc/gpufeed/thresholds.env, the file of
its CUDA major, chosen when it was built), else /etc/gpufeed/thresholds.env when it exists,
else this package's file of the default variant (CUDA 12). The file is parsed, never
sourced: plain ``KEY=VALUE`` lines (optionally quoted values, ``#`` comments). An environment
variable of the same name overrides a value.

:func:`load` is what the preflight checks, resolved and validated; :func:`cuda_requirements`
is the table gpufeed doctor holds the installed torch's CUDA build to; :func:`version_cmp` is
the preflight's ``pf_version_cmp``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "DEFAULT_CUDA_MAJOR",
    "INSTALLED_FILE",
    "PREFLIGHT_KEYS",
    "ThresholdsError",
    "cuda_requirements",
    "file_for",
    "get",
    "get_float",
    "get_int",
    "is_version",
    "load",
    "min_shm_bytes",
    "read",
    "thresholds_file",
    "version_cmp",
]

HERE = Path(__file__).parent
# the variant `make build` builds by default (the preflight's repository fallback agrees)
DEFAULT_CUDA_MAJOR = "12"
INSTALLED_FILE = Path("/etc/gpufeed/thresholds.env")
# what the preflight needs, each a number or dotted version
PREFLIGHT_KEYS = ("GPUFEED_MIN_DRIVER", "GPUFEED_CUDA_FULL_DRIVER", "GPUFEED_MIN_SHM_MB")
_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


class ThresholdsError(ValueError):
    """The thresholds cannot be used: the file is unreadable, or a value is not a version.
    ``fix`` says what to do (gpufeed doctor shows it)."""

    def __init__(
        self, message: str, fix: str = "fix the environment variable or the thresholds file"
    ):
        super().__init__(message)
        self.fix = fix


def file_for(cuda_major: str | int) -> Path:
    """This package's thresholds file for a CUDA major version (it may not exist)."""
    return HERE / f"thresholds-cuda{cuda_major}.env"


def thresholds_file(environ: Mapping[str, str] | None = None) -> Path:
    """The file the preflight reads here: ``GPUFEED_THRESHOLDS``, else the installed one,
    else the default variant's."""
    env = os.environ if environ is None else environ
    named = env.get("GPUFEED_THRESHOLDS")
    if named:
        return Path(named)
    return INSTALLED_FILE if INSTALLED_FILE.is_file() else file_for(DEFAULT_CUDA_MAJOR)


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
    """A file's values (default :func:`thresholds_file`), each overridden by an environment
    variable of the same name when that is set and not empty."""
    env = os.environ if environ is None else environ
    values = _parse(Path(path) if path is not None else thresholds_file(env))
    for key in values:
        override = env.get(key)
        if override is not None and override.strip() != "":
            values[key] = override.strip()
    return values


def _release_key(release: str) -> str:
    return f"GPUFEED_CUDA_{release.replace('.', '_')}_FULL_DRIVER"


def load(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the preflight reads, as it reads it: the file's values, the environment winning
    (also for keys the file lacks), and ``GPUFEED_CUDA_FULL_DRIVER``, unless set, from the
    table row of the file's ``GPUFEED_CUDA_RELEASE``. Raises :class:`ThresholdsError` naming
    the file or the value when they cannot be used."""
    env = os.environ if environ is None else environ
    path = thresholds_file(env)
    if not os.access(path, os.R_OK):
        raise ThresholdsError(
            f"GPUFEED_THRESHOLDS={path} is not a readable file",
            "point it at a KEY=VALUE file or unset it",
        )
    try:
        values = read(path, env)
    except (OSError, ValueError) as exc:
        raise ThresholdsError(f"thresholds unusable: {exc}") from None
    for key in PREFLIGHT_KEYS:
        if (env.get(key) or "").strip():  # the environment wins, even over an empty file
            values[key] = env[key].strip()
    if not values.get("GPUFEED_CUDA_FULL_DRIVER") and values.get("GPUFEED_CUDA_RELEASE"):
        row = values.get(_release_key(values["GPUFEED_CUDA_RELEASE"]))
        if row:
            values["GPUFEED_CUDA_FULL_DRIVER"] = row
    for key in PREFLIGHT_KEYS:
        if not is_version(values.get(key, "")):
            raise ThresholdsError(
                f"thresholds unusable: {key}={values.get(key)!r} is not a number or dotted version"
            )
    if not values["GPUFEED_MIN_SHM_MB"].isdigit():
        raise ThresholdsError(
            f"thresholds unusable: GPUFEED_MIN_SHM_MB={values['GPUFEED_MIN_SHM_MB']} must be a "
            "whole number of MiB"
        )
    return values


def cuda_requirements(
    cuda: str, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str | None]:
    """(the oldest driver that runs CUDA ``cuda`` code, the driver it needs for full
    support) from the file of its major version; None where the table does not say."""
    major = cuda.split(".")[0]
    path = file_for(major)
    if not major.isdigit() or not path.is_file():
        return None, None
    values = read(path, {} if environ is None else environ)
    release = ".".join(cuda.split(".")[:2])
    return values.get("GPUFEED_COMPAT_DRIVER"), values.get(_release_key(release))


def get(name: str, path=None, environ=None) -> str:
    values = read(path, environ)
    if name not in values:
        raise KeyError(
            f"{name} is not defined in {path or thresholds_file(environ)}; known: "
            f"{', '.join(values)}"
        )
    return values[name]


def _typed(name, kind, path, environ):
    value = get(name, path, environ)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(
            f"{name}={value!r} is not a valid {kind.__name__}; fix the environment variable "
            f"or {path or thresholds_file(environ)}"
        ) from None


def get_int(name: str, path=None, environ=None) -> int:
    return _typed(name, int, path, environ)


def get_float(name: str, path=None, environ=None) -> float:
    return _typed(name, float, path, environ)


def min_shm_bytes(path=None, environ=None) -> int:
    """``GPUFEED_MIN_SHM_MB`` in bytes: below this /dev/shm gets a warning."""
    if path is None:
        return int(load(environ)["GPUFEED_MIN_SHM_MB"]) << 20
    return get_int("GPUFEED_MIN_SHM_MB", path, environ) << 20


def _version_fields(v: str) -> list[int] | None:
    parts = v.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def is_version(v: str) -> bool:
    """A number or a dotted version (what the preflight's ``pf_is_version`` accepts)."""
    return _version_fields(v) is not None


def version_cmp(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, equal to or newer than ``b``; the same rule as the
    preflight's ``pf_version_cmp``: each dot field compares as a number, missing fields are 0."""
    x, y = _version_fields(a), _version_fields(b)
    if x is None or y is None:
        raise ValueError(f"not a dotted version: {a!r} / {b!r}")
    n = max(len(x), len(y))
    x, y = x + [0] * (n - len(x)), y + [0] * (n - len(y))
    return (x > y) - (x < y)
