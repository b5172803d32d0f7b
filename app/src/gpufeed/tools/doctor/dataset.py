"""Doctor's dataset checks, the twin of ``entrypoints/preflight.d/30-dataset.sh`` (the mount is
there, a readable, non-empty folder), then what the preflight does not do: the files in it
(a pack? many small files?) and how fast it reads, each bounded by a deadline."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

from gpufeed.formats.manifest import MANIFEST_NAME
from gpufeed.system.sizes import format_size
from gpufeed.tools.doctor.probe import bounded
from gpufeed.tools.doctor.report import INFO, OK, WARN, Check

__all__ = ["dataset_checks", "read_probe", "walk"]


def dataset_checks(data_dir: str, walk_seconds: float, probe_seconds: float) -> list[Check]:
    root = Path(data_dir)
    problem = _mount_problem(root, data_dir)
    if problem is not None:
        return [problem]
    checks = [_mount_check(root, data_dir)]
    ok, walked = bounded(
        lambda: walk(root, time.monotonic() + walk_seconds, 2_000_000), walk_seconds + 5
    )
    if not ok:
        checks.append(
            Check(
                "dataset",
                "files",
                WARN,
                f"listing {data_dir} did not finish "
                f"within {walk_seconds + 5:g} s (slow or hung storage)",
                "check the mount (network filesystem?) from the host",
            )
        )
        return checks
    checks.append(_files_check(root, walked, walk_seconds))
    if walked["sample"]:
        checks.append(_read_speed_check(walked["sample"], probe_seconds))
    return checks


def _mount_problem(root: Path, data_dir: str) -> Check | None:
    """What the preflight warns about: no folder there, not readable, or empty."""
    mount_fix = (
        f"mount it: DATASET_DIR=/path/to/dataset docker compose up, or docker run -v "
        f"/path/to/dataset:{data_dir}:ro"
    )
    data = {"path": data_dir}
    if not root.exists():
        return Check(
            "dataset",
            "dataset",
            WARN,
            f"dataset directory {data_dir} does not exist",
            mount_fix,
            data,
        )
    if not root.is_dir():
        return Check(
            "dataset",
            "dataset",
            WARN,
            f"dataset path {data_dir} is not a directory",
            mount_fix,
            data,
        )
    if not os.access(root, os.R_OK | os.X_OK):
        return Check(
            "dataset",
            "dataset",
            WARN,
            f"dataset directory {data_dir} is not readable by uid {os.getuid()}",
            "make it readable on the host (chmod -R a+rX) or run as its owner (docker run --user)",
            data,
        )
    try:
        empty = not any(root.iterdir())
    except OSError as exc:
        return Check("dataset", "dataset", WARN, f"cannot list {data_dir}: {exc}", mount_fix)
    if empty:
        return Check(
            "dataset",
            "dataset",
            WARN,
            f"dataset directory {data_dir} is empty",
            f"check the host path, then {mount_fix}; or make a demo set: gpufeed synth ~/demo-data",
            data,
        )
    return None


def _mount_check(root: Path, data_dir: str) -> Check:
    try:
        readonly = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = None
    ro_text = {True: "read-only", False: "writable", None: "mount mode unknown"}[readonly]
    return Check(
        "dataset",
        "dataset",
        OK if readonly in (True, None) else INFO,
        f"dataset {data_dir} readable, {ro_text}",
        None,
        {"path": data_dir, "readonly": readonly},
    )


def _files_check(root: Path, walked: dict[str, Any], walk_seconds: float) -> Check:
    at_least = "" if walked["complete"] else "at least "
    files_text = f"{at_least}{walked['files']} files, {at_least}{format_size(walked['bytes'])}" + (
        "" if walked["complete"] else f" (stopped after {walk_seconds:g} s)"
    )
    manifest = root / MANIFEST_NAME
    fdata = {k: walked[k] for k in ("files", "bytes", "complete")}
    status, fix = OK, None
    if manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
            files_text += f"; a gpufeed {m.get('format')} pack of {m.get('count')} samples"
            fdata["pack"] = {"format": m.get("format"), "count": m.get("count")}
        except (OSError, ValueError):
            pass
    elif walked["files"] >= 10000 and walked["bytes"] / max(1, walked["files"]) < 1 << 20:
        status = WARN
        fix = (
            "many small files: pack them once (gpufeed pack DATA /workspace/packed --format "
            "hdf5) and read the pack; per-file open and decode often starves the GPU"
        )
        files_text += f", {format_size(walked['bytes'] / walked['files'])} per file on average"
    return Check("dataset", "files", status, files_text, fix, fdata)


def _read_speed_check(sample: list[tuple[str, int]], probe_seconds: float) -> Check:
    ok, probe = bounded(lambda: read_probe(sample, probe_seconds), probe_seconds + 10)
    if not ok:
        return Check(
            "dataset",
            "read_speed",
            WARN,
            f"read probe did not finish within {probe_seconds + 10:g} s (slow or hung storage)",
            "check the mount from the host",
        )
    parts = []
    if probe["seq_mib_s"]:
        parts.append(
            f"sequential {probe['seq_mib_s']:.0f} MiB/s over {format_size(probe['seq_bytes'])}"
        )
    if probe["random_reads_s"]:
        avg = probe["random_bytes"] / probe["random_reads"]
        parts.append(
            f"random reads {probe['random_reads_s']:.0f}/s of {format_size(avg)} each "
            f"({probe['random_mib_s']:.1f} MiB/s)"
        )
    return Check(
        "dataset",
        "read_speed",
        INFO,
        "read speed: " + ", ".join(parts) + " (page cache dropped per file where allowed)",
        None,
        probe,
    )


def walk(root: Path, deadline: float, max_files: int) -> dict[str, Any]:
    files = 0
    size = 0
    sample: list[tuple[str, int]] = []  # reservoir of (path, size) for the read probes
    rng = random.Random(0)
    complete = True
    stack = [str(root)]
    while stack:
        if time.monotonic() > deadline or files >= max_files:
            complete = False
            break
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file():
                            st = e.stat()
                            files += 1
                            size += st.st_size
                            if len(sample) < 256:
                                sample.append((e.path, st.st_size))
                            elif rng.random() < 256 / files:
                                sample[rng.randrange(256)] = (e.path, st.st_size)
                    except OSError:
                        continue
        except OSError:
            continue
    return {"files": files, "bytes": size, "complete": complete, "sample": sample}


def _evict(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def read_probe(sample: list[tuple[str, int]], seconds: float) -> dict[str, Any]:
    """Two short probes, each file's page cache dropped first where the kernel allows:
    sequential 1 MiB reads through the largest sampled files, then one 64 KiB read at a
    random offset of randomly chosen files (for small files: how a per-file loader reads)."""
    chunk, block, cap = 1 << 20, 64 << 10, 256 << 20
    read = 0
    start = time.perf_counter()
    stop = start + seconds / 2
    for path, _ in sorted(sample, key=lambda s: -s[1]):
        if time.perf_counter() > stop or read >= cap:
            break
        try:
            with open(path, "rb", buffering=0) as f:
                _evict(f.fileno())
                while read < cap and time.perf_counter() < stop:
                    b = f.read(chunk)
                    if not b:
                        break
                    read += len(b)
        except OSError:
            continue
    seq_s = time.perf_counter() - start
    rng = random.Random(1)
    reads = rbytes = 0
    start = time.perf_counter()
    stop = start + seconds / 2
    while sample and time.perf_counter() < stop and reads < 20000:
        path, size = sample[rng.randrange(len(sample))]
        try:
            with open(path, "rb", buffering=0) as f:
                _evict(f.fileno())
                if size > block:
                    f.seek(rng.randrange(0, size - block))
                rbytes += len(f.read(block))
                reads += 1
        except OSError:
            continue
    rnd_s = time.perf_counter() - start
    return {
        "seq_bytes": read,
        "seq_mib_s": read / seq_s / 2**20 if seq_s > 0 and read else None,
        "random_reads": reads,
        "random_bytes": rbytes,
        "random_reads_s": reads / rnd_s if rnd_s > 0 and reads else None,
        "random_mib_s": rbytes / rnd_s / 2**20 if rnd_s > 0 and reads else None,
    }
