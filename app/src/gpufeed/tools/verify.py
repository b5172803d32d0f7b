"""Check a packed dataset end to end (verify) and describe it (inspect)."""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed.errors import (
    CorruptSampleError,
    DataError,
    GpufeedError,
    NotPackedError,
    StorageError,
    UnsafePathError,
    UsageError,
)
from gpufeed.formats import reader_class
from gpufeed.formats.checksums import crc32, row_crcs, sha256_file
from gpufeed.formats.manifest import pack_file, read_manifest
from gpufeed.formats.spec import SampleSpec
from gpufeed.storage.packs import open_reader_at, read_manifest_at
from gpufeed.storage.urls import RemoteURL, parse_location
from gpufeed.tools import in_place
from gpufeed.write.tokens import MANIFEST_KEY as TOKENS_KEY

MAX_PROBLEMS = 1000
# what verify checks of a pack (PACK_DECODE with decode=True); data read in place: in_place's
PACK_CHECKS = ["files' size and sha256", "samples' crc32", "labels within the classes"]
PACK_DECODE = "every encoded sample decoded"


@dataclass
class Problem:
    file: str
    message: str
    index: int | None = None  # sample index, when the problem is one sample's
    source: str | None = None  # the source file the sample was packed from

    def __str__(self) -> str:
        where = self.file
        if self.index is not None:
            where += f": sample {self.index}"
            if self.source:
                where += f" (source {self.source})"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    format: str
    count: int
    files_checked: int = 0
    samples_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    problems_total: int = 0
    in_place: bool = False  # data read without a manifest: no checksums to compare
    checks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problems_total == 0

    @property
    def bad_samples(self) -> list[int]:
        return sorted({p.index for p in self.problems if p.index is not None})

    def add(self, problem: Problem) -> None:
        self.problems_total += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)

    def summary(self) -> str:
        what = f"{in_place.KINDS[self.format]} read in place" if self.in_place else self.format
        if self.ok:
            line = (
                f"{self.path}: OK ({what}, {self.samples_checked} samples, "
                f"{self.files_checked} files checked)"
            )
        else:
            line = (
                f"{self.path}: FAILED: {self.problems_total} problem(s) in "
                f"{what if self.in_place else f'{what} dataset'} "
                f"({self.samples_checked} of {self.count} samples readable)"
            )
        if self.in_place:
            line += f"; checked: {', '.join(self.checks)}; {in_place.no_checksums(self.format)}"
        return line

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "count": self.count,
            "files_checked": self.files_checked,
            "samples_checked": self.samples_checked,
            "problems_total": self.problems_total,
            **({"kind": in_place.KINDS[self.format]} if self.in_place else {}),
            "in_place": self.in_place,
            "checks": self.checks,
            "checksums": not self.in_place,
            "problems": [
                {"file": p.file, "index": p.index, "source": p.source, "message": p.message}
                for p in self.problems
            ],
        }


def verify(
    dest: str | os.PathLike,
    *,
    decode: bool = False,
    chunk: int = 256,
    quiet: bool = True,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    datasets: dict[str, str] | list[str] | None = None,
    index_dir: str | os.PathLike | None = None,
) -> VerifyReport:
    """Re-read a pack (or data read in place) and report every problem found.

    Every file the manifest names must be a regular file inside DEST (a name leading out of
    it, or a device, FIFO or link out, is reported and never opened; the samples are then not
    read either) of the recorded size and sha256; then every sample's crc32 is checked against
    the stored one (a flipped byte is reported with its sample index and source file) and the
    labels against the classes. Data read in place has no checksums, so every sample is read
    and decoded (whatever ``decode`` says), each failure naming its file (and tar member or
    dataset).

    Args:
        dest: the pack's folder; a URL (s3://bucket/prefix), every file then fetched through
            the cache, which checks its size and sha256 as it lands; or data read in place,
            as open_dataset reads it (an image folder, WebDataset shards, an HDF5 file given
            ``datasets``).
        decode: also decode every encoded image.
        chunk: samples read at a time.
        quiet: no progress bar (the default).
        cache_dir: a URL's cache folder (default $GPUFEED_CACHE_DIR or ~/.cache/gpufeed).
        cache_limit: the cache's bound, e.g. "50GB".
        datasets: an HDF5 file read in place: which datasets hold a row per sample.
        index_dir: where data read in place keeps its cached index.

    Returns:
        A :class:`VerifyReport`: ``ok``, the files and samples checked, and the problems,
        each naming its file (and sample index and source file where it has them).

    Raises:
        NotPackedError: DEST is not a finished pack nor data gpufeed reads in place; every
            other finding is in the report.
    """
    loc = parse_location(dest)
    if isinstance(loc, RemoteURL):
        _no_in_place_options(loc, datasets, index_dir)
        return _verify_remote(loc, decode, chunk, quiet, cache_dir, cache_limit)
    dest = loc
    manifest, opened = _pack_or_in_place(dest, datasets, index_dir)
    if opened is not None:
        return _verify_in_place(dest, opened[0], chunk, quiet)
    report = VerifyReport(str(dest), manifest["format"], int(manifest["count"]))
    report.checks = _pack_checks(decode)
    unsafe = False
    for name, entry in sorted(manifest.get("files", {}).items()):
        report.files_checked += 1
        try:
            problem = _check_file(pack_file(dest, name), entry)
        except UnsafePathError as e:  # a name leading out of the pack, or not a regular file
            problem, unsafe = Problem(e.path, e.reason), True
        if problem is not None:
            report.add(problem)
    if unsafe:
        report.add(Problem(str(dest), "samples not read: the manifest names unsafe files"))
        return report
    try:
        reader = reader_class(manifest["format"], manifest)(dest, manifest)
    except Exception as e:  # noqa: BLE001 - an unreadable index is a finding, not a crash
        why = str(e) if isinstance(e, GpufeedError) else f"{type(e).__name__}: {e}"
        report.add(Problem(str(dest), f"cannot open: {why}"))
        return report
    return _read_samples(reader, report, decode, chunk, quiet)


def _verify_remote(url, decode, chunk, quiet, cache_dir, cache_limit) -> VerifyReport:
    """verify() of a pack in object storage: each file fetched (and so checked) by the cache,
    then the samples read through it as a training job reads them."""
    reader = open_reader_at(str(url), cache_dir=cache_dir, cache_limit=cache_limit)
    manifest = reader.manifest
    report = VerifyReport(str(url), manifest["format"], int(manifest["count"]))
    report.checks = _pack_checks(decode)
    for name in sorted(manifest.get("files", {})):
        report.files_checked += 1
        try:
            reader.source.pack.fetch(name).release()
        except (StorageError, DataError) as e:
            report.add(Problem(url.child(name), str(e)))
    if report.problems:
        report.add(Problem(str(url), "samples not read: files are missing or changed"))
        return report
    return _read_samples(reader, report, decode, chunk, quiet)


def _pack_checks(decode: bool) -> list[str]:
    return PACK_CHECKS + ([PACK_DECODE] if decode else [])


def _no_in_place_options(where, datasets, index_dir, what: str = "a URL is a pack") -> None:
    """datasets= and index_dir= given for a pack: a UsageError naming them."""
    given = [o for o, v in (("datasets", datasets), ("index_dir", index_dir)) if v is not None]
    if given:
        names = ", ".join(f"{o}= (--{o.replace('_', '-')})" for o in given)
        raise UsageError(
            f"{where}: {names} apply to local data read in place (no manifest); {what}: "
            "leave them out"
        )


def _pack_or_in_place(dest: Path, datasets, index_dir):
    """(DEST's manifest, None), or (None, (reader, index)) for data read in place
    (gpufeed.tools.in_place); NotPackedError when it is neither."""
    try:
        manifest = read_manifest(dest)
    except NotPackedError:
        opened = in_place.open_in_place_reader(dest, datasets, index_dir)
        if opened is None:
            raise
        return None, opened
    _no_in_place_options(dest, datasets, index_dir, f"this is a gpufeed {manifest['format']} pack")
    return manifest, None


def _verify_in_place(dest: Path, reader, chunk: int, quiet: bool) -> VerifyReport:
    """verify() of data read in place: every sample read through its reader and decoded."""
    report = VerifyReport(str(dest), reader.format_name, reader.count, in_place=True)
    report.checks = list(in_place.IN_PLACE_CHECKS)
    report.files_checked = len(in_place.data_files(reader))

    def bad(i: int, message: str) -> None:
        report.add(Problem(reader.location(i), message, i))

    bar = _progress(reader.count, quiet)
    try:
        for lo in range(0, reader.count, chunk):
            idx = np.arange(lo, min(lo + chunk, reader.count), dtype=np.int64)
            payloads, readable = _read_chunk(reader, idx, bad)
            report.samples_checked += len(readable)
            for k, j in enumerate(readable):
                problem = in_place.decode_problem(reader, int(idx[j]), payloads[k])
                if problem is not None:
                    bad(int(idx[j]), problem)
            bar.update(len(idx))
    finally:
        bar.close()
        reader.close()
    return report


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, unit="sample", desc="verify", file=sys.stderr, disable=disable)


def _read_chunk(reader, idx: np.ndarray, bad) -> tuple[Any, list[int]]:
    """(payloads, their positions in idx) of the samples at idx: read at once, else one by
    one to find the sample(s) at fault, each reported through bad(index, message)."""
    try:
        return reader.read_batch(idx), list(range(len(idx)))
    except Exception:  # noqa: BLE001 - find the sample(s) at fault one by one
        pass
    payloads, readable = [], []
    for j, i in enumerate(idx.tolist()):
        try:
            payloads.append(reader.read_batch(np.array([i], dtype=np.int64))[0])
        except CorruptSampleError as e:
            bad(i, e.problem)
            continue
        except Exception as e:  # noqa: BLE001
            bad(i, f"unreadable: {type(e).__name__}: {e}")
            continue
        readable.append(j)
    return payloads, readable


def _read_samples(reader, report: VerifyReport, decode, chunk, quiet) -> VerifyReport:
    try:
        _check_samples(reader, report, decode, chunk, quiet)
    finally:
        reader.close()
    return report


def _check_file(path: Path, entry: Any) -> Problem | None:
    """One manifest entry (its path checked by pack_file: inside the pack, a regular file):
    present, of the recorded size and sha256."""
    if not isinstance(entry, dict) or not {"bytes", "sha256"} <= set(entry):
        return Problem(str(path), "the manifest's entry lacks bytes or sha256")
    if not path.exists():
        return Problem(str(path), "missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        return Problem(str(path), f"size {size} bytes, manifest says {entry['bytes']}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return Problem(str(path), f"sha256 {digest[:16]}... differs from the manifest's")
    return None


# where each format keeps its labels and crc32 arrays (file, and the dataset or key in it)
INDEX_AT = {
    "hdf5": ("data.h5", "/{}"),
    "lmdb": ("data.mdb", "key __{}__"),
    "tar": ("index.npz", "{}"),
    "mmap": ("{}.npy", ""),
}


def _index_problem(reader) -> Problem | None:
    """The labels and crc32 arrays as the checks below use them: one dimension of integers,
    one a sample. A crafted dtype (strings, floats) or shape is a finding naming the file and
    dataset, never a numpy error out of verify."""
    for what in ("labels", "crc32"):
        arr = np.asarray(getattr(reader, what))
        if arr.ndim == 1 and arr.dtype.kind in "iu" and len(arr) == reader.count:
            continue
        file, dataset = INDEX_AT.get(reader.format_name, ("", what))
        path = str(reader.root / file.format(what)) if file else str(reader.root)
        inside = f"{dataset.format(what)}: " if dataset else ""
        return Problem(
            path,
            f"{inside}holds {arr.dtype}{list(arr.shape)}, expected "
            f"{reader.count} integers ({what}, one a sample, as the manifest's count says); "
            "the pack is damaged or was crafted (re-pack it)",
        )
    return None


def _sources(reader, report: VerifyReport) -> list[str]:
    """The samples' source files, to name them in problems; an unreadable list is one."""
    try:
        return reader.sources() or []
    except (DataError, OSError) as e:
        report.add(Problem(str(reader.root), f"sources.txt unreadable: {e}"))
        return []


def _check_samples(reader, report: VerifyReport, decode: bool, chunk: int, quiet: bool) -> None:
    problem = _index_problem(reader)
    if problem is not None:
        report.add(problem)
        return
    sources = _sources(reader, report)

    def bad(i: int, message: str) -> None:
        src = sources[i] if i < len(sources) else None
        report.add(Problem(reader.location(i), message, i, src))

    bar = _progress(reader.count, quiet)
    for lo in range(0, reader.count, chunk):
        idx = np.arange(lo, min(lo + chunk, reader.count), dtype=np.int64)
        payloads, readable = _read_chunk(reader, idx, bad)
        got = (
            row_crcs(payloads)
            if isinstance(payloads, np.ndarray)
            else np.fromiter((crc32(p) for p in payloads), np.uint32, len(readable))
        )
        want = reader.crc32[idx[readable]]
        for k in np.flatnonzero(got != want).tolist():
            bad(int(idx[readable[k]]), f"crc32 mismatch (stored {want[k]:08x}, read {got[k]:08x})")
        report.samples_checked += len(readable)
        if decode and reader.spec.kind != "array":
            decoder = _decoder(reader.spec)
            for k, j in enumerate(readable):
                try:
                    decoder(payloads[k])
                except Exception as e:  # noqa: BLE001
                    bad(int(idx[j]), f"cannot decode: {e}")
        bar.update(len(idx))
    bar.close()
    labels = reader.labels
    classes = reader.manifest.get("classes")
    if classes is not None and len(labels):
        out_of_range = np.flatnonzero((labels < -1) | (labels >= len(classes)))
        for i in out_of_range[:10].tolist():
            bad(i, f"label {labels[i]} outside the {len(classes)} classes")


def _decoder(spec: SampleSpec):
    """What --decode runs on each stored sample: the image decoder, or a multi-field
    record's parse with its images decoded."""
    if spec.kind == "fields":
        from gpufeed.data.fields import decode_fields

        return lambda payload: decode_fields(spec.schema, payload)
    from gpufeed.data.decoders import decode_bytes

    return decode_bytes


def _dir_size(root: Path) -> tuple[int, int]:
    """(bytes of file content, bytes allocated on disk) under root."""
    content = allocated = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))  # a link's own size: never followed
            content += st.st_size
            allocated += getattr(st, "st_blocks", 0) * 512
    return content, allocated


def inspect(
    dest: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_limit: int | str | None = None,
    datasets: dict[str, str] | list[str] | None = None,
    index_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """What DEST holds: format, count, classes, sample dtype/shape, size on disk, shards,
    skipped items, and who made it.

    Args:
        dest: the pack's folder; a URL, of which only the manifest is fetched (the sizes are
            then the manifest's; disk_bytes: what the cache would hold); or data read in
            place (an image folder, WebDataset shards, an HDF5 file given ``datasets``).
        cache_dir: a URL's cache folder (default $GPUFEED_CACHE_DIR or ~/.cache/gpufeed).
        cache_limit: the cache's bound, e.g. "50GB".
        datasets: an HDF5 file read in place: which datasets hold a row per sample.
        index_dir: where data read in place keeps its cached index.

    Returns:
        A dict: "path", "format", "count", "classes", "sample", "size_bytes",
        "disk_bytes", "files", "skipped", "created_by", ... Data read in place gives the
        same keys where they mean the same, as its reader infers them ("in_place": true;
        its kind, labels and cached index: gpufeed.tools.in_place.describe). Encoded
        images, local: "image_sizes", the distinct [height, width] among up to SIZE_PROBES
        of them spread over the samples (more than one: a batch of them cannot be one
        tensor; the CLI says what to do).

    Raises:
        NotPackedError: DEST is not a finished pack nor data gpufeed reads in place.
    """
    loc = parse_location(dest)
    if isinstance(loc, RemoteURL):
        _no_in_place_options(loc, datasets, index_dir)
        manifest = read_manifest_at(str(loc), cache_dir=cache_dir, cache_limit=cache_limit)
        files = manifest.get("files", {}).values()
        content = allocated = sum(int(f.get("bytes", 0)) for f in files if isinstance(f, dict))
    else:
        manifest, opened = _pack_or_in_place(loc, datasets, index_dir)
        if opened is not None:
            return _inspect_in_place(loc, *opened)
        content, allocated = _dir_size(loc)
    dest = loc
    sizes = _pack_image_sizes(loc, manifest) if not isinstance(loc, RemoteURL) else []
    info: dict[str, Any] = {
        "path": str(dest),
        "format": manifest["format"],
        "format_version": manifest["format_version"],
        "in_place": False,
        "count": manifest["count"],
        "classes": manifest.get("classes"),
        "num_classes": len(manifest["classes"]) if manifest.get("classes") is not None else None,
        "sample": _sample_info(manifest["sample"]),
        "size_bytes": content,
        "disk_bytes": allocated,
        "files": len(manifest.get("files", {})),
        "skipped": len(manifest.get("skipped", [])),
        "created_by": manifest.get("created_by"),
        "source": manifest.get("source"),
        "options": manifest.get("options"),
        "checks": PACK_CHECKS + [f"{PACK_DECODE} (--decode)"],
        "checksums": True,
    }
    if manifest["count"]:
        info["bytes_per_sample"] = round(content / manifest["count"], 1)
    if isinstance(manifest.get(TOKENS_KEY), dict):  # pack_tokens' record: what shaped the stream
        info["tokens"] = manifest[TOKENS_KEY]
    layout = manifest.get("layout", {})
    if manifest["format"] == "tar":
        info["shards"] = len(layout.get("shards", []))
        info["pattern"] = layout.get("pattern")
    if manifest["format"] == "hdf5":
        info["datasets"] = layout.get("datasets")
        info["compression"] = layout.get("compression")
    if manifest["format"] == "mmap":
        info["container"] = layout.get("container")
    if sizes:
        info["image_sizes"] = sizes
    return info


def _inspect_in_place(dest: Path, reader, index) -> dict[str, Any]:
    try:
        info = {"path": str(dest), **in_place.describe(reader, index)}
        sizes = image_sizes(reader)
    finally:
        reader.close()
    info["sample"] = _sample_info(reader.manifest["sample"])
    if sizes:
        info["image_sizes"] = sizes
    return info


# encoded images whose headers inspect reads, spread over the samples: enough to see that
# sizes vary in a folder of photos, and PIL's .size reads a header, not the pixels
SIZE_PROBES = 64


def _pack_image_sizes(dest: Path, manifest: dict[str, Any]) -> list[list[int]]:
    """image_sizes of a local pack of encoded images; [] for other packs, or one that does
    not open (verify says why)."""
    if manifest.get("sample", {}).get("kind") != "encoded" or not manifest.get("count"):
        return []
    try:
        reader = reader_class(manifest["format"], manifest)(dest, manifest)
    except Exception:  # noqa: BLE001 - a pack that does not open is verify's to report
        return []
    try:
        return image_sizes(reader)
    finally:
        reader.close()


def image_sizes(reader) -> list[list[int]]:
    """The distinct [height, width] of up to SIZE_PROBES encoded images spread evenly over
    the reader's samples, in the order met.

    Args:
        reader: an open gpufeed.formats Reader.

    Returns:
        The sizes; [] when its samples are not encoded images. A sample that does not read,
        or whose header does not parse, is left out: verify reports it.
    """
    from PIL import Image

    if reader.spec.kind != "encoded" or not reader.count:
        return []
    n = min(SIZE_PROBES, reader.count)
    idx = np.unique(np.linspace(0, reader.count - 1, n).astype(np.int64))
    try:
        payloads = reader.read_batch(idx)
    except Exception:  # noqa: BLE001 - a damaged sample is verify's to report
        return []
    sizes: list[list[int]] = []
    for payload in payloads:
        try:
            with Image.open(io.BytesIO(payload)) as img:
                size = [img.height, img.width]
        except Exception:  # noqa: BLE001 - as above
            continue
        if size not in sizes:
            sizes.append(size)
    return sizes


def _sample_info(spec: dict[str, Any]) -> dict[str, Any]:
    """inspect's sample: the manifest's, its text (checking the schema) and dtype's name."""
    sample = dict(spec)
    sample["text"] = SampleSpec.from_json(spec).describe()
    if sample.get("dtype"):
        sample["dtype_name"] = np.dtype(sample["dtype"]).name
    return sample
