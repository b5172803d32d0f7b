"""bench/tokens.py: token windows against the memmap loop and the peers. Its quick mode runs
here on a few rows; the LitData and MDS rows are skipped with the reason where the peers are
not installed (they run in the bench image)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_mode_runs_the_rows_asked_for_and_says_why_peers_are_skipped(tmp_path):
    out = tmp_path / "r.json"
    rows = r"memmap \(|memmap Dataset w2|gpufeed w0|mixture 0.7/0.3 w0|LitData|MDS"
    args = ["--quick", "--data", str(tmp_path / "data"), "--json", str(out)]
    args += ["--rows", rows, "--conditions", "warm"]
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "tokens.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    warm = json.loads(out.read_text())["warm"]
    want = {"memmap (nanoGPT)", "memmap Dataset w2", "gpufeed w0", "mixture 0.7/0.3 w0"}
    try:
        import litdata  # noqa: F401

        want |= {"LitData TokensLoader w0", "LitData TokensLoader w2"}
    except ImportError:
        assert "litdata rows skipped: No module named 'litdata'" in run.stderr
    assert want <= set(warm) and all(warm[k] > 0 for k in want)
    assert "| gpufeed w0 |" in run.stdout and "warm vs memmap Dataset w2" in run.stdout
