"""bench/studies/convert.py's quick mode: every candidate that is installed runs (gpufeed's
parts + merge, write and write_batch), a peer that is not is a row saying why, and the JSON
holds each pass's seconds, bytes and peak RSS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_convert_study_quick_runs_every_installed_candidate(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.studies.convert",
        "--quick",
        "--n",
        "3000",
        "--jpegs",
        "600",
    ]
    cmd += ["--procs", "1,2", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    results = json.loads(out.read_text())
    for kind, n in (("raw", 3000), ("jpeg", 600)):
        case = results["cases"][kind]
        assert case["n"] == n and case["dd_bytes_per_s"] > 0
        for procs in (1, 2):
            (run,) = case["runs"][f"gpufeed tar write, {procs} proc"]
            assert "error" not in run, run
            assert run["seconds"] > 0 and run["bytes"] > n * 1000 and run["peak_rss"] > 0
    assert {"gpufeed tar write_batch, 2 proc"} <= set(results["cases"]["raw"]["runs"])
    assert "| gpufeed tar write | 2 |" in table and "| gpufeed tar write_batch | 1 |" in table
    for tool, why in results["missing"].items():
        if why:  # not installed here: a row saying so, no pass
            assert f"| {tool} | | not run: " in table
            assert f"{tool}, 1 proc" not in results["cases"]["raw"]["runs"]
        else:
            assert f"| {tool} | 1 | failed" not in table and f"| {tool} | 1 |" in table
    assert not list(tmp_path.glob("convert-*"))  # its working folder removed
