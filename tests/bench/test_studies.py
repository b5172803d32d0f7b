"""bench/studies: the shared runner (common.py: rounds taken in turn with the order rotated,
the base options, one output format: JSON + a markdown ratio table); smoke_gpu.py on a machine
without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpufeed.tools import bench, gpu_report

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench.studies import common

    return common


def test_rounds_run_every_candidate_once_each_starting_one_further_on(common):
    order = []
    candidates = {name: (lambda name=name: order.append(name) or len(order)) for name in "abc"}
    results = common.interleaved(candidates, rounds=3)
    assert order == list("abcbcacab")
    assert results == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}
    seconds = common.interleaved({"x": lambda: None}, rounds=2)["x"]
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)  # nothing returned: its seconds
    assert common.rates({"x": [0.5, 0.25]}, 100) == {"x": [200.0, 400.0]}


def test_base_options_and_one_output_format(common, tmp_path, capsys):
    args = common.parser("A study.\n\nMore.").parse_args(
        [
            "--rounds",
            "2",
            "--quick",
            "--out",
            str(tmp_path / "o"),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert (args.rounds, args.quick) == (2, True)
    md = common.ratio_table({"base": 100.0, "new": 250.0, "gone": None}, "base", title="t")
    assert md.splitlines()[2:] == [
        "| candidate | samples/s | vs base |",
        "|---|---|---|",
        "| base | 100 | 1.00x |",
        "| new | 250 | 2.50x |",
        "| gone | not run | |",
    ]
    common.write(args, "study", {"rates": {"new": 250.0}}, md)
    assert capsys.readouterr().out.strip() == md
    assert json.loads((tmp_path / "o" / "study.json").read_text()) == {"rates": {"new": 250.0}}
    assert (tmp_path / "o" / "study.md").read_text().strip() == md
    assert json.loads((tmp_path / "r.json").read_text()) == {"rates": {"new": 250.0}}


@pytest.mark.slow
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
