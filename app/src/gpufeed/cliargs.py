"""The types and bounds of every ``gpufeed`` command-line option, in one place.

Each is an argparse ``type=``: a bad value is a usage error (exit status 2) whose message
names the option, what was given and what is accepted, before anything runs. Bounds:

- worker counts: 0 .. ``WORKERS_PER_CPU`` x the usable CPUs (at least ``MIN_WORKER_LIMIT``);
  more processes than that only thrash, and a typo such as 100000 would fork-bomb the host;
- batch sizes: 1 .. ``MAX_BATCH``; prefetch factor: 1 .. ``MAX_PREFETCH``;
- sizes in bytes (``--shard-bytes``): finite, 1 B .. ``MAX_BYTES``; MiB (``--batch-mb``): finite,
  above 0, at most ``MAX_BYTES``;
- seconds: finite (no ``nan``/``inf``), within each option's range;
- ``--resize HxW``: each side 1 .. ``gpufeed.write.options.MAX_RESIZE``;
- ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (never silently the CPU);
- ``--settings FILE``: a readable loader settings file (what ``gpufeed tune --write`` makes);
- a pack's location: a local path, or a URL gpufeed reads (s3://, gs://, az://, https://);
  ``--cache-limit``: a size such as 50GB or 50GiB (the cache's own rule); ``--cache-dir``: a
  folder that is not a file.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable

__all__ = [
    "MAX_BATCH",
    "MAX_BYTES",
    "MAX_PREFETCH",
    "MIN_WORKER_LIMIT",
    "WORKERS_PER_CPU",
    "batch_size",
    "add_cache_options",
    "batch_sizes",
    "bytes_size",
    "cache_dir",
    "cache_limit",
    "cache_options",
    "compression",
    "device",
    "integer",
    "location",
    "mebibytes",
    "resize",
    "seconds",
    "settings_file",
    "tokenize_spec",
    "worker_limit",
    "workers",
    "workers_or_auto",
]

WORKERS_PER_CPU = 16
MIN_WORKER_LIMIT = 64
MAX_BATCH = 1 << 16
MAX_PREFETCH = 64
MAX_BYTES = 1 << 50  # 1 PiB
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

Error = argparse.ArgumentTypeError


def integer(lo: int, hi: int | None = None, what: str = "") -> Callable[[str], int]:
    """An int in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise Error(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"from {lo} to {hi}"
            raise Error(f"{value} is out of range: {what or 'it'} must be {span}")
        return value

    return parse


def worker_limit() -> int:
    from gpufeed.system.sysinfo import usable_cpus

    return max(MIN_WORKER_LIMIT, WORKERS_PER_CPU * usable_cpus().count)


def workers(text: str) -> int:
    """Worker processes: 0 (in-process) up to :func:`worker_limit`."""
    return integer(0, worker_limit(), f"workers ({WORKERS_PER_CPU} per usable CPU at most)")(text)


def workers_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else workers(text)


batch_size = integer(1, MAX_BATCH, "a batch size")
prefetch_factor = integer(1, MAX_PREFETCH, "prefetch_factor")


def batch_sizes(text: str) -> list[int]:
    """A comma-separated list of batch sizes."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise Error(f"{text!r}: expected batch sizes like 128,256")
    return [batch_size(p) for p in parts]


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise Error(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise Error(f"{text!r}: must be a finite number")
    return value


def seconds(lo: float = 0.0, hi: float = 86400.0, *, above: bool = False) -> Callable[[str], float]:
    """Seconds in [lo, hi] (``above``: strictly more than lo)."""

    def parse(text: str) -> float:
        value = _finite(text)
        if value < lo or (above and value == lo) or value > hi:
            low = f"more than {lo:g}" if above else f"at least {lo:g}"
            raise Error(f"{text!r}: must be {low} and at most {hi:g}")
        return value

    return parse


def bytes_size(text: str) -> int:
    """'256M', '1.5G', '4096' -> bytes (binary units; an optional trailing B or iB)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS and not t[-1].isdigit() else ""
    number = t[: len(t) - len(unit)] if unit else t
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise Error(f"{text!r} is not a size like 512M or 2G") from None
    if not math.isfinite(value) or not 1 <= value <= MAX_BYTES:
        raise Error(f"{text!r}: a size must be finite, from 1 B to {MAX_BYTES >> 50} PiB")
    return int(value)


def mebibytes(text: str) -> float:
    value = _finite(text)
    if not 0 < value <= MAX_BYTES / 2**20:
        raise Error(f"{text!r}: MiB must be above 0 and at most {MAX_BYTES >> 20}")
    return value


def compression(text: str) -> str:
    """HDF5 compression: none, lzf or gzip[:1-9] (checked by the HDF5 writer's own parser)."""
    from gpufeed.errors import UsageError
    from gpufeed.formats.hdf5 import compression_args

    try:
        compression_args(text)
    except UsageError as e:
        raise Error(str(e)) from None
    return text


def datasets(text: str) -> dict[str, str] | list[str]:
    """--datasets FIELD=PATH,... (or PATH,...): an HDF5 file's datasets, one row per sample."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise Error("--datasets: name at least one dataset, e.g. image=/images,label=/labels")
    if all("=" in t for t in items):
        return {k.strip(): v.strip() for k, v in (t.split("=", 1) for t in items)}
    if any("=" in t for t in items):
        raise Error("--datasets: give every dataset as FIELD=PATH, or none")
    return items


def schema_field(text: str) -> tuple[str, str]:
    """--schema FIELD=TYPE (int64[-1], float32[-1,4], str, ...): one field's type, checked."""
    from gpufeed.errors import UsageError
    from gpufeed.formats.schema import parse_schema

    name, sep, kind = text.partition("=")
    if not sep:
        raise Error(f"--schema {text!r}: expected FIELD=TYPE, e.g. x=int64[-1]")
    try:
        parse_schema({name.strip(): kind.strip()})
    except UsageError as e:
        raise Error(f"--schema: {e}") from None
    return name.strip(), kind.strip()


def resize(text: str) -> tuple[int, int]:
    from gpufeed.errors import UsageError
    from gpufeed.write.options import parse_resize

    try:
        return parse_resize(text)
    except UsageError as e:
        raise Error(str(e)) from None


def device(text: str) -> str:
    if not _DEVICE.match(text):
        raise Error(f"{text!r}: expected cpu, cuda or cuda:N")
    return text


def settings_file(text: str) -> str:
    """A loader settings file make_loader can read (the same reader, so the same verdict)."""
    from gpufeed.loading.settings import load_settings

    try:
        load_settings(text)
    except (OSError, ValueError, TypeError) as e:
        raise Error(str(e)) from None
    return text


def location(text: str) -> str:
    """A URL gpufeed reads (checked by the one rule, storage.urls.parse_location), else `text`
    unchanged for the command's own path check."""
    from gpufeed.errors import UsageError
    from gpufeed.storage.urls import parse_location

    try:
        parse_location(text)
    except UsageError as e:
        raise Error(str(e)) from None
    return text


def cache_limit(text: str) -> int:
    from gpufeed.errors import UsageError
    from gpufeed.system.sizes import parse_size

    try:
        return parse_size(text, "--cache-limit")
    except UsageError as e:
        raise Error(str(e)) from None


def cache_dir(text: str) -> str:
    import os

    if os.path.exists(text) and not os.path.isdir(text):
        raise Error(f"--cache-dir {text}: is a file; expected a folder (created when missing)")
    return text


def add_cache_options(p: argparse.ArgumentParser) -> None:
    """--cache-dir and --cache-limit: where a pack in object storage (PATH a URL) is cached."""
    p.add_argument(
        "--cache-dir",
        type=cache_dir,
        default=None,
        help="PATH a URL: the local cache of its files (default $GPUFEED_CACHE_DIR, else "
        "~/.cache/gpufeed)",
    )
    p.add_argument(
        "--cache-limit",
        type=cache_limit,
        default=None,
        help="PATH a URL: the cache's size bound, e.g. 50GB or 50GiB, least recently used "
        "files evicted past it (default $GPUFEED_CACHE_LIMIT, else the disk's free space)",
    )


def cache_options(args: argparse.Namespace) -> dict:
    """The cache options given on the command line, as open_dataset's keywords."""
    return {k: getattr(args, k) for k in ("cache_dir", "cache_limit") if getattr(args, k, None)}


def existing_path(text: str) -> str:
    """A path that exists, or a glob of Parquet files (data/train-*.parquet) or of texts
    (data/*.jsonl: gpufeed pack --tokenize) that matches, or a URL (Parquet in object
    storage: the command says what it finds there)."""
    if "://" in text:
        return location(text)
    if not os.path.lexists(text) and not _source_glob(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return text


def _source_glob(text: str) -> bool:
    if not any(c in text for c in "*?["):
        return False
    from gpufeed.errors import UsageError
    from gpufeed.formats.inplace.parquet import is_parquet
    from gpufeed.write.text_sources import source_files

    if is_parquet(text):
        return True
    try:
        return bool(source_files(text))
    except UsageError:
        return False


_TOKENIZE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def tokenize_spec(text: str) -> str:
    """--tokenize MODULE:FUNCTION (attributes after the colon allowed: mytok:enc.encode);
    imported when the pack starts (gpufeed.write.token_pack.resolve_tokenize)."""
    if not _TOKENIZE.match(text):
        raise Error(f"--tokenize {text!r}: expected MODULE:FUNCTION, e.g. mytokenizer:encode")
    return text


def pack_path(text: str) -> str:
    """A pack's path: it exists, or a pack into it is unfinished or being written
    (DEST.partial), which the command then explains (a usage error would hide that);
    or a URL (s3://bucket/prefix, ...), read through the cache (--cache-dir, --cache-limit);
    or WebDataset shards named by a brace pattern (shard-{000..009}.tar) whose first exists;
    or a glob of Parquet files that matches."""
    from gpufeed.formats.manifest import PARTIAL_SUFFIX
    from gpufeed.storage.urls import is_remote

    if is_remote(location(text)) or os.path.lexists(text.rstrip("/") + PARTIAL_SUFFIX):
        return text
    if "{" in text and not os.path.lexists(text):
        from gpufeed.formats.inplace.webdataset import is_webdataset

        if is_webdataset(text):
            return text
    return existing_path(text)
