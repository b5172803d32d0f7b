"""The comparison suite's helpers (bench/suite.py; the suite itself runs with `make bench`,
not here)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the suite's helpers


@pytest.fixture()
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import suite

    return suite


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
