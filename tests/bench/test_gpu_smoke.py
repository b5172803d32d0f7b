"""The CPU side of `make smoke-gpu` (tests/gpu/smoke.py) and of its torch.compile check
(tests/gpu/compile_check.py): the eager-against-compiled comparison, the verdict on wrong
gradients, the table row and the wiring into the run. The real compile runs in the images
(tests/images/test_compile.py on the CPU; the GPU path when a GPU box runs smoke-gpu)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parents[1] / "gpu"
TINY = {"batch": 4, "width": 8, "depth": 1}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def compile_check(monkeypatch):
    # smoke.py imports it by name, as it does when run as a script from tests/gpu.
    monkeypatch.syspath_prepend(str(GPU_DIR))
    import compile_check

    return compile_check


@pytest.fixture
def smoke(compile_check):
    return _load("smoke")


class Scaled(torch.nn.Module):
    """A 'compiler' that gets the numbers wrong: the same parameters, outputs off by 1%."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x) * 1.01


def test_an_exact_compile_passes_and_reports_both_step_times(compile_check):
    result = compile_check.run("cpu", rounds=1, steps=1, compile_fn=lambda m: m, sizes=TINY)
    assert compile_check.problems(result) == []
    assert result["loss_difference"] == 0 and result["grad_difference"] == 0
    assert result["eager_step_ms"] > 0 and result["compiled_step_ms"] > 0
    assert result["speedup"] == pytest.approx(result["eager_step_ms"] / result["compiled_step_ms"])
    # Nothing was compiled, so torch's cache counters did not move.
    assert set(result["cache"]) == set(compile_check.CACHE_COUNTERS)
    assert not any(result["cache"].values())


def test_wrong_compiled_numbers_fail(compile_check):
    result = compile_check.run("cpu", rounds=1, steps=1, compile_fn=Scaled, sizes=TINY)
    found = compile_check.problems(result)
    assert found and any("difference" in problem for problem in found), found


def test_check_compile_fails_the_smoke_run_on_wrong_numbers(smoke, compile_check, monkeypatch):
    wrong = compile_check.run("cpu", rounds=1, steps=1, compile_fn=Scaled, sizes=TINY)
    monkeypatch.setattr(compile_check, "run", lambda device, **kw: {**wrong, "device": device})
    with pytest.raises(smoke.Failed, match="grad_difference"):
        smoke.check_compile()


def test_smoke_runs_the_compile_check_and_tables_it(smoke, compile_check, monkeypatch, tmp_path):
    measured = compile_check.run("cpu", rounds=1, steps=1, compile_fn=lambda m: m, sizes=TINY)
    devices = []

    def on_gpu(device, **kwargs):
        devices.append(device)
        return {**measured, "device": device}

    monkeypatch.setattr(compile_check, "run", on_gpu)
    for name in (
        "check_preflight",
        "check_cuda",
        "check_bf16_matmul",
        "check_prefetch",
        "check_decode",
    ):
        monkeypatch.setattr(smoke, name, lambda *a, **k: {"status": "skipped"})
    monkeypatch.setattr(smoke, "run_bench", lambda out: {"status": "skipped"})
    assert smoke.main(["--out", str(tmp_path)]) == 0
    assert devices == ["cuda"]
    results = json.loads((tmp_path / "smoke-gpu.json").read_text())
    assert list(results)[:4] == ["preflight", "cuda", "bf16_matmul", "compile"]
    assert results["compile"]["status"] == "passed"
    row = next(
        line for line in (tmp_path / "smoke-gpu.md").read_text().splitlines() if "compile" in line
    )
    eager, compiled = measured["eager_step_ms"], measured["compiled_step_ms"]
    assert f"eager {eager:.2f} ms, compiled {compiled:.2f} ms" in row, row
    assert f"({measured['speedup']:.2f}x)" in row, row


def test_the_gpu_decode_check_fails_the_run_on_pixels_and_tables_them(smoke, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(GPU_DIR))
    import decode_check

    good = {
        "device": "cuda:0",
        "images": 24,
        "flipped": 11,
        "max_difference": 1,
        "differ_pct": 0.01,
        "fallbacks": 0,
    }
    assert decode_check.problems(good) == []
    bad = {**good, "max_difference": 7, "differ_pct": 3.0, "fallbacks": 1}
    assert len(decode_check.problems(bad)) == 3
    monkeypatch.setattr(decode_check, "run", lambda device: {**bad, "device": device})
    with pytest.raises(smoke.Failed, match="7 away from torchvision"):
        smoke.check_decode()
    monkeypatch.setattr(decode_check, "run", lambda device: {**good, "device": device})
    row = smoke.table({"gpu_decode": smoke.check_decode()}).splitlines()[2]
    assert "24 JPEGs on cuda" in row and "within 1 of torchvision" in row, row
