"""The comparison suite: every way of reading the same samples, side by side in one run.

    python -m bench.suite [--quick] [--data DIR] [--out DIR] [--rows REGEX]
    make bench [QUICK=1]          (in the bench image: torch 2.9.1 + the peers)

For each case (bench/data.py) the samples are generated once, stored by every row's writer,
then each row runs in its own process (its imports, workers and memory apart) under each
condition: cold or warm page cache, shuffled or storage order. A condition is one warm-up
pass (for the peers also the choice of their best worker count), then ``--runs`` timed
passes, each capped at ``--cap`` seconds from the first batch; the median counts. The rows
of a case take turns (bench/rowproc.py): one pass at a time, pass k of every row before pass
k + 1 of any, so that the machine's drift over minutes falls on every row alike (under a
memory limit, or with --one-row-at-a-time, each row runs alone, one after another). Besides
the steady rate (timed from the first batch), each pass gives its whole-pass rate (from
the loader's making, the first batch's wait included) and, cold, how much of the row's
files was in the page cache by its first batch: what a loader read before it is left out
of the steady rate.

Cold cache: before every timed pass each of the row's files is dropped from the page cache
with posix_fadvise(DONTNEED), which needs no root (and with --drop-caches, as root, also
``echo 3 > /proc/sys/vm/drop_caches``, which drops dentries and inodes too).

The read bound of a case is measured in the same run: a sequential read of the packed
sample file (the mmap pack's, which holds nothing but the samples) into a buffer of one
batch's bytes, after eviction when cold, and the same read from the page cache, a memory
copy, when warm.

The suite prints its table last and exits 0 only when every row ran (a peer that is not
installed counts as not run, except FFCV, whose absence is reported). It does not assert
speeds; docs/benchmarks.md discusses them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import data as bdata  # noqa: E402
from bench import peers as bpeers  # noqa: E402
from bench import read_as as bread_as  # noqa: E402
from bench import rowproc  # noqa: E402
from bench.pagecache import drop_all_caches, resident_fraction  # noqa: E402

FORMATS = ("lmdb", "hdf5", "tar", "mmap")
OPTIONAL_ROWS = {"ffcv"}
CONDITIONS = {
    "raw": [
        ("cold", "shuffled"),
        ("cold", "sequential"),
        ("warm", "shuffled"),
        ("warm", "sequential"),
    ],
    "jpeg": [("cold", "shuffled"), ("warm", "shuffled")],
    "large": [("cold", "shuffled"), ("warm", "shuffled")],
    "fields": [("cold", "shuffled"), ("warm", "shuffled")],
    "bigraw": [("cold", "shuffled"), ("cold", "sequential")],
}
# QUICK: every row, fewer conditions, one timed pass each (a check that all runs, not numbers)
QUICK_CONDITIONS = {
    "raw": [("cold", "shuffled"), ("warm", "sequential")],
    "jpeg": [("warm", "shuffled")],
    "large": [("cold", "shuffled")],
    "fields": [("cold", "shuffled"), ("warm", "shuffled")],
    "bigraw": [("cold", "shuffled")],
}
# a store runs once per data folder; the full JPEG case through every writer takes minutes
STORE_TIMEOUT_S = 3600
# how a child that cannot be forked starts: python -m MODULE --child SPEC
MODULE = "bench.suite"
# 432 KiB samples: 32 a batch (110 MB batches of 256 would be no one's setting)
BATCH_SIZE = {"large": 32}


def cpus() -> int:
    from gpufeed.system import sysinfo

    return sysinfo.usable_cpus().count


def rows() -> list[tuple[str, str]]:
    n = 2 * cpus()
    out = [
        ("per-file torch.load, 0 workers", "perfile:0"),
        (f"per-file torch.load, {n} workers (2x cores)", f"perfile:{n}"),
    ]
    out += [(f"gpufeed {f}", f"gpufeed:{f}") for f in FORMATS]
    out += [(name, f"peer:{name}") for name in bpeers.PEERS]
    return out


def selected_cases(data_root: Path, quick: bool, names: str | None) -> list:
    """The cases named (comma-separated), or every case but the opt-in ones."""
    want = set(names.split(",")) if names else None
    return [
        c
        for c in bdata.cases(data_root, quick)
        if (c.name in want if want else c.name not in bdata.OPT_IN)
    ]


def row_applies(case, row: str) -> bool:
    """The fields case (JPEG + caption) is stored by gpufeed and the peers that take such
    samples; no per-file row (the tutorial dataset reads one file per sample)."""
    if case.kind != "fields":
        return True
    kind, _, arg = row.partition(":")
    return kind == "gpufeed" or (kind == "peer" and arg in bpeers.FIELDS_PEERS)


def row_label(case, label: str) -> str:
    if case.kind == "jpeg":
        return label.replace("torch.load", "PIL decode")
    return label


def store_dir(case, row: str) -> Path:
    kind, _, arg = row.partition(":")
    if kind == "perfile":
        return case.source
    if kind == "gpufeed":
        return case.root / f"gpufeed-{arg}"
    return case.root / arg


def disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def data_files(path: Path) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(path):
        out += [os.path.join(dirpath, f) for f in files]
    return out


# ------------------------------------------------------------------- preparing


def prepare(case, row: str) -> dict:
    """Store the case for one row (once; kept while the data folder lives). The suite calls it
    in a child process (store_in_child): writers leave state behind that would skew the rows
    measured after them (LitData's optimize sets the global start method to spawn, so FFCV's
    writer then spawned workers that each imported FFCV, 7 s; tqdm leaves a monitor thread,
    after which rows cannot be forked from this process)."""
    kind, _, arg = row.partition(":")
    dest = store_dir(case, row)
    marker = case.root / f".stored-{kind}-{arg}"
    info = {"dir": str(dest)}
    if kind != "perfile" and not marker.exists():
        t = time.perf_counter()
        if kind == "gpufeed":
            import gpufeed

            opts = {"shard_size": max(1, case.count // 10)} if arg == "tar" else {}
            if case.kind == "fields":  # from Python objects, as the peers' writers take them
                gpufeed.pack(
                    bdata.FieldsSample(case), range(case.count), dest, format=arg,
                    schema=bdata.FIELDS_SCHEMA, workers=2, overwrite=True, quiet=True, **opts,
                )  # fmt: skip
            else:
                gpufeed.pack(case.source, dest, format=arg, overwrite=True, quiet=True, **opts)
        else:
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
            bpeers.load(arg).write(case, dest)
        marker.write_text(json.dumps({"write_s": time.perf_counter() - t}))
        info["stored_now"] = True
    if marker.exists():
        info.update(json.loads(marker.read_text()))
    info["disk_bytes"] = disk_bytes(dest)
    return info


# ------------------------------------------------------------------- measuring


NOT_COLD = 0.05  # a cold pass with more of its files still cached is marked "not cold"


def evict(paths: list[str], drop_caches: bool = False) -> None:
    maps = sys.modules.get("gpufeed.formats.maps")
    if maps is not None:
        # gpufeed's readers keep their maps across passes; mapped pages cannot be evicted
        maps.forget_maps()
        gc.collect()
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches:
        if _ROOT is not None:
            _ROOT("drop_caches")
        else:
            drop_all_caches()


# The row process's root helper when it reads as another user (--read-as, bench/read_as.py)
_ROOT = None


def cached_share(paths: list[str]) -> float:
    """resident_fraction, asked of the root helper where this process reads as a user
    mincore does not answer for."""
    return _ROOT("resident", paths) if _ROOT is not None else resident_fraction(paths)


class PerFileDataset:
    """The tutorial dataset: one file per sample, opened in ``__getitem__``."""

    def __init__(self, files, labels, kind, transform=None):
        self.files, self.labels, self.kind, self.transform = files, labels, kind, transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import torch

        if self.kind == "raw":
            x = torch.load(self.files[i], weights_only=True)
        else:
            from PIL import Image

            with Image.open(self.files[i]) as img:
                x = bdata.to_chw_uint8(img.convert("RGB"))
            x = self.transform(x)
        return x, int(self.labels[i])


def make_batches(case, row: str, *, shuffle: bool, workers: int, batch_size: int, seed: int):
    """(iterable of batches, cleanup) for one pass of one row."""
    import torch

    kind, _, arg = row.partition(":")
    aug = bdata.Augment(case.crop) if case.crop else None
    if kind == "perfile":
        ds = PerFileDataset(case.files(), case.labels(), case.kind, aug)
        g = torch.Generator().manual_seed(seed)
        dl = torch.utils.data.DataLoader(
            ds, batch_size=batch_size, shuffle=shuffle, num_workers=int(arg), generator=g
        )
        return dl, lambda: None
    if kind == "gpufeed":
        import gpufeed

        # JPEGs (and the fields case's): gpufeed's fused decode + RandomResizedCrop + flip, as
        # FFCV's row uses FFCV's
        opts = {"decode": gpufeed.RandomResizedCrop(case.crop)} if aug is not None else {}
        path = store_dir(case, row)
        if arg == "tar":  # streamed whole shards: the fastest documented way to read tar
            ds = gpufeed.open_dataset(
                path,
                map_style=False,
                shuffle_buffer=bdata.shuffle_buffer(case) if shuffle else 0,
                shuffle_shards=shuffle,
                seed=seed,
                **opts,
            )
        else:
            ds = gpufeed.open_dataset(path, **opts)
        loader = gpufeed.make_loader(ds, batch_size, shuffle=shuffle, seed=seed)
        from gpufeed.tools.timing import stop_workers

        def cleanup():
            stop_workers(loader)
            close = getattr(ds, "close", None) or getattr(ds.reader, "close", None)
            close()

        return loader, cleanup
    dl = bpeers.load(arg).batches(
        case,
        store_dir(case, row),
        shuffle=shuffle,
        workers=workers,
        batch_size=batch_size,
        seed=seed,
    )
    return dl, getattr(dl, "close", lambda: None)


def one_pass(case, row, *, shuffle, workers, batch_size, cap_s, seed=0, files=None) -> dict:
    """One timed pass. ``files``: the row's files, for a cold pass: how much of them the
    row had read into the page cache by its first batch is recorded (``cached_at_first``),
    since a rate timed from the first batch leaves out what was read before it."""
    from gpufeed.tools.timing import time_batches

    t0 = time.perf_counter()
    batches, cleanup = make_batches(
        case, row, shuffle=shuffle, workers=workers, batch_size=batch_size, seed=seed
    )
    made = time.perf_counter() - t0
    seen = {}
    try:
        timed = batches if files is None else _first_batch_checked(batches, files, seen)
        r = time_batches(timed, max_samples=case.count, max_seconds=cap_s)
    finally:
        it = getattr(batches, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        cleanup()
        del batches
        gc.collect()
    first = made + r.first_batch_s - seen.get("check_s", 0.0)
    return {
        "samples_per_s": r.samples_per_s,
        "first_batch_s": first,
        # the whole pass from the loader's making: what was read before the first batch counts
        "pass_samples_per_s": r.samples / (first + r.seconds) if r.samples else 0.0,
        "cached_at_first": seen.get("cached"),
        "samples": r.samples,
        "stopped_by": r.stopped_by,
    }


def _first_batch_checked(batches, files: list[str], seen: dict):
    """``batches``, with the share of ``files`` in the page cache taken when the first batch
    arrives (``seen["cached"]``; the check's own time in ``seen["check_s"]``)."""
    it = iter(batches)
    try:
        first = next(it)
    except StopIteration:
        return
    t = time.perf_counter()
    seen["cached"] = cached_share(files)
    seen["check_s"] = time.perf_counter() - t
    yield first
    yield from it


def torch_zeros_image(shape):
    import torch

    return torch.zeros(shape, dtype=torch.uint8)


def read_files(paths: list[str]) -> None:
    """Into the page cache."""
    buf = bytearray(8 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run_row(spec: dict) -> dict:
    """In the row's own process: every condition, warm-up first, then the timed passes."""
    case = next(c for c in bdata.cases(Path(spec["data"]), spec["quick"]) if c.name == spec["case"])
    row = spec["row"]
    kind = row.partition(":")[0]
    files = data_files(store_dir(case, row))
    bs, cap, runs = spec["batch_size"], spec["cap"], spec["runs"]
    n = cpus()
    workers = 0
    out = {"conditions": {}}
    if case.crop:
        # the decoder and the transform's imports, once here: forked workers inherit them
        # instead of each importing torchvision on its first sample (seconds per pass)
        bdata.decode_jpeg_bytes(Path(case.files()[0]).read_bytes())
        bdata.Augment(case.crop)(torch_zeros_image(case.shape))
    for ci, (cache, order) in enumerate(spec["conditions"]):
        shuffle = order == "shuffled"
        rowproc.wait_turn()  # the warm-up: one turn
        if spec["quick"] and ci > 0:
            # QUICK: the row's first condition warmed it up; a warm condition only needs the
            # row's files in the page cache
            if cache == "warm":
                read_files(files)
        elif kind == "peer" and ci == 0:
            # the peer's best worker count here (its warm-up too): fastest of 1x and 2x cores
            tried = {}
            # QUICK checks that every row runs: one worker count (each try pays start-up)
            for w in (n,) if spec["quick"] else (n, 2 * n):
                tried[w] = one_pass(
                    case, row, shuffle=shuffle, workers=w, batch_size=bs, cap_s=cap
                )["samples_per_s"]
            workers = max(tried, key=tried.get)
            out["workers_tried"] = tried
        else:
            one_pass(case, row, shuffle=shuffle, workers=workers, batch_size=bs, cap_s=cap)
        passes, resident = [], []
        for k in range(runs):
            rowproc.wait_turn()  # each timed pass: one turn, its eviction included
            if cache == "cold":
                evict(files, spec["drop_caches"])
                resident.append(cached_share(files))
            else:  # the other rows' passes since this row's last may have pushed its files out
                read_files(files)
            passes.append(
                one_pass(
                    case,
                    row,
                    shuffle=shuffle,
                    workers=workers,
                    batch_size=bs,
                    cap_s=cap,
                    seed=k + 1,
                    files=files if cache == "cold" else None,
                )
            )
        cached = [c for p in passes if (c := p["cached_at_first"]) is not None and c == c]
        out["conditions"][f"{cache}/{order}"] = {
            "samples_per_s": statistics.median(p["samples_per_s"] for p in passes),
            "first_batch_s": statistics.median(p["first_batch_s"] for p in passes),
            "pass_samples_per_s": statistics.median(p["pass_samples_per_s"] for p in passes),
            "cached_at_first_batch": statistics.median(cached) if cached else None,
            "runs": [p["samples_per_s"] for p in passes],
            "samples_per_run": [p["samples"] for p in passes],
            # the worst pass; NaN (cannot tell) wins over any number
            "resident_after_evict": max(resident, key=lambda r: (r != r, r)) if resident else None,
        }
    out["workers"] = workers if kind == "peer" else None
    if kind == "gpufeed":
        from gpufeed.loading.plan import cached_plans

        plans = cached_plans()
        out["workers"] = plans[-1][0] if plans else None
        out["plan"] = plans[-1][1] if plans else None  # make_loader's reason, with its numbers
    elif kind == "perfile":
        out["workers"] = int(row.partition(":")[2])
    return out


def read_bound(case, drop_caches: bool, runs: int, batch_size: int) -> dict:
    """Samples/s of the fastest possible read of the case's bytes: a sequential read of the
    mmap pack's sample file, cold (evicted first) and warm (from the page cache), in 8 MiB
    reads into a buffer of one batch's bytes (at least 8 MiB), the way a loader fills batch
    after batch: a batch of large samples does not stay in the CPU's caches, and one
    reused 8 MiB buffer mostly did, which doubled the warm bound of the ``large`` case
    (``warm_small_buffer_MBps`` keeps that reading, for comparison)."""
    d = store_dir(case, "gpufeed:mmap")
    path = d / ("samples.npy" if case.kind == "raw" else "encoded.npy")
    step = 8 << 20
    batch = max(step, int(case.sample_bytes() * batch_size))
    buf = bytearray(-(-batch // step) * step)
    view = memoryview(buf)

    def read(dest: memoryview) -> float:
        t, at = time.perf_counter(), 0
        with open(path, "rb", buffering=0) as f:
            while f.readinto(dest[at : at + step]):
                at = (at + step) % len(dest)
        return time.perf_counter() - t

    def median_time(cache: str, dest: memoryview) -> float:
        times = []
        read(dest)  # warm-up (and for warm: into the cache)
        for _ in range(runs):
            if cache == "cold":
                evict([str(path)], drop_caches)
            times.append(read(dest))
        return statistics.median(times)

    out = {}
    size = path.stat().st_size
    for cache in ("cold", "warm"):
        t = median_time(cache, view)
        out[cache] = {"samples_per_s": case.count / t, "MBps": size / t / 1e6}
    out["warm"]["warm_small_buffer_MBps"] = size / median_time("warm", view[:step]) / 1e6
    return out


def child_task(spec: dict) -> dict:
    """What a child process does: store a case for a row, or measure a row."""
    if spec.get("task") == "store":
        case = next(
            c for c in bdata.cases(Path(spec["data"]), spec["quick"]) if c.name == spec["case"]
        )
        return prepare(case, spec["row"])
    if spec.get("read_as"):
        global _ROOT
        _ROOT = bread_as.read_as(*spec["read_as"])
    return run_row(spec)


def store_in_child(data_root: Path, case, row: str, quick: bool, log) -> dict:
    """prepare() in a child process, so that what a writer leaves behind stays there."""
    spec = {"task": "store", "data": str(data_root), "quick": quick, "case": case.name, "row": row}
    info, why = rowproc.result(*rowproc.run_child(child_task, spec, STORE_TIMEOUT_S, MODULE)[:3])
    if info is None:
        raise RuntimeError(why)
    if info.pop("stored_now", False):
        log(f"  stored {case.name} for {row} in {info['write_s']:.1f} s")
    return info


# ------------------------------------------------------------------- reporting


def build_table(results: dict) -> list[dict]:
    table = []
    for case_name, cr in results["cases"].items():
        bound = cr["bound"]
        sample_bytes = cr["sample_bytes"]
        for cond in cr["conditions"]:
            cache = cond.split("/")[0]
            base = cr["rows"].get("perfile:0", {}).get("conditions", {}).get(cond)
            for row, rr in cr["rows"].items():
                if "error" in rr or "skipped" in rr:
                    table.append(
                        {
                            "case": case_name,
                            "condition": cond,
                            "row": rr["label"],
                            "status": rr.get("error") or rr.get("skipped"),
                        }
                    )
                    continue
                c = rr["conditions"][cond]
                sps = c["samples_per_s"]
                resident = c.get("resident_after_evict")
                label = rr["label"]
                if resident is not None and resident > NOT_COLD:  # NaN: cannot tell
                    label += f" (not cold: {resident:.0%} of its files stayed cached)"
                table.append(
                    {
                        "case": case_name,
                        "condition": cond,
                        "row": label,
                        "resident_after_evict": resident,
                        "key": row,
                        "samples_per_s": sps,
                        "MBps": sps * sample_bytes / 1e6,
                        "vs_perfile": sps / base["samples_per_s"] if base else None,
                        "vs_bound": sps / bound[cache]["samples_per_s"],
                        "first_batch_s": c["first_batch_s"],
                        "pass_samples_per_s": c.get("pass_samples_per_s"),
                        # pass k of every row in the same round: comparable pass by pass
                        "runs": c.get("runs") if results.get("rows_took_turns") else None,
                        "cached_at_first_batch": c.get("cached_at_first_batch"),
                        "peak_rss_MB": rr["peak_rss_bytes"] / 1e6,
                        "disk_MB": rr["disk_bytes"] / 1e6,
                        "workers": rr.get("workers"),
                    }
                )
            table.append(
                {
                    "case": case_name,
                    "condition": cond,
                    "row": "read bound",
                    "samples_per_s": bound[cache]["samples_per_s"],
                    "MBps": bound[cache]["MBps"],
                    "vs_bound": 1.0,
                }
            )
    return table


def fmt_table(table: list[dict]) -> str:
    head = (
        "case",
        "cache/order",
        "row",
        "samples/s",
        "MB/s",
        "x per-file",
        "vs bound",
        "1st batch s",
        "whole pass samples/s",
        "cached at 1st batch",
        "peak RSS MB",
        "disk MB",
        "workers",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        if "status" in t:
            lines.append(
                f"| {t['case']} | {t['condition']} | {t['row']} | not run: "
                f"{t['status']} |" + " |" * (len(head) - 4)
            )
            continue

        def f(key, spec, t=t):
            v = t.get(key)
            return "" if v is None else format(v, spec)

        lines.append(
            "| "
            + " | ".join(
                [
                    t["case"],
                    t["condition"],
                    t["row"],
                    f("samples_per_s", ",.0f"),
                    f("MBps", ",.1f"),
                    f("vs_perfile", ".1f"),
                    f("vs_bound", ".0%"),
                    f("first_batch_s", ".2f"),
                    f("pass_samples_per_s", ",.0f"),
                    f("cached_at_first_batch", ".0%"),
                    f("peak_rss_MB", ",.0f"),
                    f("disk_MB", ",.0f"),
                    str(t.get("workers", "") or ("0" if t.get("workers") == 0 else "")),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _ratio(r: float, against: str) -> str:
    if against == "read bound":
        return f"{r:.0%}"
    return f"{r:,.0f}x" if r >= 10 else f"{r:.2f}x"


def ratio_tables(table: list[dict]) -> str:
    """Per case: each gpufeed format's samples/s over every other row of the same condition
    (the per-file baselines, the peers, the read bound), one markdown table."""
    out = []
    for case in dict.fromkeys(t["case"] for t in table):
        rows = [t for t in table if t["case"] == case and "samples_per_s" in t]
        formats = list(
            dict.fromkeys(t["key"] for t in rows if t.get("key", "").startswith("gpufeed:"))
        )
        if not formats:
            continue
        out += [
            f"`{case}`: each gpufeed format's samples/s over the row named (in brackets, the "
            "lowest and highest of its passes over the other row's pass in the same round)",
            "",
            "| condition | vs | " + " | ".join(f[8:] for f in formats) + " |",
            "|---|---|" + "---|" * len(formats),
        ]
        for cond in dict.fromkeys(t["condition"] for t in rows):
            here = {t.get("key", t["row"]): t for t in rows if t["condition"] == cond}
            for key, other in here.items():
                if key in formats:
                    continue
                cells = [
                    _ratio(here[f]["samples_per_s"] / other["samples_per_s"], key)
                    + _by_round(here[f], other)
                    if f in here and other["samples_per_s"]
                    else ""
                    for f in formats
                ]
                out.append(f"| {cond} | {other['row']} | " + " | ".join(cells) + " |")
                if cond.startswith("cold/") and key.startswith("peer:"):
                    out.append(_whole_pass_ratios(cond, other, [here.get(f) for f in formats]))
        out.append("")
    return "\n".join(out)


def _by_round(mine: dict, peer: dict) -> str:
    """The range of a format's rate over a peer's, pass by pass (the rows take turns: pass k
    of each ran in the same round), where both ran several; else nothing."""
    a, b = mine.get("runs") or [], peer.get("runs") or []
    if len(a) < 2 or len(a) != len(b) or not all(b):
        return ""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return f" ({min(ratios):.2f}-{max(ratios):.2f})"


def _whole_pass_ratios(cond: str, peer: dict, mine: list[dict | None]) -> str:
    """A ratio-table line: each format's whole-pass samples/s (the first batch's wait
    included) over a peer's, for a cold condition, where a rate timed from the first batch
    misses what a peer read before it (FFCV: most of its file, docs/benchmarks.md)."""
    theirs = peer.get("pass_samples_per_s")
    cells = [
        _ratio(t["pass_samples_per_s"] / theirs, "")
        if t and theirs and t.get("pass_samples_per_s")
        else ""
        for t in mine
    ]
    return f"| {cond} | {peer['row']}, whole pass | " + " | ".join(cells) + " |"


def goals(table: list[dict]) -> list[str]:
    """Where each speed goal stands (no assertion: the note reports it)."""
    out = []
    by = {}
    for t in table:
        if "samples_per_s" in t and "key" in t:
            by.setdefault((t["case"], t["condition"]), {})[t["key"]] = t
    for (case, cond), rows_ in sorted(by.items()):
        g = {k: v for k, v in rows_.items() if k.startswith("gpufeed:")}
        p = {k: v for k, v in rows_.items() if k.startswith("peer:")}
        if not g:
            continue
        worst = min(g.values(), key=lambda t: t["samples_per_s"])
        line = f"{case} {cond}: slowest gpufeed format {worst['key'][8:]} "
        if worst.get("vs_perfile"):
            line += f"{worst['vs_perfile']:.1f}x per-file"
        if p:
            bp = max(p.values(), key=lambda t: t["samples_per_s"])
            line += (
                f"; {worst['samples_per_s'] / bp['samples_per_s']:.2f}x the best peer "
                f"({bp['key'][5:]})"
            )
            cached = bp.get("cached_at_first_batch")
            if cached is not None and cached > NOT_COLD:
                line += f", which had {cached:.0%} of its files cached by its first batch"
            if worst.get("pass_samples_per_s") and bp.get("pass_samples_per_s"):
                whole = worst["pass_samples_per_s"] / bp["pass_samples_per_s"]
                line += f"; whole pass {whole:.2f}x"
        best = max(g.values(), key=lambda t: t["samples_per_s"])
        line += f"; best gpufeed {best['key'][8:]} at {best['vs_bound']:.0%} of the read bound"
        out.append(line)
    return out


def chart(table: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = [(c, k) for c, k in dict.fromkeys((t["case"], t["condition"]) for t in table)]
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.6 * len(groups)))
    axes = np.atleast_1d(axes)
    for ax, (case, cond) in zip(axes, groups, strict=True):
        ts = [
            t
            for t in table
            if t["case"] == case and t["condition"] == cond and "samples_per_s" in t
        ]
        names = [t["row"] for t in ts]
        vals = [t["samples_per_s"] for t in ts]
        colors = [
            "#2b7bba"
            if t["row"].startswith("gpufeed")
            else "#999999"
            if t["row"] == "read bound"
            else "#d95f02"
            if t["row"].startswith("per-file")
            else "#66a61e"
            for t in ts
        ]
        ax.barh(names, vals, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{case}, {cond}: samples/s (log scale)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ------------------------------------------------------------------- main


def run_rows(specs: dict[str, dict], one_at_a_time: bool, timeout: float, log):
    """(row, (exit code, stdout, stderr, peak RSS)) for each row, as each ends: the rows
    taking turns, or one after another."""
    if one_at_a_time:
        for row, spec in specs.items():
            yield from rowproc.run_in_turns(child_task, {row: spec}, timeout, MODULE).items()
        return
    log(f"  {len(specs)} rows, taking turns pass by pass")
    yield from rowproc.run_in_turns(child_task, specs, timeout, MODULE, log).items()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("QUICK") == "1",
        help="a tenth of the data, short passes (env QUICK=1)",
    )
    ap.add_argument(
        "--data",
        default=os.environ.get("BENCH_DATA", "/tmp/gpufeed-bench"),
        help="where the generated data lives (kept between runs)",
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("BENCH_OUT", "bench/results"),
        help="results.json, results.md and benchmarks.png go here",
    )
    ap.add_argument("--rows", default=None, help="only rows whose key matches this regex")
    ap.add_argument(
        "--cases",
        default=None,
        help="only these cases, comma-separated (by default all but "
        f"{', '.join(sorted(bdata.OPT_IN))}, which run only when named)",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=None,
        help="timed passes per row and condition (default 3, quick 1)",
    )
    ap.add_argument(
        "--cap",
        type=float,
        default=None,
        help="seconds per pass from the first batch (default 8, quick 0.3)",
    )
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="also echo 3 > /proc/sys/vm/drop_caches before cold passes (root)",
    )
    ap.add_argument(
        "--row-timeout",
        type=float,
        default=None,
        help="seconds one row may take to set up, or for one turn (a pass; the first of a "
        "condition also warms up), before it is killed and marked failed (default 900, quick 120)",
    )
    ap.add_argument(
        "--read-as",
        default=os.environ.get("BENCH_READ_AS") or None,
        metavar="UID[:GID]",
        help="write the packs as root, read them in each row's process as this user: the "
        "images' case (uid 1000 over data it does not own); env BENCH_READ_AS",
    )
    ap.add_argument(
        "--one-row-at-a-time",
        action="store_true",
        help="run each row's passes alone, one row after another, instead of the rows taking "
        "turns pass by pass (the default, except under a memory limit)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        rowproc.child_main(child_task, json.loads(args.child))
        return 0
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise SystemExit(
            "--drop-caches: /proc/sys/vm/drop_caches is not writable here (needs root, and in "
            "a container --privileged); cold passes evict with posix_fadvise without it"
        )
    read_as = bread_as.parse_user(args.read_as) if args.read_as else None
    if read_as:
        bread_as.check_can_read_as()
    cap = args.cap or (0.3 if args.quick else 8.0)
    runs = args.runs or (1 if args.quick else 3)
    args.row_timeout = args.row_timeout or (120 if args.quick else 900)
    data_root = Path(args.data) / ("quick" if args.quick else "full")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import torch

    from gpufeed.system.sysinfo import cgroup_memory_limit, read_ahead_kb

    data_root.mkdir(parents=True, exist_ok=True)
    results = {
        "quick": args.quick,
        "cpus": cpus(),
        "torch": torch.__version__,
        "batch_size": args.batch_size,
        "runs": runs,
        "cap_s": cap,
        # how much a page fault through a memory map reads around it (FFCV's cold reads)
        "read_ahead_kb": read_ahead_kb(data_root.parent),
        # the container's memory limit (make bench BENCH_MEMORY=...): page cache and processes
        # together, so a pack larger than it cannot be cached before a first batch
        "memory_limit_bytes": cgroup_memory_limit(),
        # rows read as this user over packs written as root (--read-as); None: as the writer
        "read_as": "{}:{}".format(*read_as) if read_as else None,
        "cases": {},
    }
    log(f"data on a device with read_ahead_kb {results['read_ahead_kb']}")
    if results["memory_limit_bytes"]:
        limit_mib = results["memory_limit_bytes"] / 2**20
        log(f"memory limited to {limit_mib:,.0f} MiB, the page cache included")
    if read_as:
        log(f"rows read as {results['read_as']}, over packs written as root")
    # under a memory limit every row's process alive at once would share it (and one was
    # killed for it): each row runs alone there, with the whole limit, as it does by choice
    one_at_a_time = args.one_row_at_a_time or bool(results["memory_limit_bytes"])
    results["rows_took_turns"] = not one_at_a_time
    if one_at_a_time:
        log("rows run one after another" + ("" if args.one_row_at_a_time else " (memory limit)"))
    all_ran = True
    for case in selected_cases(data_root, args.quick, args.cases):
        log(f"case {case.name}: {case.count} samples {case.kind} {list(case.shape)}")
        bdata.generate(case)
        conditions = (QUICK_CONDITIONS if args.quick else CONDITIONS)[case.name]
        bs = BATCH_SIZE.get(case.name, args.batch_size)
        cr = {
            "count": case.count,
            "sample_bytes": case.sample_bytes(),
            "rows": {},
            "batch_size": bs,
            "conditions": [f"{a}/{b}" for a, b in conditions],
        }
        results["cases"][case.name] = cr
        todo = []
        for label, row in rows():
            if (args.rows and not re.search(args.rows, row)) or not row_applies(case, row):
                continue
            entry = cr["rows"][row] = {"label": row_label(case, label)}
            if row.startswith("peer:"):
                why = bpeers.missing(row[5:])
                if why:
                    entry["skipped"] = why
                    all_ran &= row[5:] in OPTIONAL_ROWS
                    log(f"  {row}: not run: {why}")
                    continue
            try:
                entry.update(store_in_child(data_root, case, row, args.quick, log))
                todo.append(row)
            except Exception as exc:  # noqa: BLE001 - the table says which row failed and why
                entry["error"] = f"{type(exc).__name__}: {exc}"
                all_ran = False
                log(f"  {row}: store failed: {entry['error']}")
        # what the writers left dirty, written back now: an eviction cannot drop a dirty page
        # (rows just stored read "not cold"), and writeback must not share the disk with a
        # timed pass
        t_sync = time.perf_counter()
        os.sync()
        log(f"  sync: {time.perf_counter() - t_sync:.1f} s")
        cr["bound"] = read_bound(case, args.drop_caches, runs, args.batch_size)
        log(
            f"  read bound: cold {cr['bound']['cold']['MBps']:,.0f} MB/s, warm "
            f"{cr['bound']['warm']['MBps']:,.0f} MB/s (into one reused 8 MiB buffer: "
            f"{cr['bound']['warm']['warm_small_buffer_MBps']:,.0f} MB/s)"
        )
        specs = {
            row: {
                "data": str(data_root),
                "quick": args.quick,
                "case": case.name,
                "row": row,
                "conditions": conditions,
                "runs": runs,
                "cap": cap,
                "batch_size": bs,
                "drop_caches": args.drop_caches,
                "read_as": read_as,
            }
            for row in todo
        }
        for row, (code, stdout, stderr, rss_peak) in run_rows(
            specs, one_at_a_time, args.row_timeout, log
        ):
            res, why = rowproc.result(code, stdout, stderr)
            if res is None:
                cr["rows"][row]["error"] = why
                all_ran = False
                log(f"  {row}: FAILED: {why}")
                continue
            cr["rows"][row].update(res)
            cr["rows"][row]["peak_rss_bytes"] = rss_peak
            summary = ", ".join(
                f"{k} {v['samples_per_s']:,.0f}/s" for k, v in cr["rows"][row]["conditions"].items()
            )
            log(f"  {row}: {summary}")
    results["seconds"] = time.perf_counter() - t_start
    table = build_table(results)
    results["table"] = table
    results["goals"] = goals(table)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = fmt_table(table)
    if read_as:
        md = f"Rows read as uid {results['read_as']} over packs written as root.\n\n" + md
    (out_dir / "results.md").write_text(
        md + "\n\n" + "\n".join(f"- {g}" for g in results["goals"]) + "\n\n" + ratio_tables(table)
    )
    drew = chart(table, out_dir / "benchmarks.png")
    print(md)
    print()
    for g in results["goals"]:
        print(g)
    print(
        f"\n{'every row ran' if all_ran else 'NOT every row ran'}; {results['seconds']:.0f} s;"
        f" results in {out_dir}" + ("" if drew else " (no matplotlib: no chart)")
    )
    return 0 if all_ran else 1


if __name__ == "__main__":
    sys.exit(main())
