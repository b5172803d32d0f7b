"""bench/studies/smoke_gpu.py on a machine without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpufeed.tools import bench, gpu_report

REPO = Path(__file__).resolve().parents[2]


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
