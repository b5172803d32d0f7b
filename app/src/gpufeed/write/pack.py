"""Pack a source tree into a packed format: parallel, resumable, atomic, with a manifest.

The stages, one module each: the source listed (scan), options checked (options), items read
(items, in a pool of workers: pool) and committed as parts (staging), the parts assembled by
the format's writer with the manifest last (assemble); guard says what may be deleted.

How a pack survives a crash at any point (kill -9 included):
  1. Everything happens under DEST.partial/. state.json records the options and a digest of
     the source listing; a resume with anything different is refused.
  2. Source items are read in fixed ranges of `part_size` items. Each range is committed as
     one staged file, parts/part-NNNNNN.npz (written to a temporary name and renamed),
     holding the samples' labels, crc32s, the items skipped in it and each source file's
     size and mtime. --resume keeps the committed parts (a part whose source files changed
     since is read again) and redoes only the rest, so its output cannot depend on where
     the previous run stopped.
  3. A fresh pack in a streamed format (assemble.streams: tar, LMDB, mmap .npy, uncompressed
     HDF5) writes each sample once: into DEST.partial/out/ as its part is committed, while
     the workers read on; the part keeps only where each sample is there (Part.where), and
     neither is fsynced until the pack is finished. After a crash the resume moves out/
     aside and checks every kept part's samples there by their crc32s
     (gpufeed.write.direct); a part that does not check (torn by a power loss, its samples
     lost) is read again. Any other part (compressed HDF5, a .pt mmap pack's, a resumed
     pack's) holds its samples' bytes and is fsynced. When every part is committed, the
     format writer finishes out/ (a fresh streamed pack) or assembles it from the parts
     from scratch (HDF5 is not crash-safe while written, so a resumed or compressed one is
     only ever written in one pass from committed parts); then the manifest is written
     last and out/ is renamed to DEST. A DEST without manifest.json never exists.
  4. One pack at a time per DEST: the run holds a lock on DEST.partial (gpufeed.formats.lock) until
     DEST.partial is gone. --overwrite replaces only a pack gpufeed made
     (gpufeed.write.ownership): an old DEST is moved into DEST.partial, the new one renamed
     into place, then DEST.partial (with the old pack) deleted.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpufeed._version import __version__
from gpufeed.errors import UsageError
from gpufeed.formats.files import atomic_write_json
from gpufeed.formats.inplace.tree import Source, scan_source
from gpufeed.formats.lock import PackLock
from gpufeed.formats.manifest import PARTIAL_SUFFIX, read_manifest
from gpufeed.pixels import mixed_sizes_message
from gpufeed.storage.urls import RemoteURL, parse_location
from gpufeed.write.assemble import Stream, assemble
from gpufeed.write.direct import keep_streamed
from gpufeed.write.fields import plan_fields
from gpufeed.write.items import LoadOptions
from gpufeed.write.options import MANIFEST_OPTIONS, check_options, parse_resize
from gpufeed.write.ownership import (
    PARTS_DIR,
    STATE_NAME,
    STREAMED_DIR,
    check_removable,
    clear_partial,
    is_pack,
    occupied,
    remove_partial,
    remove_tree,
    source_clash,
)
from gpufeed.write.remote import pack_to_store
from gpufeed.write.sources import Listing
from gpufeed.write.staging import (
    commit_parts,
    drop_changed_parts,
    drop_torn_parts,
    say_resumed,
)

__all__ = ["pack", "pack_files", "pack_map", "pack_samples"]


def pack(
    source: Any,
    dest: Any,
    *args: Any,
    format: str | None = None,  # noqa: A002 - the public name, as in the CLI
    **options: Any,
) -> dict[str, Any]:
    """Pack files, or data gpufeed reads in place, into a pack; returns its manifest.

    ``pack(SOURCE, DEST, format="hdf5", ...)``: an image folder, a folder of .npy/.pt arrays
    or a list file -> a pack of (image, label) samples; .txt, .wav, .pt dicts and list files
    of number targets -> multi-field samples (gpufeed.write.fields). ``pack(SHARDS, DEST)``
    (WebDataset tar shards) or ``pack(FILE.h5, DEST, datasets={"image": "/images", "label":
    "/labels"})``: data read in place, copied into a pack.

    Samples held in Python are :func:`pack_samples`; a function over inputs is
    :func:`pack_map`. ``pack(samples, DEST, ...)`` and ``pack(fn, inputs, DEST, ...)`` still
    work in 0.2, with a DeprecationWarning naming the new function (removed in 0.3).

    Args:
        source: a folder, a list file, WebDataset shards (a folder, a .tar, a brace pattern),
            an HDF5 file, Parquet files (a file, a glob, a folder) or a Hugging Face
            save_to_disk folder; a local path.
        dest: the pack's folder, or a URL (s3://bucket/prefix, gs://, az://) for files.
        *args: the format, positionally (``pack(SOURCE, DEST, "tar")``); or the deprecated
            forms' other positional arguments.
        format: "hdf5" (the default), "lmdb", "tar" or "mmap".
        **options: for files, the keyword arguments of :func:`pack_files` (workers,
            shard_size, shard_bytes, compression, encode, resize, container, resume,
            overwrite, on_error, quiet, part_size, log, follow_symlinks, staging_dir,
            keep_staging, schema, classes); for data read in place, those of
            :func:`gpufeed.write.convert.pack_in_place` (datasets, index_dir, ...).

    Returns:
        The manifest of the finished pack (a dict, as written to DEST/manifest.json).
    """
    if format is not None:
        options["format"] = format
    if callable(source):
        _deprecated("pack(fn, inputs, DEST, ...)", "pack_map(fn, inputs, DEST, ...)")
        return _pack_map(source, dest, *args, **options)
    if _is_samples(source):
        _deprecated("pack(samples, DEST, ...)", "pack_samples(samples, DEST, ...)")
        return _pack_samples(source, dest, *args, **options)
    return _pack_path(source, dest, *args, **options)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"gpufeed.{old} is deprecated: use gpufeed.{new} (removed in 0.3; CHANGELOG.md)",
        DeprecationWarning,
        stacklevel=3,
    )


def pack_samples(
    samples: Iterable[Any],
    dest: str | os.PathLike,
    format: str = "hdf5",  # noqa: A002 - the public name, as in the CLI
    *,
    schema: Mapping[str, Any] | None = None,
    workers: int | None = 0,
    on_error: str = "stop",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    names: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    compression: str | None = None,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    container: str = "npy",
    part_size: int | None = None,
) -> dict[str, Any]:
    """Pack samples held in Python into a local pack, in their order; returns its manifest.

    Each sample is a dict of fields, an array (field ``x``) or an ``(array, int label)``
    pair (fields ``x``, ``label``): :func:`gpufeed.write.convert.as_sample`. A generator is
    consumed as it is written, in bounded chunks.

    Args:
        samples: a list, a generator or an array of rows.
        dest: the pack's local folder (pack into a folder, then
            gpufeed.storage.upload.upload_pack it to a URL).
        format: "hdf5", "lmdb", "tar" or "mmap".
        schema: the fields' types, as Writer takes it (None: from the first sample).
        workers: processes that encode the samples; 0 (the default) encodes in-process, as
            the samples are in memory already.
        on_error: "stop" raises naming the sample; "skip" leaves it out and lists it in
            manifest["skipped"].
        resume: go on from a pack of DEST left unfinished.
        overwrite: replace DEST if it is a pack gpufeed made.
        quiet: no progress bar.
        names: what sources.txt, errors and skipped entries call each sample (default '#i').
        classes: the names of the labels, kept in the manifest (``dataset.classes``).
        compression, shard_size, shard_bytes, container, part_size: as Writer takes them.

    Returns:
        The manifest of the finished pack.
    """
    return _pack_samples(
        samples, dest, format, schema=schema, workers=workers, on_error=on_error,
        resume=resume, overwrite=overwrite, quiet=quiet, names=names, classes=classes,
        compression=compression, shard_size=shard_size, shard_bytes=shard_bytes,
        container=container, part_size=part_size,
    )  # fmt: skip


def pack_map(
    fn: Callable[[Any], Any],
    inputs: Iterable[Any],
    dest: str | os.PathLike,
    format: str = "hdf5",  # noqa: A002 - the public name, as in the CLI
    *,
    workers: int | None = None,
    schema: Mapping[str, Any] | None = None,
    on_error: str = "stop",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    names: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    compression: str | None = None,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    container: str = "npy",
    part_size: int | None = None,
) -> dict[str, Any]:
    """Pack ``fn(input)`` for every input into a local pack, written in input order; returns
    its manifest. ``fn`` returns a sample dict (or yields several) for each input and runs in
    ``workers`` processes (gpufeed.write.convert.pack_function).

    Args:
        fn: a picklable function of one input.
        inputs: a list or any iterable (consumed as it is written).
        dest: the pack's local folder.
        format: "hdf5", "lmdb", "tar" or "mmap".
        workers: processes running ``fn`` (None: default_workers(); 0 or 1: in-process).
        schema: the fields' types, as Writer takes it (None: from the first sample).
        on_error: "stop" raises naming the input; "skip" leaves it out and lists it in
            manifest["skipped"].
        resume: go on from a pack of DEST left unfinished (after its committed inputs).
        overwrite: replace DEST if it is a pack gpufeed made.
        quiet: no progress bar.
        names: what sources.txt, errors and skipped entries call each input (default: the
            input if it is a path, else '#i').
        classes: the names of the labels, kept in the manifest (``dataset.classes``).
        compression, shard_size, shard_bytes, container, part_size: as Writer takes them.

    Returns:
        The manifest of the finished pack.
    """
    return _pack_map(
        fn, inputs, dest, format, workers=workers, schema=schema, on_error=on_error,
        resume=resume, overwrite=overwrite, quiet=quiet, names=names, classes=classes,
        compression=compression, shard_size=shard_size, shard_bytes=shard_bytes,
        container=container, part_size=part_size,
    )  # fmt: skip


def _pack_map(fn, inputs, *args: Any, **kwargs: Any) -> dict[str, Any]:
    from gpufeed.write.convert import pack_function

    _local_only(args[0] if args else kwargs.get("dest"), kwargs, "pack_map(fn, inputs, DEST)")
    return pack_function(fn, inputs, *args, **kwargs)


def _pack_samples(samples, dest, *args: Any, **kwargs: Any) -> dict[str, Any]:
    from gpufeed.write.convert import as_sample, pack_function

    _local_only(dest, kwargs, "pack_samples(samples, DEST)")
    kwargs.setdefault("workers", 0)  # in memory already: encoding is a copy
    return pack_function(as_sample, samples, dest, *args, **kwargs)


def _pack_path(source, dest, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Files (pack_files), or data read in place (pack_in_place)."""
    from gpufeed.formats.inplace import hdf5_needs_datasets, is_hdf5_file
    from gpufeed.formats.inplace.parquet import is_parquet
    from gpufeed.formats.inplace.webdataset import is_webdataset
    from gpufeed.storage.urls import is_remote

    if kwargs.get("datasets") is None and is_hdf5_file(source):
        raise UsageError(hdf5_needs_datasets(source))
    if (
        kwargs.get("datasets") is not None
        or is_webdataset(source)
        or is_parquet(source)
        or is_remote(source)  # Parquet in object storage (its listing says, or nothing found)
    ):
        from gpufeed.write.convert import pack_in_place

        if kwargs.pop("schema", None) is not None:
            raise UsageError(
                "schema= applies to folders and list files, not to shards, HDF5 or Parquet "
                "(their fields come from their own types)"
            )
        _local_only(dest, kwargs, "packing data read in place")
        return pack_in_place(source, dest, *args, **kwargs)
    kwargs.pop("datasets", None)
    kwargs.pop("index_dir", None)
    return pack_files(source, dest, *args, **kwargs)


def _is_samples(source: Any) -> bool:
    """Samples given as Python objects (a list, a generator, an array of rows), not a path."""
    if isinstance(source, (str, bytes, os.PathLike)):
        return False
    return hasattr(source, "__iter__")


def _local_only(dest, kwargs: dict[str, Any], what: str) -> None:
    """The Python-function and in-place paths write a local pack only (for now): a URL DEST
    is refused, and the URL-only options are dropped when left at their defaults."""
    if dest is not None and isinstance(parse_location(dest), RemoteURL):
        raise UsageError(
            f"{dest}: {what} writes a local folder; pack into one, then upload it with "
            f"gpufeed.storage.upload.upload_pack(FOLDER, {str(dest)!r})"
        )
    for key, default in (("staging_dir", None), ("keep_staging", False)):
        if kwargs.get(key, default) != default:
            raise UsageError(f"{key}= is for a URL DEST; {what} writes a local folder")
        kwargs.pop(key, None)


def pack_files(
    source: str | os.PathLike,
    dest: str | os.PathLike,
    format: str = "hdf5",  # noqa: A002 - the public name, as in the CLI
    *,
    workers: int | None = None,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    compression: str | None = None,
    encode: str = "keep",
    resize: str | tuple[int, int] | None = None,
    container: str = "npy",
    resume: bool = False,
    overwrite: bool = False,
    on_error: str = "stop",
    quiet: bool = False,
    part_size: int | None = None,
    log: Callable[[str], None] | None = None,
    follow_symlinks: bool = False,
    staging_dir: str | os.PathLike | None = None,
    keep_staging: bool = False,
    schema: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Pack SOURCE into DEST (a folder, or a URL: s3://bucket/prefix, gs://, az://) in
    `format`; returns the manifest.

    encode: "keep" stores images as their encoded bytes (decoded when read), "raw" stores
    decoded uint8 CHW arrays (all images must share a size, or pass resize="HxW"; 16-bit
    images are scaled to 8 bits, see gpufeed.pixels).
    on_error: "stop" raises SourceError naming the file (the partial stays resumable);
    "skip" leaves the file (or unreadable folder, or link not followed) out and lists it in
    manifest["skipped"].
    workers: reader processes; None reads the first items in-process and starts
    default_workers() processes only when the rest would take longer than starting them.
    overwrite: replace DEST if it is a pack gpufeed made (anything else is refused, see
    gpufeed.write.ownership), or discard an unfinished DEST.partial.
    follow_symlinks: follow symbolic links to folders in SOURCE, and links to files that lead
    out of SOURCE (loops and second links to a folder are problems, see
    gpufeed.formats.inplace.tree); by default both are problems themselves.
    DEST a URL: the pack is made in `staging_dir` (default: the cache folder's
    staging/<scheme>/<bucket>/<prefix>, where resume=True finds it), then uploaded with the
    manifest last (gpufeed.write.remote), and the staged copy removed unless keep_staging.
    overwrite then replaces a pack at the URL.
    A source of .txt or .wav files, of .pt dicts, or a list file with number targets is
    packed as multi-field samples (gpufeed.write.fields); schema: types for some of their
    fields, replacing those taken from the first file (``{"x": "int64[-1]"}``: varies).
    """
    loc = parse_location(dest)  # a URL is never a local folder (s3://b/x is not ./s3:/b/x)
    if isinstance(loc, RemoteURL):
        options = {  # what the pack into the staging folder takes from this call
            "source": source, "format": format, "workers": workers, "shard_size": shard_size,
            "shard_bytes": shard_bytes, "compression": compression, "encode": encode,
            "resize": resize, "container": container, "on_error": on_error, "quiet": quiet,
            "part_size": part_size, "log": log, "follow_symlinks": follow_symlinks,
            "schema": schema,
        }  # fmt: skip
        say = log or (lambda msg: None if quiet else print(msg, file=sys.stderr))
        return pack_to_store(
            pack,
            loc,
            staging_dir=staging_dir,
            keep_staging=keep_staging,
            resume=resume,
            overwrite=overwrite,
            say=say,
            **options,
        )
    opts = check_options(
        format, encode, on_error, compression, container, shard_size, shard_bytes, part_size
    )
    resize_hw = parse_resize(resize)
    if resize_hw is not None and encode != "raw":
        raise UsageError("--resize needs --encode raw (encoded images are stored as they are)")
    src = scan_source(source, follow_symlinks=follow_symlinks)
    dest = Path(dest).absolute()
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    say = log or (lambda msg: None if quiet else print(msg, file=sys.stderr))
    _check_destination(dest, src, resume, overwrite)
    src.check(on_error)
    plan = plan_fields(src, schema)
    if plan is not None:
        if encode != "keep" or resize_hw is not None:
            raise UsageError(
                f"{src.path}: packed as multi-field samples ({src.kind}); --encode raw and "
                "--resize apply to (image, label) packs"
            )
        fields_opts = dict(workers=workers, on_error=on_error, quiet=quiet)
        return _pack_fields(
            src, plan, dest, partial, format, opts, resume, overwrite, say, fields_opts
        )
    state = {
        "gpufeed": __version__,
        "source": str(src.path),
        "source_digest": src.digest(),
        "items": len(src),
        "format": format,
        "encode": encode,
        "resize": list(resize_hw) if resize_hw else None,
        "on_error": on_error,
        **({"follow_symlinks": True} if follow_symlinks else {}),
        **opts,
    }
    with PackLock(dest, partial) as lock:
        finished = _finished_pack(dest, state, resume, overwrite, say)
        if finished is not None:
            remove_partial(partial, lock)  # only its cleanup was cut short
            return finished
        _prepare_partial(partial, state, resume, overwrite, say)
        parts_dir = partial / PARTS_DIR
        load_opts = LoadOptions(encode=encode, resize=resize_hw)
        nparts = max(1, -(-len(src) // state["part_size"]))
        stream = _stream(src, partial, nparts, state, say)
        try:
            sizes = commit_parts(
                src, parts_dir, nparts, state["part_size"], load_opts, workers, on_error, quiet,
                stream,
            )  # fmt: skip
        except BaseException:
            stream.stop()
            raise
        manifest = assemble(src, dest, partial, nparts, state, quiet, stream)
        remove_partial(partial, lock)
    if len(sizes) > 1:  # said now rather than as the first batch fails to stack
        say(mixed_sizes_message(sizes, str(dest)))
    return manifest


def _pack_fields(src, plan, dest, partial, fmt, opts, resume, overwrite, say, fields_opts) -> dict:
    """The source's samples through gpufeed.pack(fn, inputs), one input a listed file; a
    resume finds a pack an earlier run finished as the classic pack does."""
    from gpufeed.write.convert import pack_function

    listing = Listing(
        str(src.path), src.kind, src.classes, src.digest(), list(src.problems), src.paths
    )
    if resume and occupied(dest):
        state = {"source_digest": listing.digest, "format": fmt, "items": len(src), **opts}
        with PackLock(dest, partial) as lock:
            finished = _finished_pack(dest, state, resume, overwrite, say)
            if finished is not None:
                remove_partial(partial, lock)
                return finished
    fn, schema = plan
    return pack_function(
        fn, range(len(src)), dest, fmt, schema=schema, resume=resume, overwrite=overwrite,
        names=src.rel, listing=listing, compression=opts["compression"],
        shard_size=opts["shard_size"], shard_bytes=opts["shard_bytes"],
        container=opts["container"] or "npy", part_size=opts["part_size"], **fields_opts,
    )  # fmt: skip


def _stream(src: Source, partial: Path, nparts: int, state: dict, say) -> Stream:
    """The committed parts a resume keeps checked (torn ones, and those whose source files
    changed, dropped), then the stream: on when no part is kept (a fresh pack's format
    files are written as its parts are committed), its files from an earlier run kept
    aside for the parts that name them (gpufeed.write.direct)."""
    parts_dir = partial / PARTS_DIR
    if any(parts_dir.glob("part-*.npz")):
        keep_streamed(partial)
        drop_torn_parts(parts_dir, nparts, partial, say)
        drop_changed_parts(src, parts_dir, nparts, state["part_size"], say)
        say_resumed(parts_dir, nparts, state["part_size"], len(src), say)
    fresh = not any(parts_dir.glob("part-*.npz"))
    if fresh and (partial / STREAMED_DIR).exists():
        remove_tree(partial / STREAMED_DIR, "drop output no kept part names")
    return Stream(partial, state, src.classes, on=fresh)


def _check_destination(dest: Path, src: Source, resume: bool, overwrite: bool) -> None:
    """Refusals that need no lock: DEST is or holds the source or lies inside it; DEST exists
    and may not be replaced."""
    clash = source_clash(dest, src)
    if clash:
        raise UsageError(f"{dest}: cannot pack into it: {clash}; choose a destination elsewhere")
    exists = occupied(dest)
    if exists and overwrite:
        check_removable(dest, "replace it (--overwrite)", src)
    elif exists and not resume:
        raise UsageError(_exists_message(dest))


def _exists_message(dest: Path) -> str:
    if is_pack(dest):
        return f"{dest}: already exists; pass --overwrite to replace it"
    return (
        f"{dest}: already exists and is not a gpufeed pack; choose another destination "
        "(gpufeed replaces only packs it made)"
    )


def _finished_pack(dest: Path, state: dict, resume: bool, overwrite: bool, say):
    """With --resume, a DEST finished by an earlier run of this very pack (the run was
    stopped after its final rename), or a finished merge of parts (gpufeed.merge) in the
    same format, which cannot tell which source its parts came from: its manifest, the pack
    left as it is. Another DEST is refused; none is replaced without --overwrite."""
    if overwrite or not occupied(dest):
        return None
    if not resume or not is_pack(dest):
        raise UsageError(_exists_message(dest))
    manifest = read_manifest(dest)
    if _merged(manifest) and manifest.get("format") == state["format"]:
        say(
            f"{dest}: already complete, a merge of {len(manifest['merged_from'])} parts "
            "(gpufeed merge): --resume leaves it as it is (a merged pack records its parts, "
            "not the source they were packed from); pass --overwrite to re-pack it from SRC"
        )
        return manifest
    if not _made_by(manifest, state):
        raise UsageError(
            f"{dest}: already exists, packed from other sources or with other settings; "
            "pass --overwrite to replace it"
        )
    say(f"{dest}: already complete (finished by an earlier run)")
    return manifest


def _merged(manifest: dict) -> bool:
    """Whether the manifest is gpufeed.merge's (its source a merge of the parts it lists)."""
    source = manifest.get("source")
    merged_from = manifest.get("merged_from")
    return isinstance(source, dict) and source.get("kind") == "merge" and bool(merged_from)


def _made_by(manifest: dict, state: dict) -> bool:
    source = manifest.get("source", {})
    same_source = source.get("digest", state["source_digest"]) == state["source_digest"]
    options = manifest.get("options", {})
    return (
        same_source
        and manifest.get("format") == state["format"]
        and source.get("items") == state["items"]
        and all(options.get(k) == state.get(k) for k in MANIFEST_OPTIONS if k in options)
    )


def _prepare_partial(partial: Path, state: dict, resume: bool, overwrite: bool, say) -> None:
    """DEST.partial, locked and ours, made ready: continued (resume), emptied (overwrite, or
    fresh), or refused. No other pack can be running: this one holds the lock."""
    state_path = partial / STATE_NAME
    if state_path.exists() and resume:
        try:
            old = json.loads(state_path.read_text())
        except (OSError, ValueError):
            old = None
        if old is not None:
            _check_same_settings(partial, old, state)
            (partial / PARTS_DIR).mkdir(exist_ok=True)
            return
        say(f"{partial}: no readable {STATE_NAME}; starting over")
    elif state_path.exists() and not overwrite:
        raise UsageError(
            f"{partial}: an unfinished pack is there; pass --resume to continue it "
            "or --overwrite to start over"
        )
    clear_partial(partial, "start the pack over")
    (partial / PARTS_DIR).mkdir()
    atomic_write_json(state_path, state)


def _check_same_settings(partial: Path, old: dict, state: dict) -> None:
    if old.get("on_error") == "stop" and state["on_error"] == "skip":
        # parts committed under "stop" hold no skips, so they are valid under
        # "skip" too: stop at a bad file, then resume skipping it, is allowed
        old["on_error"] = "skip"
        atomic_write_json(partial / STATE_NAME, {**old, "on_error": "skip"})
    diff = sorted(k for k in set(old) | set(state) if k != "gpufeed" and old.get(k) != state.get(k))
    if diff:
        what = ", ".join(f"{k}: {old.get(k)!r} -> {state.get(k)!r}" for k in diff)
        raise UsageError(
            f"{partial}: was started with different settings ({what}); "
            "resume with the same ones, or pass --overwrite to start over"
        )
