"""``pack_tokens``: texts tokenized by worker processes into a token pack.

    gpufeed.pack_tokens("web.jsonl", "packs/web", tokenize=enc.encode_ordinary,
                        vocab_size=50257, eos=50256, workers=8)
    ds = gpufeed.open_dataset("packs/web", block_size=2048)

Each document becomes one sample ``{"tokens": ids}`` of a ragged integer field, its ids
stored in the narrowest dtype that holds the vocabulary (gpufeed.write.tokens.token_dtype:
uint16 up to 65,536 ids, else uint32), ``eos`` appended after each document. The documents
(gpufeed.write.text_sources: JSONL, text files, Parquet text columns, or an iterable of str)
are read in runs of consecutive documents, each run one input of :func:`pack_map`: parsed
and tokenized in ``workers`` processes, written in order, crash-safe and resumable as
pack_map is. Every id is checked against the vocabulary before it is stored; an error
names the file and the line (row, document).

The manifest records what shaped the tokens under ``"tokens"`` (:data:`MANIFEST_KEY`):
the field, ``eos`` (already in the stream: open the pack without ``eos=``), the vocabulary
size, the dtype, the tokenizer's name and the source. A resume is refused when these differ
from the ones the pack was started with.
"""

from __future__ import annotations

import array
import importlib
import json
import operator
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import DataError, UsageError
from gpufeed.formats.files import atomic_write_json
from gpufeed.formats.manifest import PARTIAL_SUFFIX, read_manifest, write_manifest
from gpufeed.storage.urls import require_local
from gpufeed.write.ownership import is_pack
from gpufeed.write.pack import pack_map
from gpufeed.write.text_sources import Docs, documents
from gpufeed.write.tokens import MANIFEST_KEY, token_dtype

__all__ = ["MANIFEST_KEY", "TokenizeDocs", "pack_tokens", "resolve_tokenize", "vocab_of"]

# the token settings of an unfinished pack, beside the Writer's state.json in DEST.partial
SETTINGS_NAME = "tokens.json"
UNBOUNDED = 1 << 32  # no vocabulary known: ids are stored as uint32, checked below this


def pack_tokens(
    source: Any,
    dest: str | os.PathLike,
    format: str = "mmap",  # noqa: A002 - the public name, as in pack_map
    *,
    tokenize: Callable[[str], Any] | str,
    vocab_size: int | None = None,
    eos: int | None = None,
    text_field: str = "text",
    field: str = "tokens",
    batched: bool = False,
    workers: int | None = None,
    on_error: str = "stop",
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    compression: str | None = None,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    part_size: int | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of ``source`` into a token pack at ``dest``; returns its manifest.

    Args:
        source: an iterable of str (one document each), or a path: a .jsonl file (.gz and
            .zst too), a .txt file (one document), Parquet files (a file, a folder, a glob)
            or a folder or glob of these (gpufeed.write.text_sources).
        dest: the pack's local folder.
        format: "mmap" (the default: a batch of windows is slices of one map), "hdf5",
            "lmdb" or "tar".
        tokenize: a function of a document's text returning its token ids (a list, an
            array); or "module:function" (what the CLI takes). With workers it must
            pickle where processes are spawned (forked, any function works).
        vocab_size: ids are below it; sets the dtype (uint16 up to 65,536). None: taken from
            the tokenizer (its ``vocab_size``, ``n_vocab`` or ``len()``, the largest; the
            object of a bound method such as ``enc.encode``), else ids are stored as uint32.
        eos: an id appended after each document (recorded in the manifest).
        text_field: the JSONL key or Parquet column holding the text.
        field: the pack's token field.
        batched: ``tokenize`` takes a list of texts and returns a list of id sequences
            (a fast tokenizer's batch call).
        workers: processes tokenizing (None: default_workers(); 0 or 1: in-process).
        on_error: "stop" raises naming the document; "skip" leaves out the run of
            documents that holds it (up to DOCS_PER_INPUT lines, rows or files) and lists
            it, with the error naming the document, in manifest["skipped"].
        resume: go on from a pack of DEST left unfinished, with the same settings.
        overwrite: replace DEST if it is a pack gpufeed made.
        quiet: no progress bar or note.
        compression, shard_size, shard_bytes, part_size: as pack_map takes them.

    Returns:
        The finished pack's manifest (``manifest["tokens"]`` holds the token settings).

    Raises:
        SourceError: a document does not read or tokenize, or has an id outside the
            vocabulary (naming the file and the line); the documents before it are
            committed: rerun with resume=True.
        UsageError: a bad setting, or a resume with other settings.
    """
    tokenize = resolve_tokenize(tokenize)
    vocab, found = vocab_of(tokenize, vocab_size)
    dtype = token_dtype(vocab) if vocab is not None else np.dtype(np.uint32)
    limit = vocab if vocab is not None else UNBOUNDED
    eos = _id("eos", eos, limit)
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr))
    if vocab is None:
        say(
            "pack_tokens: no vocab_size given or found on the tokenizer: ids stored as uint32 "
            "(4 bytes a token); pass vocab_size= to store uint16 where it is at most 65,536"
        )
    elif found:
        say(f"pack_tokens: vocab_size {vocab:,} from the tokenizer: ids stored as {dtype.name}")
    record = {
        "field": field,
        "eos": eos,
        "vocab_size": vocab,
        "dtype": dtype.name,
        "tokenizer": _name_of(tokenize),
        "text_field": text_field,
        "source": os.fspath(source) if isinstance(source, (str, os.PathLike)) else None,
    }
    hint = "pack into a local folder, then gpufeed.storage.upload.upload_pack(it, URL)"
    dest = require_local(dest, hint).absolute()
    finished = _finished(dest, record, resume, say)
    if finished is not None:
        return finished
    runs = _checked_settings(documents(source, text_field), dest, record)
    fn = TokenizeDocs(tokenize, field, dtype.name, limit, eos, batched)
    manifest = pack_map(
        fn, runs, dest, format, workers=workers, schema={field: f"{dtype.name}[-1]"},
        on_error=on_error, resume=resume, overwrite=overwrite, quiet=quiet, compression=compression,
        shard_size=shard_size, shard_bytes=shard_bytes, part_size=part_size,
    )  # fmt: skip
    # recorded once the pack is whole (the Writer writes its manifest): a crash between the
    # two leaves a pack without the key, which a rerun with overwrite=True makes again
    manifest[MANIFEST_KEY] = record
    write_manifest(dest, manifest)
    return manifest


class TokenizeDocs:
    """pack_map's function: a run of documents (text_sources.Docs) -> one sample each,
    ``{field: ids}`` in ``dtype`` with ``eos`` appended, every id checked below ``limit``.
    It pickles where ``tokenize`` does."""

    def __init__(self, tokenize, field: str, dtype: str, limit: int, eos, batched: bool):
        self.tokenize, self.field, self.dtype = tokenize, field, np.dtype(dtype)
        self.limit, self.eos, self.batched = limit, eos, batched

    def __call__(self, docs: Docs) -> list[dict[str, np.ndarray]]:
        texts = docs.texts()
        if self.batched:
            outs = self._batch([t for _, t in texts], docs)
        else:
            outs = (self._one(t, docs, k) for k, t in texts)
        return [
            {self.field: self._ids(out, docs, k)} for (k, _), out in zip(texts, outs, strict=True)
        ]

    def _one(self, text: str, docs: Docs, k: int):
        try:
            return self.tokenize(text)
        except Exception as e:  # noqa: BLE001 - the tokenizer's failure is this document's
            raise DataError(f"{docs.where(k)}: tokenize failed ({type(e).__name__}: {e})") from e

    def _batch(self, texts: list[str], docs: Docs) -> list:
        if not texts:
            return []
        try:
            outs = list(self.tokenize(texts))
        except Exception as e:  # noqa: BLE001 - as _one, for the whole run
            raise DataError(f"{os.fspath(docs)}: tokenize failed ({type(e).__name__}: {e})") from e
        if len(outs) != len(texts):
            raise DataError(
                f"{os.fspath(docs)}: batched tokenize returned {len(outs)} results for "
                f"{len(texts)} texts"
            )
        return outs

    def _ids(self, out: Any, docs: Docs, k: int) -> np.ndarray:
        """The document's ids, checked, in the pack's dtype, eos appended."""
        stored = self._list_ids(out) if type(out) is list else None
        if stored is not None:
            return stored
        ids = np.asarray(out)  # numpy's type discovery: a float or str among ids is refused
        if ids.size == 0:
            ids = np.zeros(0, dtype=np.int64)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(
                f"{docs.where(k)}: tokenize returned {ids.dtype} values of shape "
                f"{list(ids.shape)}; expected a 1-D sequence of integer ids"
            )
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.limit):
            bad = int(np.flatnonzero((ids < 0) | (ids >= self.limit))[0])
            raise DataError(
                f"{docs.where(k)}: token id {int(ids[bad])} (position {bad}) is outside the "
                f"vocabulary 0..{self.limit - 1}; pass the tokenizer's full size as "
                "vocab_size (len(tokenizer): added tokens count)"
            )
        n = len(ids)
        stored = np.empty(n + (self.eos is not None), dtype=self.dtype)
        stored[:n] = ids
        if self.eos is not None:
            stored[n] = self.eos
        return stored

    def _list_ids(self, out: list) -> np.ndarray | None:
        """A list of ids (tiktoken's, Hugging Face's) straight into the pack's dtype: an
        array.array of it takes ints only and refuses a value its type does not hold, in
        half the time of numpy's type discovery (what a document costs besides its
        tokenizer). None where it refuses, or an id is past the vocabulary: _ids then
        says which."""
        try:
            stored = array.array(_TYPECODES[self.dtype.itemsize], out)
        except (TypeError, OverflowError):
            return None
        if self.eos is not None:
            stored.append(self.eos)
        ids = np.frombuffer(stored, dtype=self.dtype)
        if len(out) and int(ids[: len(out)].max()) >= self.limit:
            return None
        return ids


# array.array's unsigned type of each token dtype's width (uint16, uint32)
_TYPECODES = {
    array.array(code).itemsize: code for code in ("L", "I", "H") if array.array(code).itemsize <= 4
}


def resolve_tokenize(tokenize: Callable | str) -> Callable:
    """``tokenize`` itself, or the function a "module:function" string names (attributes
    allowed after the colon: "mytok:enc.encode_ordinary")."""
    if callable(tokenize):
        return tokenize
    if not isinstance(tokenize, str) or tokenize.count(":") != 1:
        raise UsageError(
            f"tokenize: a function, or 'module:function', got {tokenize!r} "
            "(e.g. 'mytokenizer:encode')"
        )
    module_name, attrs = tokenize.split(":")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module of the folder the command runs in
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"tokenize {tokenize!r}: cannot import {module_name!r} ({e})") from None
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise UsageError(f"tokenize {tokenize!r}: {module_name} has no {attrs!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UsageError(f"tokenize {tokenize!r}: is a {type(obj).__name__}, not a function")
    return obj


def vocab_of(tokenize: Callable, vocab_size: int | None) -> tuple[int | None, bool]:
    """(the vocabulary size, whether it was found on the tokenizer). Given, it is checked
    (1 .. 2**32); else the largest of ``vocab_size``, ``n_vocab`` (tiktoken) and ``len()``
    (Hugging Face: added tokens included) of ``tokenize`` or the object of a bound method;
    else None."""
    if vocab_size is not None:
        token_dtype(vocab_size)  # checks it
        return operator.index(vocab_size), False
    sizes = []
    for obj in (tokenize, getattr(tokenize, "__self__", None)):
        if obj is None or isinstance(obj, type(sys)):  # a builtin's __self__ is its module
            continue
        for attr in ("vocab_size", "n_vocab"):
            sizes.append(getattr(obj, attr, None))
        if hasattr(type(obj), "__len__"):
            try:
                sizes.append(len(obj))
            except Exception:  # noqa: BLE001, S112 - no length: not a vocabulary
                continue
    sizes = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    if not sizes:
        return None, False
    size = max(sizes)
    token_dtype(size)
    return size, True


def _id(name: str, value: Any, limit: int) -> int | None:
    if value is None:
        return None
    try:
        value = operator.index(value)
    except TypeError:
        raise UsageError(f"{name} must be a token id (an int), got {value!r}") from None
    if not 0 <= value < limit:
        raise UsageError(f"{name}={value} is outside the vocabulary 0..{limit - 1}")
    return value


def _name_of(fn: Callable) -> str:
    owner = getattr(fn, "__self__", None)
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(owner or fn).__module__
    return f"{module}:{qual}"


def _finished(dest: Path, record: dict, resume: bool, say) -> dict | None:
    """With resume, a DEST this very pack_tokens finished earlier: its manifest."""
    if not resume or not is_pack(dest):
        return None
    manifest = read_manifest(dest)
    if manifest.get(MANIFEST_KEY) != record:
        return None  # pack_map refuses it (exists; overwrite=True replaces it)
    say(f"{dest}: already complete (finished by an earlier run)")
    return manifest


def _checked_settings(runs: Iterator[Docs], dest: Path, record: dict) -> Iterator[Docs]:
    """``runs``, after the token settings are checked against those the unfinished pack was
    started with (recorded beside the Writer's state). Done as pack_map takes the first run:
    by then its Writer has made DEST.partial afresh or kept it for the resume."""
    path = dest.with_name(dest.name + PARTIAL_SUFFIX) / SETTINGS_NAME
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        old = None
    except (OSError, ValueError):
        old = {}  # unreadable: not the settings of this call
    if old is not None and old != record:
        diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
        what = ", ".join(f"{k}: {old.get(k)!r} -> {record.get(k)!r}" for k in diff)
        raise UsageError(
            f"{path.parent}: was started with other token settings ({what}); resume with the "
            "same ones, or pass overwrite=True to start over"
        )
    if old is None:
        atomic_write_json(path, record)
    yield from runs
