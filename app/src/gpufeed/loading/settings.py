"""The loader's tunable settings: one declaration of each, its default and its validation.

:class:`LoaderSettings` is the only place a tunable setting is declared. ``make_loader`` takes
its fields as arguments (with these defaults), the settings file (what ``gpufeed tune
--write`` makes, env ``GPUFEED_LOADER_SETTINGS``) may set any of them, and ``gpufeed tune``
searches them. Precedence, explicit: an argument you pass wins (even one equal to its
default), then the settings file, then the default. A file notes the batch size it was tuned
at (``_batch_size``); applied at another, it warns (:class:`~gpufeed.errors.TunedBatchSizeWarning`).

No torch here: the CLI checks a settings file, and ``gpufeed doctor`` reads it, without
loading torch.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gpufeed.data.order import DEFAULT_BUFFER_BLOCKS
from gpufeed.errors import TunedBatchSizeWarning

__all__ = [
    "CONTEXTS",
    "SETTINGS_ENV",
    "SETTINGS_KEYS",
    "TUNED_BATCH_SIZE_KEY",
    "LoaderSettings",
    "load_settings",
    "resolve_settings",
    "with_given_arguments",
]

SETTINGS_ENV = "GPUFEED_LOADER_SETTINGS"
# the note in a settings file of the batch size it was tuned at (``gpufeed tune --write``)
TUNED_BATCH_SIZE_KEY = "_batch_size"
CONTEXTS = ("fork", "spawn", "forkserver")


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _auto_or_int(least: int) -> Callable[[Any], bool]:
    return lambda v: v == "auto" or _is_int(v, least)


def _flag(v: Any) -> bool:
    # a truthy value as DataLoader takes it; a string ("off") is a mistake
    return not isinstance(v, str)


def _auto_or_flag(v: Any) -> bool:
    return v == "auto" or _flag(v)


def _setting(default: Any, allowed: str, ok: Callable[[Any], bool]) -> Any:
    """A setting's default and its check, declared together."""
    return field(default=default, metadata={"allowed": allowed, "ok": ok})


@dataclass(frozen=True)
class LoaderSettings:
    """Every tunable ``make_loader`` setting, its default, and what it may be (checked when
    made: a bad value is a ValueError naming the setting, before anything is measured).

    ``"auto"`` values are decided by ``make_loader`` for the dataset and the machine:
    ``num_workers`` measured, ``pin_memory`` when CUDA is available, ``block_size`` from the
    dataset's ``preferred_block_size`` (else 256), ``sorted_batches`` from its
    ``prefers_sorted_reads``; ``multiprocessing_context=None`` is fork on Linux unless CUDA is
    initialised, then spawn. ``prefetch_factor=None`` is torch's 2. ``decoder_threads``: the
    threads a batch decoder that runs them (RandomResizedCrop's native backend) uses in each
    loading process; ``"auto"``: the loader's CPUs shared by its processes.
    """

    num_workers: int | str = _setting("auto", "'auto' or an int >= 0", _auto_or_int(0))
    pin_memory: bool | str = _setting("auto", "'auto', True or False", _auto_or_flag)
    persistent_workers: bool = _setting(True, "True or False", _flag)
    prefetch_factor: int | None = _setting(
        None, "None or an int >= 1", lambda v: v is None or _is_int(v, 1)
    )
    multiprocessing_context: str | None = _setting(
        None, "'fork', 'spawn' or 'forkserver'", lambda v: v in (None, *CONTEXTS)
    )
    block_size: int | str = _setting("auto", "'auto' or an int >= 1", _auto_or_int(1))
    buffer_blocks: int = _setting(DEFAULT_BUFFER_BLOCKS, "an int >= 1", lambda v: _is_int(v, 1))
    sorted_batches: bool | str = _setting("auto", "'auto', True or False", _auto_or_flag)
    decoder_threads: int | str = _setting("auto", "'auto' or an int >= 1", _auto_or_int(1))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.metadata["ok"](value):
                raise ValueError(f"{f.name} must be {f.metadata['allowed']}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in SETTINGS_KEYS}

    def replace(self, **changes: Any) -> LoaderSettings:
        return replace(self, **changes)


# The keys a settings file may set: LoaderSettings' fields, each a make_loader argument.
SETTINGS_KEYS: tuple[str, ...] = tuple(f.name for f in fields(LoaderSettings))
DEFAULTS = LoaderSettings()


def load_settings(settings) -> tuple[dict[str, Any], str]:
    """(the settings, where they came from) for ``settings``: a dict, a JSON file, or None
    for the file env ``GPUFEED_LOADER_SETTINGS`` names (none: ``({}, "")``). Keys starting
    with ``_`` and ``measured`` are notes; any other unknown key is an error, and so is a
    value :class:`LoaderSettings` refuses (named with the file)."""
    values, _, source = _load(settings)
    return values, source


def _load(settings) -> tuple[dict[str, Any], int | None, str]:
    """(the settings, the batch size they were tuned at or None, where they came from)."""
    source = "settings"
    if settings is None:
        path = os.environ.get(SETTINGS_ENV)
        if not path:
            return {}, None, ""
        settings, source = path, f"{SETTINGS_ENV}={path}"
    if isinstance(settings, (str, os.PathLike)):
        source = source if source != "settings" else str(Path(settings))
        settings = _read_file(Path(settings))
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a path or a dict, got {type(settings).__name__}")
    tuned_at = settings.get(TUNED_BATCH_SIZE_KEY)
    if tuned_at is not None and not _is_int(tuned_at, 1):
        raise ValueError(
            f"{TUNED_BATCH_SIZE_KEY} must be an int >= 1 (the batch size the settings were "
            f"tuned at), got {tuned_at!r} (in {source})"
        )
    values = {k: v for k, v in settings.items() if not k.startswith("_") and k != "measured"}
    unknown = sorted(set(values) - set(SETTINGS_KEYS))
    if unknown:
        raise ValueError(
            f"unknown loader setting(s) {', '.join(unknown)} in {source}; "
            f"known: {', '.join(SETTINGS_KEYS)}"
        )
    try:
        LoaderSettings(**values)
    except ValueError as e:
        raise ValueError(f"{e} (in {source})") from None
    return values, tuned_at, source


def _read_file(path: Path) -> Mapping:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"loader settings file {path} does not exist; run `gpufeed tune` to write it "
            f"or unset {SETTINGS_ENV}"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(
            f"loader settings file {path} is not valid JSON (not UTF-8 text); give the "
            f"file `gpufeed tune --write` made"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"loader settings file {path} is not valid JSON: {exc}") from None
    if not isinstance(settings, Mapping):
        raise ValueError(
            f"loader settings file {path} holds a JSON {type(settings).__name__}, not an "
            f"object of settings"
        )
    return settings


def resolve_settings(
    arguments: Mapping[str, Any],
    given: frozenset[str],
    settings,
    batch_size: int | None = None,
) -> tuple[LoaderSettings, tuple[str, ...]]:
    """The settings a loader runs with, and which of them came from the settings file.

    ``arguments``: make_loader's values for every key (defaults included); ``given``: the
    names the caller passed. A key passed wins; a key left out takes the settings file's
    value when the file has one, else its default. A file tuned at another batch size than
    ``batch_size`` still applies, with a :class:`~gpufeed.errors.TunedBatchSizeWarning`."""
    tuned, tuned_at, source = _load(settings)
    from_file = tuple(k for k in tuned if k not in given)
    if from_file and tuned_at is not None and batch_size is not None and tuned_at != batch_size:
        _warn_batch_size(source, tuned_at, batch_size)
    values = {k: arguments[k] for k in SETTINGS_KEYS}
    values.update({k: tuned[k] for k in from_file})
    return LoaderSettings(**values), from_file


def _warn_batch_size(source: str, tuned_at: int, batch_size: int) -> None:
    # the worker count and prefetch were measured for a batch size: at another, the trade
    # between per-batch IPC and parallel loading differs
    warnings.warn(
        f"{source}: loader settings tuned at batch_size={tuned_at} are applied at "
        f"batch_size={batch_size}; they may not be the fastest there: run `gpufeed tune PATH "
        f"--batch-size {batch_size} --write FILE` for this batch size",
        TunedBatchSizeWarning,
        stacklevel=5,  # make_loader's caller (past resolve_settings, make_loader, its wrapper)
    )


def with_given_arguments(fn: Callable) -> Callable:
    """Call ``fn`` with ``given=`` the names of the arguments its caller passed: the
    signature (names, order, defaults) stays ``fn``'s own without ``given``, so a default
    is declared once, and "left at its default" means left out, not "equal to it"."""
    sig = inspect.signature(fn)
    public = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "given"])

    @functools.wraps(fn)
    def call(*args, **kwargs):
        given = frozenset(public.bind(*args, **kwargs).arguments)
        return fn(*args, **kwargs, given=given)

    call.__signature__ = public  # type: ignore[attr-defined]
    return call
