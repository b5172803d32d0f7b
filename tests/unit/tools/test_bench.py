"""gpufeed bench (gpufeed/tools/bench.py): the timing core, the command on a tiny pack and
the no-CUDA paths. The comparison suite's tests are in tests/bench."""

from __future__ import annotations

import json
import time
from pathlib import Path

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
