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
memory limit, or with --one-row-at-a-time, each row runs alone, one after another). Each
pass gives its steady rate (timed from the first batch), its whole pass (from the loader's
making to its last batch, the first batch's wait included) and, cold, how much of the
row's files was in the page cache by its first batch. Cold, the whole pass is the headline
(what a user waits for: a loader that reads most of a small file before its first batch
shows a warm steady rate); warm, the steady rate is (bench/report.py).

Cold cache: before every timed pass each of the row's files is dropped from the page cache
with posix_fadvise(DONTNEED), which needs no root (and with --drop-caches, as root, also
``echo 3 > /proc/sys/vm/drop_caches``, which drops dentries and inodes too).

The read bound of a case is measured in the same run: a sequential read of the packed
sample file (the mmap pack's, which holds nothing but the samples) into a buffer of one
batch's bytes, after eviction when cold, and the same read from the page cache, a memory
copy, when warm.

The suite writes its results (bench/report.py: results.json, results.md, latest.md, a chart),
prints its table last and exits 0 only when every row ran (a peer that is not installed
counts as not run, except FFCV, whose absence is reported). It does not assert speeds;
docs/benchmarks.md discusses them.
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

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import data as bdata  # noqa: E402
from bench import peers as bpeers  # noqa: E402
from bench import read_as as bread_as  # noqa: E402
from bench import report as breport  # noqa: E402
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
                gpufeed.pack_map(
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


def evict(paths: list[str], drop_caches: bool = False) -> None:
    maps = sys.modules.get("gpufeed.pagecache.maps")
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
        # the whole pass, from the loader's making to its last batch: what was read before the
        # first batch counts
        "pass_s": first + r.seconds,
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


def _warm_up(case, row: str, spec: dict, ci: int, cache: str, shuffle: bool, out: dict):
    """A condition's warm-up pass; for a peer's first condition, the choice of its worker
    count too (``out["workers_tried"]``). The worker count the row's passes use."""
    bs, cap, files = spec["batch_size"], spec["cap"], spec["files"]
    workers = out.get("workers", 0)
    if spec["quick"] and ci > 0:
        # QUICK: the row's first condition warmed it up; a warm condition only needs the
        # row's files in the page cache
        if cache == "warm":
            read_files(files)
    elif row.startswith("peer:") and ci == 0:
        # the peer's best worker count here (its warm-up too): fastest of 1x and 2x cores
        tried = {}
        n = cpus()
        # QUICK checks that every row runs: one worker count (each try pays start-up)
        for w in (n,) if spec["quick"] else (n, 2 * n):
            tried[w] = one_pass(case, row, shuffle=shuffle, workers=w, batch_size=bs, cap_s=cap)[
                "samples_per_s"
            ]
        workers = max(tried, key=tried.get)
        out["workers_tried"] = tried
    else:
        one_pass(case, row, shuffle=shuffle, workers=workers, batch_size=bs, cap_s=cap)
    return workers


def _timed_passes(case, row: str, spec: dict, cache: str, shuffle: bool, workers: int):
    """The condition's timed passes, one turn each: (passes, share cached after each
    eviction)."""
    files = spec["files"]
    passes, resident = [], []
    for k in range(spec["runs"]):
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
                batch_size=spec["batch_size"],
                cap_s=spec["cap"],
                seed=k + 1,
                files=files if cache == "cold" else None,
            )
        )
    return passes, resident


def _condition_summary(passes: list[dict], resident: list[float]) -> dict:
    """A condition's medians over its timed passes, and each pass's rates."""

    def median(key):
        return statistics.median(p[key] for p in passes)

    cached = [c for p in passes if (c := p["cached_at_first"]) is not None and c == c]
    return {
        "samples_per_s": median("samples_per_s"),
        "first_batch_s": median("first_batch_s"),
        "pass_s": median("pass_s"),
        "pass_samples_per_s": median("pass_samples_per_s"),
        "cached_at_first_batch": statistics.median(cached) if cached else None,
        "runs": [p["samples_per_s"] for p in passes],
        "pass_runs": [p["pass_samples_per_s"] for p in passes],
        "samples_per_run": [p["samples"] for p in passes],
        # the worst pass; NaN (cannot tell) wins over any number
        "resident_after_evict": max(resident, key=lambda r: (r != r, r)) if resident else None,
    }


def _row_workers(row: str, workers: int) -> dict:
    """The worker count a row ran with (gpufeed's: make_loader's plan, with its reason)."""
    kind, _, arg = row.partition(":")
    if kind == "gpufeed":
        from gpufeed.loading.plan import cached_plans

        plans = cached_plans()
        return {
            "workers": plans[-1][0] if plans else None,
            "plan": plans[-1][1] if plans else None,  # make_loader's reason, with its numbers
        }
    return {"workers": int(arg) if kind == "perfile" else workers}


def run_row(spec: dict) -> dict:
    """In the row's own process: every condition, warm-up first, then the timed passes."""
    case = next(c for c in bdata.cases(Path(spec["data"]), spec["quick"]) if c.name == spec["case"])
    row = spec["row"]
    spec = dict(spec, files=data_files(store_dir(case, row)))
    out = {"conditions": {}}
    if case.crop:
        # the decoder and the transform's imports, once here: forked workers inherit them
        # instead of each importing torchvision on its first sample (seconds per pass)
        bdata.decode_jpeg_bytes(Path(case.files()[0]).read_bytes())
        bdata.Augment(case.crop)(torch_zeros_image(case.shape))
    workers = 0
    for ci, (cache, order) in enumerate(spec["conditions"]):
        shuffle = order == "shuffled"
        rowproc.wait_turn()  # the warm-up: one turn
        workers = out["workers"] = _warm_up(case, row, spec, ci, cache, shuffle, out)
        passes, resident = _timed_passes(case, row, spec, cache, shuffle, workers)
        out["conditions"][f"{cache}/{order}"] = _condition_summary(passes, resident)
    out.update(_row_workers(row, workers))
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add(
        "--quick",
        action="store_true",
        default=os.environ.get("QUICK") == "1",
        help="a tenth of the data, short passes (env QUICK=1)",
    )
    add(
        "--data",
        default=os.environ.get("BENCH_DATA", "/tmp/gpufeed-bench"),
        help="where the generated data lives (kept between runs)",
    )
    add(
        "--out",
        default=os.environ.get("BENCH_OUT", "bench/results"),
        help="results.json, results.md, latest.md and benchmarks.png go here",
    )
    add("--rows", default=None, help="only rows whose key matches this regex")
    add(
        "--cases",
        default=None,
        help="only these cases, comma-separated (by default all but "
        f"{', '.join(sorted(bdata.OPT_IN))}, which run only when named)",
    )
    add(
        "--runs",
        type=int,
        default=None,
        help="timed passes per row and condition (default 3, quick 1)",
    )
    add(
        "--cap",
        type=float,
        default=None,
        help="seconds per pass from the first batch (default 8, quick 0.3)",
    )
    add("--batch-size", type=int, default=256)
    add(
        "--drop-caches",
        action="store_true",
        help="also echo 3 > /proc/sys/vm/drop_caches before cold passes (root)",
    )
    add(
        "--row-timeout",
        type=float,
        default=None,
        help="seconds one row may take to set up, or for one turn (a pass; the first of a "
        "condition also warms up), before it is killed and marked failed (default 900, quick 120)",
    )
    add(
        "--read-as",
        default=os.environ.get("BENCH_READ_AS") or None,
        metavar="UID[:GID]",
        help="write the packs as root, read them in each row's process as this user: the "
        "images' case (uid 1000 over data it does not own); env BENCH_READ_AS",
    )
    add(
        "--one-row-at-a-time",
        action="store_true",
        help="run each row's passes alone, one row after another, instead of the rows taking "
        "turns pass by pass (the default, except under a memory limit)",
    )
    add("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.cap = args.cap or (0.3 if args.quick else 8.0)
    args.runs = args.runs or (1 if args.quick else 3)
    args.row_timeout = args.row_timeout or (120 if args.quick else 900)
    return args


def check_args(args) -> tuple[int, int] | None:
    """Refuse up front what cannot work here; the user rows read as (--read-as), if any."""
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise SystemExit(
            "--drop-caches: /proc/sys/vm/drop_caches is not writable here (needs root, and in "
            "a container --privileged); cold passes evict with posix_fadvise without it"
        )
    read_as = bread_as.parse_user(args.read_as) if args.read_as else None
    if read_as:
        bread_as.check_can_read_as()
    return read_as


def run_settings(args, data_root: Path, read_as, log) -> dict:
    """The results' header: the machine and the run's settings, logged where they matter."""
    import torch

    from gpufeed.system.sysinfo import cgroup_memory_limit, read_ahead_kb

    results = {
        "quick": args.quick,
        "cpus": cpus(),
        "torch": torch.__version__,
        "batch_size": args.batch_size,
        "runs": args.runs,
        "cap_s": args.cap,
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
    alone = args.one_row_at_a_time or bool(results["memory_limit_bytes"])
    results["rows_took_turns"] = not alone
    if alone:
        log("rows run one after another" + ("" if args.one_row_at_a_time else " (memory limit)"))
    return results


def store_rows(case, cr: dict, args, data_root: Path, log) -> tuple[list[str], bool]:
    """Store the case for every row that applies: (the rows to measure, whether every row
    that should run could)."""
    todo, all_ran = [], True
    for label, row in rows():
        if (args.rows and not re.search(args.rows, row)) or not row_applies(case, row):
            continue
        entry = cr["rows"][row] = {"label": row_label(case, label)}
        why = bpeers.missing(row[5:]) if row.startswith("peer:") else None
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
    return todo, all_ran


def measure_rows(case, cr: dict, todo: list[str], args, base: dict, log) -> bool:
    """Run the case's rows (taking turns, or one after another) into ``cr["rows"]``:
    whether every one ran."""
    spec = dict(base, case=case.name, batch_size=cr["batch_size"])
    spec["conditions"] = [c.split("/") for c in cr["conditions"]]
    specs = {row: dict(spec, row=row) for row in todo}
    all_ran = True
    alone = not base["rows_took_turns"]
    for row, (code, stdout, stderr, rss_peak) in run_rows(specs, alone, args.row_timeout, log):
        res, why = rowproc.result(code, stdout, stderr)
        if res is None:
            cr["rows"][row]["error"] = why
            all_ran = False
            log(f"  {row}: FAILED: {why}")
            continue
        cr["rows"][row].update(res, peak_rss_bytes=rss_peak)
        conds = cr["rows"][row]["conditions"]
        log(f"  {row}: " + ", ".join(f"{k} {v['samples_per_s']:,.0f}/s" for k, v in conds.items()))
    return all_ran


def run_case(case, args, data_root: Path, results: dict, read_as, log) -> bool:
    """Generate, store and measure one case into ``results``: whether every row ran."""
    log(f"case {case.name}: {case.count} samples {case.kind} {list(case.shape)}")
    bdata.generate(case)
    conditions = (QUICK_CONDITIONS if args.quick else CONDITIONS)[case.name]
    cr = results["cases"][case.name] = {
        "count": case.count,
        "sample_bytes": case.sample_bytes(),
        "rows": {},
        "batch_size": BATCH_SIZE.get(case.name, args.batch_size),
        "conditions": [f"{a}/{b}" for a, b in conditions],
    }
    todo, stored = store_rows(case, cr, args, data_root, log)
    # what the writers left dirty, written back now: an eviction cannot drop a dirty page
    # (rows just stored read "not cold"), and writeback must not share the disk with a
    # timed pass
    t_sync = time.perf_counter()
    os.sync()
    log(f"  sync: {time.perf_counter() - t_sync:.1f} s")
    bound = cr["bound"] = read_bound(case, args.drop_caches, args.runs, args.batch_size)
    log(
        f"  read bound: cold {bound['cold']['MBps']:,.0f} MB/s, warm "
        f"{bound['warm']['MBps']:,.0f} MB/s (into one reused 8 MiB buffer: "
        f"{bound['warm']['warm_small_buffer_MBps']:,.0f} MB/s)"
    )
    base = {
        "data": str(data_root),
        "quick": args.quick,
        "runs": args.runs,
        "cap": args.cap,
        "drop_caches": args.drop_caches,
        "read_as": read_as,
        "rows_took_turns": results["rows_took_turns"],
    }
    return measure_rows(case, cr, todo, args, base, log) and stored


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        rowproc.child_main(child_task, json.loads(args.child))
        return 0
    read_as = check_args(args)
    data_root = Path(args.data) / ("quick" if args.quick else "full")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_root.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results = run_settings(args, data_root, read_as, log)
    all_ran = True
    for case in selected_cases(data_root, args.quick, args.cases):
        all_ran &= run_case(case, args, data_root, results, read_as, log)
    results["seconds"] = time.perf_counter() - t_start
    drew = breport.write(results, out_dir)
    print(breport.markdown(results))
    print(
        f"\n{'every row ran' if all_ran else 'NOT every row ran'}; {results['seconds']:.0f} s;"
        f" results in {out_dir}" + ("" if drew else " (no matplotlib: no chart)")
    )
    return 0 if all_ran else 1


if __name__ == "__main__":
    sys.exit(main())
