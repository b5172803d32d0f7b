"""The documents of a token pack's source, read as they are packed (gpufeed.write.token_pack).

A source is an iterable of str (one document each), or a path: a ``.jsonl`` file (one JSON
object a line, ``text_field`` naming its text; ``.jsonl.gz`` and ``.jsonl.zst`` too; blank
lines are not documents), a ``.txt`` file (one document a file), Parquet files (a file, a
folder, a glob: ``text_field`` names the text column; a Hugging Face ``save_to_disk`` folder's
Arrow files too), or a folder or glob of any of these, read in sorted order.

Documents come as :class:`Docs`, runs of consecutive documents of one file: pack_map's
inputs. They are made in the parent in a fixed way (the same files give the same runs, so a
resume skips the runs already committed) and hold the raw text: JSON is parsed, text files
are read and UTF-8 is decoded in the worker that tokenizes them. Memory stays bounded: the
files are read a run at a time (Parquet a row group at a time), and pack_map keeps a bounded
number of runs in flight. Every error names the file and the line, row or document.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError, UsageError

__all__ = ["DOCS_PER_INPUT", "INPUT_BYTES", "Docs", "documents", "source_files"]

# a run holds at most this many documents or bytes of text: large enough that pack_map's
# bookkeeping per input is a small share of tokenizing it, small enough that its first
# chunks (32 inputs each: gpufeed.write.convert.CHUNK) spread over the workers at once and
# that on_error="skip" leaves out few documents
DOCS_PER_INPUT = 64
INPUT_BYTES = 1 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = "*.jsonl, *.ndjson (+ .gz, .zst), *.txt, *.parquet"
_UNIT = {"jsonl": "line", "table": "row", "file": "file", "texts": "document"}


@dataclass(frozen=True)
class Docs:
    """Consecutive documents of one source: a pack_map input.

    ``items`` are raw JSONL lines (bytes), texts (str or None: a table's values, an
    iterable's items) or text files' paths (str), by ``kind``. ``first`` numbers the first
    item: a line (1-based), a row (0-based), a file or a document (0-based) of ``source``.
    It is os.PathLike only so that pack_map names it (sources.txt, errors) by its
    ``__fspath__``, e.g. ``web.jsonl:lines 1-64``; it is no file."""

    source: str
    kind: str  # "jsonl", "table", "file" or "texts"
    first: int
    items: tuple
    text_field: str = "text"

    def __fspath__(self) -> str:
        last = self.first + len(self.items) - 1
        return f"{self.source}:{_UNIT[self.kind]}s {self.first}-{last}".replace("\n", "\\n")

    def where(self, k: int) -> str:
        """Item k's place: 'web.jsonl line 17', 'a.parquet row 4 (column text)', a path."""
        if self.kind == "file":
            return str(self.items[k])
        if self.kind == "table":
            return f"{self.source} row {self.first + k} (column {self.text_field!r})"
        return f"{self.source} {_UNIT[self.kind]} {self.first + k}"

    def texts(self) -> list[tuple[int, str]]:
        """(k, text) of each document (a JSONL run's blank lines left out); a DataError
        names the first item that holds no text."""
        read = _READ[self.kind]
        out = []
        for k, item in enumerate(self.items):
            text = read(self, k, item)
            if text is not None:
                out.append((k, text))
        return out


def _jsonl_text(docs: Docs, k: int, line: bytes) -> str | None:
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except ValueError as e:  # UnicodeDecodeError too
        raise DataError(f"{docs.where(k)}: not a JSON object ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{docs.where(k)}: a {type(obj).__name__}, expected a JSON object")
    if docs.text_field not in obj:
        keys = ", ".join(list(obj)[:8])
        raise DataError(
            f"{docs.where(k)}: no field {docs.text_field!r} (it has: {keys}); name the text's "
            "field with text_field= (--text-field)"
        )
    return _str(docs, k, obj[docs.text_field])


def _value_text(docs: Docs, k: int, value: Any) -> str:
    return _str(docs, k, value)


def _file_text(docs: Docs, k: int, path: str) -> str:
    try:
        data = Path(path).read_bytes()
        return data.decode("utf-8")
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _str(docs: Docs, k: int, value: Any) -> str:
    if not isinstance(value, str):
        what = "null" if value is None else f"a {type(value).__name__}"
        raise DataError(f"{docs.where(k)}: the text is {what}, expected a string")
    return value


_READ = {"jsonl": _jsonl_text, "table": _value_text, "file": _file_text, "texts": _value_text}


def documents(source: Any, text_field: str = "text") -> Iterator[Docs]:
    """The runs of documents of ``source`` (module docstring), in order. A path is checked
    now (it exists, its files are of a kind read here, a table has the text column); the
    files are read as the runs are taken."""
    if not isinstance(text_field, str) or not text_field:
        raise UsageError(f"text_field must be a column or key name, got {text_field!r}")
    if isinstance(source, (str, os.PathLike)):
        files = source_files(source)
        for f in files:
            if _kind(f) == "table":
                _table(f, text_field)
        return _files_docs(os.fspath(source), files, text_field)
    if isinstance(source, bytes) or not isinstance(source, Iterable):
        raise UsageError(
            f"source: a path (.jsonl, .txt, Parquet; a folder or glob of them) or an iterable "
            f"of str, got {type(source).__name__}"
        )
    return _runs("<texts>", "texts", source, text_field, first=0)


def source_files(source: str | os.PathLike) -> list[Path]:
    """The files of a path source, in order: a file, a glob, or a folder searched below it
    (hidden names left out); a folder of Parquet files as gpufeed reads them in place (one
    split, a save_to_disk folder's Arrow files). Every file is of a kind read here."""
    from gpufeed.formats.inplace.parquet_listing import glob_files, is_glob

    text = os.fspath(source)
    path = Path(text)
    if is_glob(text):
        files = glob_files(text)
    elif path.is_file():
        files = [path]
    elif path.is_dir():
        files = _folder_files(path)
    else:
        raise UsageError(f"{text}: no such file or folder")
    if not files:
        raise UsageError(f"{text}: holds no documents ({SUFFIXES})")
    for f in files:
        if _kind(f) is None:
            raise UsageError(f"{f}: not a text source gpufeed reads ({SUFFIXES})")
    return files


def _folder_files(folder: Path) -> list[Path]:
    from gpufeed.formats.inplace.parquet import parquet_files

    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(s.startswith((".", "_")) for s in p.relative_to(folder).parts)
    )
    hf = (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()
    if hf or (files and all(_kind(f) == "table" for f in files)):
        return parquet_files(folder) or []  # its rules: one split, save_to_disk's listing
    return files


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".txt"):
        return "file"
    if path.suffix.lower() in TABLE_SUFFIXES:
        return "table"
    return None


def _files_docs(source: str, files: list[Path], text_field: str) -> Iterator[Docs]:
    """Each file's runs in order; consecutive text files (one document each) make runs of
    their own, numbered by their place in the listing of ``source``."""
    k = 0
    while k < len(files):
        f, kind = files[k], _kind(files[k])
        if kind == "jsonl":
            yield from _runs(str(f), "jsonl", _lines(f), text_field, first=1)
        elif kind == "table":
            yield from _table_docs(f, text_field)
        else:
            end = k
            while end < len(files) and _kind(files[end]) == "file":
                end += 1
            names = [str(p) for p in files[k:end]]
            yield from _runs(source, "file", names, text_field, first=k)
            k = end
            continue
        k += 1


def _runs(source: str, kind: str, items: Iterable, text_field: str, first: int) -> Iterator[Docs]:
    """``items`` as Docs of at most DOCS_PER_INPUT items or INPUT_BYTES bytes each."""
    run: list = []
    nbytes = 0
    for item in items:
        run.append(item)
        nbytes += len(item) if isinstance(item, (bytes, str)) else 0
        if len(run) >= DOCS_PER_INPUT or nbytes >= INPUT_BYTES:
            yield Docs(source, kind, first, tuple(run), text_field)
            first += len(run)
            run, nbytes = [], 0
    if run:
        yield Docs(source, kind, first, tuple(run), text_field)


def _lines(path: Path) -> Iterator[bytes]:
    """The lines of a JSONL file (decompressed by its suffix), read a buffer at a time; a
    read failure names the file and the line it stopped at."""
    n = 0
    try:
        with _open_text(path) as f:
            for n, line in enumerate(f, 1):  # noqa: B007 - n names where a failure stopped
                yield line
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: unreadable after line {n} ({type(e).__name__}: {e})") from None
    except Exception as e:
        if type(e).__module__.startswith("zstandard"):
            raise DataError(f"{path}: unreadable after line {n} (zstd: {e})") from None
        raise


def _open_text(path: Path):
    codec = COMPRESSED.get(path.suffix.lower())
    if codec == "gzip":
        return gzip.open(path, "rb")
    if codec == "zstd":
        try:
            import zstandard
        except ImportError:
            raise UsageError(f"{path}: .zst needs zstandard: pip install zstandard") from None
        raw = open(path, "rb")  # noqa: SIM115 - closed with the reader (closefd)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")  # noqa: SIM115 - the caller's with closes it


def _table_docs(path: Path, text_field: str) -> Iterator[Docs]:
    """Runs of a Parquet (or Arrow) file's text column, a row group at a time."""
    from gpufeed.formats.inplace.parquet import pyarrow_modules

    pa = pyarrow_modules()[0]
    f = _table(path, text_field)
    first = 0
    for g in range(len(f.rows)):
        try:
            values = f.group(g, [text_field]).column(0).to_pylist()
        except (pa.ArrowException, OSError, ValueError, MemoryError) as e:
            raise DataError(f"{path}: row group {g} does not read ({e})") from None
        yield from _runs(str(path), "table", values, text_field, first=first)
        first += len(values)


def _table(path: Path, text_field: str):
    """The file opened as the Parquet reader opens it (formats.inplace.parquet.open_file:
    Parquet row groups read, not mapped; an Arrow file's batches validated when read), its
    text column checked first. A file pyarrow cannot open is a DataError naming it."""
    from gpufeed.formats.inplace.parquet import open_file, pyarrow_modules

    pa = pyarrow_modules()[0]
    f = open_file(path)
    names = f.schema.names
    if text_field not in names:
        raise UsageError(
            f"{path}: no column {text_field!r} (columns: {', '.join(names[:12])}); "
            "name the text column with text_field= (--text-field)"
        )
    kind = f.schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UsageError(f"{path}: column {text_field!r} is {kind}, expected strings")
    return f
