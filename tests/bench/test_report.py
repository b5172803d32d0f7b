"""The comparison suite's report (bench/report.py): the headline, the tables, the results
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import report

    return report


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
