"""gpufeed bench: the timing core, the command on a tiny pack, the no-CUDA paths, and the
comparison suite's helpers (the suite itself runs with `make bench`, not here)."""

from __future__ import annotations

import json
import mmap
import os
import queue
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed import cli
from gpufeed.errors import UsageError
from gpufeed.tools import bench, gpu_report, timing

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mmap_pack(pack_factory):
    return pack_factory("mmap")


def fake_batches(n, size=4, delay=0.0):
    for i in range(n):
        if delay:
            time.sleep(delay)
        yield torch.zeros(size, 3, 2, 2, dtype=torch.uint8), torch.full((size,), i)


def test_time_batches_counts_and_caps():
    r = timing.time_batches(fake_batches(10))
    assert (r.samples, r.batches, r.stopped_by) == (40, 10, "end")
    assert r.samples_per_s > 0 and r.wait_fraction is None
    r = timing.time_batches(fake_batches(10), max_samples=9)
    assert (r.samples, r.stopped_by) == (12, "max_samples")


def test_time_batches_data_wait_fraction():
    # data takes 10 ms a batch, the step 1 ms: the step mostly waits
    slow = timing.time_batches(fake_batches(6, delay=0.01), step=timing.sleep_step(0.001))
    # data is instant, the step 10 ms: hardly any wait
    fast = timing.time_batches(fake_batches(6), step=timing.sleep_step(0.01))
    assert slow.wait_fraction > 0.6
    assert fast.wait_fraction < 0.3


def test_time_batches_closes_generator():
    closed = []

    def gen():
        try:
            yield from fake_batches(100)
        finally:
            closed.append(True)

    timing.time_batches(gen(), max_samples=8)
    assert closed == [True]


def test_bench_command_json(mmap_pack, capsys):
    code = cli.main(
        [
            "bench",
            str(mmap_pack),
            "-b",
            "4",
            "--workers",
            "0",
            "--epochs",
            "2",
            "--step-ms",
            "1",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["num_workers"] == 0
    assert [p["samples"] for p in report["passes"]] == [17, 17]
    assert 0 <= report["wait_fraction"] <= 1
    assert report["samples_per_s"] > 0


def test_bench_command_crop_decodes_with_the_fused_crop(tmp_path, jpeg_folder, capsys):
    pack = tmp_path / "jpegs"
    gpufeed.pack(jpeg_folder, pack, format="lmdb", workers=1, quiet=True)

    def bench_mb(*extra):
        argv = ["bench", str(pack), "-b", "4", "-j", "0", "--json", "--epochs", "3", *extra]
        assert cli.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert [p["samples"] for p in report["passes"]] == [13] * 3
        return report

    plain, cropped = bench_mb(), bench_mb("--crop", "8")
    # bytes per sample: the 3x8x8 crop (not the 3x20x24 picture) and an int64 label
    per_plain = plain["batch_mb_per_s"] / plain["samples_per_s"]
    per_crop = cropped["batch_mb_per_s"] / cropped["samples_per_s"]
    assert per_plain / per_crop == pytest.approx((3 * 20 * 24 + 8) / (3 * 8 * 8 + 8))


def test_bench_crop_decode_on_says_where_images_are_decoded(tmp_path, jpeg_folder, capsys):
    pack = tmp_path / "jpegs"
    gpufeed.pack(jpeg_folder, pack, format="mmap", workers=1, quiet=True)
    argv = ["bench", str(pack), "-b", "4", "-j", "0", "--crop", "8", "--epochs", "1"]
    assert cli.main([*argv, "--json", "--decode-on", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_on"] == "cpu (the loader's workers)"
    assert cli.main([*argv, "--decode-on", "cpu"]) == 0
    assert "cpu (the loader's workers)" in capsys.readouterr().out
    if not torch.cuda.is_available():  # insisting on the GPU without one: exit 2, saying why
        assert cli.main([*argv, "--device", "cuda", "--decode-on", "cuda"]) == 2
        assert "decode_on='cuda' needs the GPU JPEG decoder" in capsys.readouterr().err
        return
    assert cli.main([*argv, "--json", "--device", "cuda", "--decode-on", "cuda"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decode_on"].startswith("cuda") and report["passes"][0]["samples"] == 13


def test_split_decode_ships_encoded_bytes_only_for_the_gpu():
    from gpufeed.tools.decode_options import split_decode

    crop = gpufeed.RandomResizedCrop(8)
    assert split_decode({}, "cpu", "auto") == ({}, None, None)
    opts, device_crop, where = split_decode({"decode": crop, "x": 1}, "cpu", "auto")
    assert (opts, device_crop) == ({"decode": crop, "x": 1}, None) and where.startswith("cpu")
    if torch.cuda.is_available():
        opts, device_crop, where = split_decode({"decode": crop}, "cuda", "auto")
        assert (opts, device_crop) == ({"decode": False}, crop) and where.startswith("cuda")
    else:
        with pytest.raises(UsageError, match="no CUDA device"):
            split_decode({"decode": crop}, "cuda", "cuda")


def test_bench_command_table_reads_settings(mmap_pack, tmp_path, capsys):
    settings = tmp_path / "loader.json"
    settings.write_text(json.dumps({"num_workers": 0, "block_size": 8, "_batch_size": 4}))
    assert cli.main(["bench", str(mmap_pack), "-b", "4", "--settings", str(settings)]) == 0
    out = capsys.readouterr().out
    assert "block_size=8" in out and "samples/s" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")
def test_bench_device_cuda_without_cuda(mmap_pack, capsys, monkeypatch):
    monkeypatch.delenv(bench.EXPECT_GPU_ENV, raising=False)
    assert cli.main(["bench", str(mmap_pack), "-b", "8", "-j", "0", "--device", "cuda"]) == 0
    captured = capsys.readouterr()
    assert gpu_report.NO_CUDA in captured.err and gpu_report.NO_CUDA in captured.out
    monkeypatch.setenv(bench.EXPECT_GPU_ENV, "1")
    assert cli.main(["bench", str(mmap_pack), "-b", "8", "-j", "0", "--device", "cuda"]) == 1
    assert gpu_report.gpu_report(device="cuda") == {"skipped": gpu_report.NO_CUDA}


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA path")
def test_smoke_gpu_script_cpu_path(tmp_path, monkeypatch, capsys):
    import runpy

    smoke = runpy.run_path(str(REPO / "bench" / "studies" / "smoke_gpu.py"), run_name="smoke_gpu")
    args = ["--samples", "16", "--size", "8", "--batch-size", "8"]
    monkeypatch.delenv(bench.EXPECT_GPU_ENV, raising=False)
    out = tmp_path / "r.json"
    assert smoke["main"]([*args, "--json", str(out)]) == 0
    assert gpu_report.NO_CUDA in capsys.readouterr().out
    assert json.loads(out.read_text())["gpu"] == {"skipped": gpu_report.NO_CUDA}
    monkeypatch.setenv(bench.EXPECT_GPU_ENV, "1")  # a GPU runner: no CUDA is a failure
    assert smoke["main"](args) == 1
    assert "GPUFEED_EXPECT_GPU=1" in capsys.readouterr().err


# ------------------------------------------------------------------ the suite's helpers


@pytest.fixture()
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import suite

    return suite


@pytest.fixture()
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import report

    return report


def test_suite_runs_opt_in_cases_only_when_named(suite, tmp_path):
    default = [c.name for c in suite.selected_cases(tmp_path, False, None)]
    assert "bigraw" not in default and {"raw", "jpeg", "large"} <= set(default)
    named = suite.selected_cases(tmp_path, False, "bigraw,raw")
    assert [c.name for c in named] == ["raw", "bigraw"]
    assert named[1].count == 4 * named[0].count  # four times raw's samples, of raw's shape


def test_suite_evict_and_disk_bytes(suite, tmp_path):
    f = tmp_path / "d" / "x.bin"
    f.parent.mkdir()
    f.write_bytes(os.urandom(1 << 16))
    suite.evict([str(f), str(tmp_path / "missing")])  # no root needed, missing files ignored
    assert suite.disk_bytes(tmp_path / "d") >= 1 << 16
    assert suite.data_files(tmp_path / "d") == [str(f)]


def test_suite_read_bound_fills_a_batch_sized_buffer(suite, tmp_path, monkeypatch):
    """A loader writes each batch to memory the CPU caches do not hold: the bound's reads
    walk through a buffer of one batch's bytes instead of refilling one 8 MiB buffer."""
    import ctypes
    from types import SimpleNamespace

    store = tmp_path / "gpufeed-mmap"
    store.mkdir()
    size = (20 << 20) + 12345  # 2.x reads of 8 MiB, the last one short
    (store / "samples.npy").write_bytes(os.urandom(size))
    case = SimpleNamespace(kind="raw", count=100, root=tmp_path, sample_bytes=lambda: 1 << 20)
    reads = []  # (where, how many bytes) of each read
    real_open = open

    class Spy:  # the file the bound reads, recording where each read lands
        def __init__(self, *args, **kw):
            self.f = real_open(*args, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def readinto(self, view):
            reads.append((ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view)))
            return self.f.readinto(view)

    monkeypatch.setattr(suite, "open", Spy, raising=False)
    bound = suite.read_bound(case, drop_caches=False, runs=1, batch_size=64)
    first_pass = reads[:4]  # 3 reads of the file, then the one that finds its end
    assert [n for _, n in first_pass] == [8 << 20] * 4
    assert [at - first_pass[0][0] for at, _ in first_pass] == [0, 8 << 20, 16 << 20, 24 << 20]
    for cache in ("cold", "warm"):
        per_sample = bound[cache]["MBps"] * 1e6 / bound[cache]["samples_per_s"]
        assert per_sample == pytest.approx(size / case.count)
    assert bound["warm"]["warm_small_buffer_MBps"] > 0


def test_suite_checks_that_an_eviction_left_nothing_cached(suite, tmp_path):
    from bench import pagecache

    f = tmp_path / "x.bin"
    f.write_bytes(os.urandom(1 << 20))
    os.sync()  # dirty pages are not dropped: write them back first
    f.read_bytes()
    assert suite.resident_fraction([str(f)]) == 1.0
    suite.evict([str(f)])
    assert suite.resident_fraction([str(f)]) <= pagecache.NOT_COLD
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
        m[:: mmap.PAGESIZE]  # a live map keeps its pages through DONTNEED (FFCV's .beton)
        suite.evict([str(f)])
        assert suite.resident_fraction([str(f)]) == 1.0


def _row(label, workers, cold, warm=None, **extra):
    """A row's results as the suite records them: its cold/shuffled (and warm) measurements."""
    conditions = {"cold/shuffled": {"first_batch_s": 0.1, **cold}}
    if warm:
        conditions["warm/shuffled"] = {"first_batch_s": 0.1, **warm}
    return {
        "label": label,
        "disk_bytes": 1e6,
        "peak_rss_bytes": 1e8,
        "workers": workers,
        "conditions": conditions,
        **extra,
    }


def _results(turns: bool = True) -> dict:
    rows = {
        "perfile:0": _row(
            "per-file",
            0,
            {"samples_per_s": 100.0, "pass_samples_per_s": 80.0},
            {"samples_per_s": 200.0, "pass_samples_per_s": 150.0},
        ),
        # pass k of every row ran in round k: steady ratios by round 1.50, 2.00 and 2.67,
        # whole-pass ratios 1.80, 2.50 and 3.33
        "gpufeed:mmap": _row(
            "gpufeed mmap",
            0,
            {
                "samples_per_s": 2000.0,
                "pass_samples_per_s": 1000.0,
                "pass_s": 2.0,
                "runs": [1800.0, 2000.0, 2400.0],
                "pass_runs": [900.0, 1000.0, 1200.0],
            },
            {"samples_per_s": 6000.0, "pass_samples_per_s": 3000.0},
        ),
        "peer:webdataset": _row(
            "webdataset",
            2,
            {
                "samples_per_s": 1000.0,
                "pass_samples_per_s": 400.0,
                "first_batch_s": 0.2,
                "cached_at_first_batch": 0.6,
                "runs": [1200.0, 1000.0, 900.0],
                "pass_runs": [500.0, 400.0, 360.0],
            },
            {"samples_per_s": 2000.0, "pass_samples_per_s": 1500.0},
        ),
        "peer:ffcv": {"label": "ffcv", "skipped": "not importable"},
    }
    return {
        "rows_took_turns": turns,
        "cases": {
            "raw": {
                "sample_bytes": 1000.0,
                "conditions": ["cold/shuffled", "warm/shuffled"],
                "rows": rows,
                "bound": {
                    "cold": {"samples_per_s": 4000.0, "MBps": 4.0},
                    "warm": {"samples_per_s": 8000.0, "MBps": 8.0},
                },
            }
        },
    }


def test_report_headline_is_the_whole_pass_cold_and_the_steady_rate_warm(report):
    """Cold, a user waits for the whole pass (a peer that reads its file before its first
    batch has a warm steady rate); warm, the steady rate heads, the other rate beside it."""
    table = report.build_table(_results())
    cold = {t["key"]: t for t in table if t.get("key") and t["condition"] == "cold/shuffled"}
    warm = {t["key"]: t for t in table if t.get("key") and t["condition"] == "warm/shuffled"}
    mm = cold["gpufeed:mmap"]
    assert (mm["headline"], mm["headline_samples_per_s"]) == ("whole pass", 1000.0)
    assert (mm["samples_per_s"], mm["pass_samples_per_s"], mm["pass_s"]) == (2000.0, 1000.0, 2.0)
    assert mm["vs_perfile"] == pytest.approx(12.5)  # 1000 over the per-file whole pass, 80
    assert mm["vs_bound"] == pytest.approx(0.25)
    assert mm["MBps"] == pytest.approx(1.0)
    wm = warm["gpufeed:mmap"]
    assert (wm["headline"], wm["headline_samples_per_s"]) == ("steady", 6000.0)
    assert wm["pass_samples_per_s"] == 3000.0 and wm["vs_bound"] == pytest.approx(0.75)
    md = report.fmt_table(table)
    header = md.splitlines()[0]
    assert "samples/s (headline)" in header and "steady samples/s" in header
    assert "whole pass samples/s" in header and "whole pass s" in header
    assert md.count("\n") == len(table) + 1 and "not run: not importable" in md
    assert "cold, the whole pass" in report.markdown({**_results(), "table": table})


def test_report_table_ratios_and_goals(report):
    table = report.build_table(_results())
    assert any(t.get("status") == "not importable" for t in table)
    goal = report.goals(table)[0]
    assert "12.5x per-file" in goal and "2.50x the best peer (webdataset), whole pass" in goal
    assert "which had 60% of its files cached by its first batch" in goal
    assert "steady 2.00x" in goal and "at 25% of the read bound" in goal
    ratios = report.ratio_tables(table).splitlines()
    assert "| condition | vs | rate | mmap |" in ratios
    assert "| cold/shuffled | per-file | whole pass | 12x |" in ratios
    assert "| cold/shuffled | per-file | steady | 20x |" in ratios
    assert "| cold/shuffled | webdataset | whole pass | 2.50x (1.80-3.33) |" in ratios
    assert "| cold/shuffled | webdataset | steady | 2.00x (1.50-2.67) |" in ratios
    assert "| cold/shuffled | read bound | whole pass | 25% |" in ratios
    assert "| warm/shuffled | per-file | steady | 30x |" in ratios
    assert "| warm/shuffled | webdataset | steady | 3.00x |" in ratios
    assert "| warm/shuffled | read bound | steady | 75% |" in ratios
    # rows run one after another: their passes are not comparable pass by pass
    alone = report.ratio_tables(report.build_table(_results(turns=False))).splitlines()
    assert "| cold/shuffled | webdataset | whole pass | 2.50x |" in alone
    assert "| cold/shuffled | webdataset | steady | 2.00x |" in alone


def test_report_writes_the_results_and_prints_the_tables_from_the_json(report, tmp_path):
    import subprocess
    import sys

    results = {"quick": True, "cpus": 2, "torch": "2.9.1", "runs": 1, "cap_s": 0.3, **_results()}
    report.write(results, tmp_path)
    assert {"results.json", "results.md", "latest.md"} <= {p.name for p in tmp_path.iterdir()}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["table"] and saved["goals"]
    latest = (tmp_path / "latest.md").read_text()
    assert latest.startswith("## Latest results") and "QUICK run" in latest
    assert "| cold/shuffled | webdataset | whole pass | 2.50x (1.80-3.33) |" in latest
    argv = [sys.executable, "-m", "bench.report", "--markdown", str(tmp_path / "results.json")]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (tmp_path / "results.md").read_text().strip()


def test_suite_cold_pass_records_what_was_cached_by_its_first_batch(suite, tmp_path):
    from bench import pagecache

    f = tmp_path / "x.bin"
    f.write_bytes(os.urandom(1 << 20))
    os.sync()
    suite.evict([str(f)])
    seen = {}

    def batches():
        f.read_bytes()  # a loader reading its whole file before its first batch (FFCV's)
        yield from ("a", "b")

    assert list(suite._first_batch_checked(batches(), [str(f)], seen)) == ["a", "b"]
    assert seen["cached"] == 1.0 and seen["check_s"] >= 0.0
    seen.clear()
    suite.evict([str(f)])
    assert list(suite._first_batch_checked(iter(["a"]), [str(f)], seen)) == ["a"]
    assert seen["cached"] <= pagecache.NOT_COLD
    assert list(suite._first_batch_checked(iter([]), [str(f)], {})) == []


def test_suite_pass_records_the_whole_pass_from_the_loaders_making(suite, tmp_path):
    """Every pass records its whole pass (loader made -> last batch), the cold headline,
    beside its steady rate (from the first batch)."""
    from bench import data as bdata

    case = bdata.Case("raw", "raw", 40, (3, 8, 8), tmp_path / "raw")
    bdata.generate(case)
    files = suite.data_files(case.source)
    p = suite.one_pass(
        case, "perfile:0", shuffle=True, workers=0, batch_size=8, cap_s=30.0, files=files
    )
    assert p["samples"] == 40 and p["stopped_by"] == "max_samples"
    assert p["pass_s"] >= p["first_batch_s"] > 0
    assert p["pass_samples_per_s"] == pytest.approx(40 / p["pass_s"])
    summary = suite._condition_summary([p, p], [0.0, float("nan")])
    assert (
        summary["pass_s"] == p["pass_s"] and summary["pass_runs"] == [p["pass_samples_per_s"]] * 2
    )
    assert summary["resident_after_evict"] != summary["resident_after_evict"]  # NaN wins


def test_suite_perfile_dataset_and_augment(suite, tmp_path):
    from bench import data as bdata

    case = bdata.Case("jpeg", "jpeg", 12, (3, 64, 64), tmp_path / "jpeg", crop=56)
    bdata.generate(case)
    files, labels = case.files(), case.labels()
    assert len(files) == 12 and labels.shape == (12,)
    ds = suite.PerFileDataset(files, labels, "jpeg", bdata.Augment(56))
    x, y = ds[3]
    assert x.shape == (3, 56, 56) and x.dtype == torch.uint8 and y == int(labels[3])
    assert 500 < case.sample_bytes() < 12288  # a JPEG, smaller than the raw pixels


def test_suite_fields_case_rows_store_and_read_jpeg_and_caption(suite, tmp_path):
    from bench import data as bdata

    case = bdata.Case("fields", "fields", 40, (3, 64, 64), tmp_path / "fields", crop=56)
    bdata.generate(case)
    tokens = case.tokens()
    assert tokens.shape == (40, 32) and tokens.dtype == np.int32
    rows = [r for _, r in suite.rows() if suite.row_applies(case, r)]
    assert rows == [f"gpufeed:{f}" for f in suite.FORMATS] + [
        "peer:webdataset", "peer:litdata", "peer:mds"
    ]  # fmt: skip
    for row in ("gpufeed:lmdb", "gpufeed:tar", "peer:webdataset"):
        info = suite.prepare(case, row)
        assert info["disk_bytes"] > 40 * 32 * 4
        batches, cleanup = suite.make_batches(
            case, row, shuffle=True, workers=0, batch_size=16, seed=1
        )
        first = next(iter(batches))
        if row.startswith("gpufeed"):
            images, captions, labels = first["image"], first["caption"], first["label"]
        else:
            images, captions, labels = first
        assert images.shape == (16, 3, 56, 56) and images.dtype == torch.uint8, row
        assert captions.shape == (16, 32) and captions.dtype == torch.int32, row
        # each caption is its own sample's: the rows' shuffles differ, the pairs may not
        where = [int(np.flatnonzero((tokens == c.numpy()).all(1))[0]) for c in captions]
        assert case.labels()[where].tolist() == [int(y) for y in labels], row
        cleanup()


def test_compare_plain_reads_both_loaders_side_by_side(mmap_pack, capsys):
    """The measuring harness behind README's ratio (the numbers themselves are not checked:
    speed is judged by running it, not by a test)."""
    code = cli.main(["bench", str(mmap_pack), "-b", "4", "--compare-plain", "--seconds", "0.05"])
    assert code == 0
    out = capsys.readouterr().out
    assert "DataLoader" in out and "make_loader" in out and "ratio" in out
    assert "DataLoader, in memory" in out and "samples held in a list" in out
    result = bench.compare_plain(mmap_pack, batch_size=4, workers=(0,), seconds=0.05, rounds=2)
    row = result["workers"][0]
    assert row["plain_samples_per_s"] > 0 and row["make_loader_samples_per_s"] > 0
    assert row["in_memory_samples_per_s"] > 0
    assert row["make_loader_vs_plain"] == pytest.approx(
        row["make_loader_samples_per_s"] / row["plain_samples_per_s"]
    )
    assert result["in_memory_samples"] == len(gpufeed.open_dataset(mmap_pack))  # all fit


def test_compare_plain_holds_samples_up_to_its_byte_budget(mmap_pack):
    from gpufeed.tools import compare_plain

    ds = gpufeed.open_dataset(mmap_pack)
    one = ds[0][0].numel() + 8  # the image's bytes and the label's
    held = compare_plain._held_samples(ds, 3 * one)
    assert len(held) == 3
    for i in range(3):  # as dataset[i] gives them
        assert torch.equal(held[i][0], ds[i][0]) and held[i][1] == ds[i][1]
    assert len(compare_plain._held_samples(ds, 1)) == 1  # at least one


def test_compare_plain_holds_nothing_for_a_stream(tmp_path, array_folder):
    pack = tmp_path / "p.tar"
    gpufeed.pack(array_folder, pack, format="tar", workers=1, quiet=True)
    result = bench.compare_plain(
        pack,
        batch_size=4,
        workers=(0,),
        seconds=0.05,
        rounds=1,
        dataset_options={"map_style": False},
    )
    assert result["in_memory_samples"] is None
    assert result["workers"][0]["in_memory_samples_per_s"] is None
    assert "in memory" not in bench.format_compare(result)


class _FakeEpoch(threading.Thread):
    """FFCV's EpochIterator as far as Passes uses it: a thread filling a bounded queue,
    polling its stop event between puts, and a last blocking put(None) at the end."""

    def __init__(self, batches: int):
        super().__init__(daemon=True)
        self.output_queue = queue.Queue(1)
        self.terminate_event = threading.Event()
        self.storage_state = ("map",)
        self.batches = batches
        self.start()

    def run(self):
        for b in range(self.batches):
            while True:
                try:
                    self.output_queue.put(b, timeout=0.05)
                    break
                except queue.Full:
                    if self.terminate_event.is_set():
                        return
        self.output_queue.put(None)

    def __next__(self):
        item = self.output_queue.get()
        if item is None:
            raise StopIteration
        return item

    def close(self):
        self.terminate_event.set()


class _FakeLoader:
    def __init__(self, batches: int):
        self.batches = batches
        self.memory_manager = types.SimpleNamespace(context=types.SimpleNamespace(mmap="map"))

    def __iter__(self):
        return _FakeEpoch(self.batches)

    def __len__(self):
        return self.batches


@pytest.mark.parametrize("cut_short", [True, False])
def test_ffcv_passes_close_stops_the_epoch_threads_and_drops_the_map(cut_short):
    from bench.peers.ffcv_peer import Passes

    passes = Passes(_FakeLoader(batches=50 if cut_short else 2))
    epoch = iter(passes)
    if cut_short:
        assert next(epoch) == 0  # the suite's cap stops here; the thread keeps reading ahead
    else:
        time.sleep(0.2)  # ran to its end: its last put(None) waits on a full queue
    assert epoch.is_alive()
    t = time.perf_counter()
    passes.close(wait_s=5.0)
    assert time.perf_counter() - t < 2.0
    assert not epoch.is_alive()
    assert epoch.storage_state is None
    assert passes.loader.memory_manager.context.mmap is None
    assert len(passes) == (50 if cut_short else 2)
