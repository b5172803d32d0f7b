"""The suite's --read-as: a row's process reads as another user, and a root helper it forked
first tells it what only root can (how much of a file is cached)."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")


@pytest.fixture()
def suite(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import suite

    return suite


@pytest.fixture()
def readable_file():
    """A 1 MiB file, root's, that any user may read (tmp_path's folders are root's alone)."""
    folder = tempfile.mkdtemp(prefix="gpufeed-read-as-", dir="/tmp")
    os.chmod(folder, 0o755)
    path = Path(folder) / "data.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())  # dirty pages are not evicted
    path.chmod(0o644)
    yield str(path)
    shutil.rmtree(folder)


def in_child(fn) -> dict:
    """``fn()``'s dict, run in a forked child (which may give up root for good)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_parse_user_takes_uid_or_uid_gid_and_refuses_root_and_words(suite):
    assert suite.bread_as.parse_user("1000") == (1000, 1000)
    assert suite.bread_as.parse_user("1000:100") == (1000, 100)
    with pytest.raises(SystemExit, match="UID or UID:GID"):
        suite.bread_as.parse_user("jovyan")
    with pytest.raises(SystemExit, match="other than root"):
        suite.bread_as.parse_user("0")


def test_the_helpers_loop_answers_values_nan_and_errors_line_by_line(suite):
    tasks = {"add": lambda a, b: a + b, "nan": lambda: float("nan"), "fail": lambda: 1 / 0}
    requests = io.StringIO('["add", 2, 3]\n["nan"]\n["fail"]\n["missing"]\n')
    answers = io.StringIO()
    suite.bread_as.serve(tasks, requests, answers)
    lines = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert lines[0] == {"value": 5} and math.isnan(lines[1]["value"])
    assert lines[2]["error"].startswith("ZeroDivisionError") and "KeyError" in lines[3]["error"]


def test_the_helper_is_a_small_process_of_its_own_that_sends_errors_back(suite, readable_file):
    suite.read_files([readable_file])
    helper = suite.bread_as.RootHelper()
    try:
        assert helper("resident", [readable_file]) == 1.0
        with pytest.raises(RuntimeError, match="FileNotFoundError"):
            helper("resident", ["/nonexistent/data.bin"])
        assert helper("resident", [readable_file]) == 1.0  # still answering after an error
        # its own interpreter: no torch (a row's peak RSS counts its whole process tree)
        with open(f"/proc/{helper.pid}/maps") as f:
            assert "libtorch" not in f.read()
    finally:
        helper.close()


@needs_root
def test_a_row_process_read_as_nobody_evicts_and_root_tells_what_stayed_cached(
    suite, readable_file
):
    suite.read_files([readable_file])

    def row_process():
        suite._ROOT = suite.bread_as.read_as(NOBODY, NOBODY)
        out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
        out["own_view"] = suite.resident_fraction([readable_file])  # mincore is blind here
        out["cached_before"] = suite.cached_share([readable_file])
        suite.evict([readable_file])  # posix_fadvise needs no ownership
        out["cached_after"] = suite.cached_share([readable_file])
        return out

    out = in_child(row_process)
    from bench.pagecache import NOT_COLD

    assert "error" not in out, out
    assert (out["uid"], out["gid"], out["groups"]) == (NOBODY, NOBODY, [])
    assert out["own_view"] != out["own_view"]  # NaN: cannot tell
    assert out["cached_before"] == 1.0
    if out["cached_after"] == 1.0:
        pytest.skip("this filesystem keeps files in memory (tmpfs?)")
    assert out["cached_after"] <= NOT_COLD


def as_nobody_main(suite, argv: list[str]):
    """suite.main(argv) in a child that is not root: what it exits with."""

    def run():
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        try:
            suite.main(argv)
        except SystemExit as exc:
            return {"message": str(exc)}
        return {"message": None}

    return in_child(run)["message"]


def test_read_as_is_refused_unless_the_suite_runs_as_root(suite):
    argv = ["--read-as", "1000", "--data", "/nonexistent", "--out", "/nonexistent"]
    assert "needs the suite to run as root" in as_nobody_main(suite, argv)


def test_drop_caches_is_refused_up_front_where_it_cannot_be_written(suite):
    argv = ["--drop-caches", "--data", "/nonexistent", "--out", "/nonexistent"]
    assert "drop_caches is not writable" in as_nobody_main(suite, argv)
