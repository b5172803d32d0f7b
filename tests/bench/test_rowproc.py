"""The comparison suite's rows taking turns (bench/rowproc.py): one pass at a time, in rounds
that start one row further on each time, and a row that fails or hangs does not stop the
others. Real processes (forked, and started afresh where a thread runs), real pipes."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A row's task: `passes` passes, each logged at its start and its end; it may fail or hang
# in one of them. Written into a module of its own, so a fresh interpreter can run it too.
TASK = """
import json, sys, time
from pathlib import Path
from bench import rowproc

def task(spec):
    log = Path(spec["log"])
    for k in range(spec["passes"]):
        rowproc.wait_turn()
        with log.open("a") as f:
            f.write(f"{spec['row']}{k}+\\n")
        time.sleep(0.02)
        if spec.get("fail_at") == k:
            raise RuntimeError(f"row {spec['row']} failed in pass {k}")
        if spec.get("hang_at") == k:
            time.sleep(120)
        with log.open("a") as f:
            f.write(f"{spec['row']}{k}-\\n")
    return {"row": spec["row"], "passes": spec["passes"]}

if __name__ == "__main__":
    rowproc.child_main(task, json.loads(sys.argv[2]))
"""


@pytest.fixture()
def turns(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    (tmp_path / "turn_task.py").write_text(TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from bench import rowproc

    task = importlib.import_module("turn_task").task
    log = tmp_path / "log"

    def run(rows: dict[str, dict], timeout: float = 60.0):
        specs = {
            row: {"row": row, "log": str(log), "passes": 3, **opts} for row, opts in rows.items()
        }
        ended = rowproc.run_in_turns(task, specs, timeout, "turn_task")
        results = {row: rowproc.result(*end[:3]) for row, end in ended.items()}
        return results, log.read_text().split()

    return run


@pytest.fixture(params=["forked", "fresh interpreter"])
def start(request):
    """Run the rows forked, or (a thread running here) each in a fresh interpreter."""
    if request.param == "forked":
        yield
        return
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    yield
    stop.set()
    t.join()


def test_rows_take_turns_one_pass_at_a_time_in_rotating_rounds(turns, start):
    results, log = turns({"a": {}, "b": {}, "c": {}})
    assert {row: r for row, (r, _) in results.items()} == {
        row: {"row": row, "passes": 3} for row in "abc"
    }
    # each pass ends before the next starts: never two at once
    assert log[0::2] == [e.replace("-", "+") for e in log[1::2]]
    starts = [e[:-1] for e in log[0::2]]
    assert starts == ["a0", "b0", "c0", "b1", "c1", "a1", "c2", "a2", "b2"]


def test_a_failed_row_is_reported_and_the_others_go_on(turns, start):
    results, log = turns({"a": {}, "b": {"fail_at": 1}, "c": {}})
    assert results["a"][0] == {"row": "a", "passes": 3}
    assert results["c"][0] == {"row": "c", "passes": 3}
    failed, why = results["b"]
    assert failed is None and "row b failed in pass 1" in why
    assert "b2+" not in log and log.count("a2-") == 1 and log.count("c2-") == 1


@pytest.mark.slow
def test_a_row_that_hangs_is_killed_after_the_timeout(turns):
    results, log = turns({"a": {"hang_at": 0}, "b": {}}, timeout=3.0)
    failed, why = results["a"]
    assert failed is None and "timed out after 3.0 s" in why
    assert results["b"][0] == {"row": "b", "passes": 3}
    assert "a0-" not in log and "a1+" not in log


def test_a_row_alone_runs_every_pass_in_order(turns):
    """One row at a time (the suite under a memory limit): the same turns, no one to wait for."""
    results, log = turns({"a": {"passes": 4}})
    assert results["a"][0] == {"row": "a", "passes": 4}
    assert log == [f"a{k}{end}" for k in range(4) for end in "+-"]
