"""The suite's row processes: one task in a process of its own, or every row of a case in a
process of its own, taking turns pass by pass.

On a shared machine the load drifts over minutes. Rows run one after another each see
their own minutes, so a row measured in a busy stretch looks slow against one measured in a
quiet one, and a ratio between them (the bar's numbers) says more about the machine than
the loaders. :func:`run_in_turns` starts every row's process at once and lets one pass run at
a time: each process waits for its turn before each pass (:func:`wait_turn`), and the turns
go round the rows, pass k of every row before pass k + 1 of any, each round starting one row
further on. A drift then falls on every row alike. Each row keeps its own process, imports,
workers and memory, as when they ran one after another.

A child is forked from this process, which has imported torch already (about 3 s a row
saved); where a thread runs here (a peer's writer left one), forking could copy a held lock,
so a fresh interpreter is started instead (``python -m <module> --child SPEC``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULT = "@@RESULT "

# In a row's process taking turns: (the fd its turns come on, the fd it answers on)
_TURN_FDS: tuple[int, int] | None = None


class PeakRSS:
    """Samples the summed RSS of process ``pid`` and all its descendants every 50 ms (from
    another process: a sampling thread inside the measured one could hold a lock across a
    DataLoader's fork)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
        return out

    def sample(self) -> int:
        total = 0
        for p in self._tree(self.pid):
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.sample())


def child_env() -> dict:
    """A child's environment: this repository and gpufeed's sources importable (the row
    processes, and bench.read_as's root helper)."""
    paths = (str(REPO), str(REPO / "app" / "src"), os.environ.get("PYTHONPATH"))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def child_main(task: Callable[[dict], dict], spec: dict) -> None:
    """What a child runs: ``task(spec)``, its result printed on the line :func:`result` reads.
    A child that takes turns is given its two fds in ``spec["turn_fds"]``."""
    global _TURN_FDS
    if spec.get("turn_fds"):
        _TURN_FDS = tuple(spec["turn_fds"])
    print(RESULT + json.dumps(task(spec)), flush=True)


def wait_turn() -> None:
    """In a row's process, before each pass: say that the last one is done (or, the first
    time, that the row is set up), then wait to be let go. Nothing where the row does not
    take turns (it runs alone)."""
    if _TURN_FDS is None:
        return
    go, done = _TURN_FDS
    os.write(done, b".")
    if os.read(go, 1) != b"g":
        raise SystemExit("the suite stopped before this row's turn")


def result(code: int, stdout: str, stderr: str) -> tuple[dict | None, str]:
    """A child's result, or None and the last lines it printed (why it failed)."""
    res = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    if code == 0 and res:
        return json.loads(res[-1][len(RESULT) :]), ""
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return None, " / ".join(tail)[-300:] or f"exit {code}"


@dataclass
class _Child:
    """A started child: its pid, where its output goes, and for turns its two pipe ends."""

    pid: int
    out: object
    err: object
    proc: subprocess.Popen | None = None
    go: int | None = None  # this side's end of the turns pipe
    done: int | None = None  # this side's end of the answers pipe
    status: int | None = None  # the wait status, once reaped
    timed_out: bool = False
    peak_rss: int = 0


def _start(task, spec: dict, module: str, turns: tuple[int, int] | None, close: list[int]):
    """Start a child running ``task(spec)``, forked where no other thread runs here.
    ``turns``: its two pipe ends (kept open in it); ``close``: every other pipe end here."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    if turns:
        spec = dict(spec, turn_fds=list(turns))
    env = child_env()
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.active_count() > 1 or not hasattr(os, "fork"):
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--child", json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
            pass_fds=turns or (),
            start_new_session=True,
        )
        return _Child(proc.pid, out, err, proc=proc)
    pid = os.fork()
    if pid == 0:  # the row's process: its own session (killed as a group on timeout)
        code = 1
        try:
            os.setsid()
            for fd in close:
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            # the streams too: the parent's may be its own objects (a test's capture)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - until os._exit
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            child_main(task, spec)
            code = 0
        except BaseException:  # noqa: BLE001 - reported through stderr and the exit code
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return _Child(pid, out, err)


def _kill(child: _Child) -> None:
    try:
        os.killpg(child.pid, 9)
    except ProcessLookupError:
        pass
    child.timed_out = True


def _alive(child: _Child) -> bool:
    """Whether the child has not exited (reaps it if it has; keeps the status for _finish)."""
    if child.proc is not None:
        return child.proc.poll() is None
    if child.status is not None:
        return False
    done, status = os.waitpid(child.pid, os.WNOHANG)
    if done:
        child.status = status
    return not done


def _finish(child: _Child, timeout: float) -> tuple[int, str, str, int]:
    """Wait for the child to exit (killing it past ``timeout``): (exit code, stdout,
    stderr, peak RSS of its tree)."""
    deadline = time.monotonic() + timeout
    while _alive(child):
        if time.monotonic() > deadline:
            _kill(child)
        time.sleep(0.05)
    if child.proc is not None:
        code = child.proc.returncode
    else:
        code = os.waitstatus_to_exitcode(child.status)
    texts = []
    for f in (child.out, child.err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    if child.timed_out:
        texts[1] += f"\nrow timed out after {timeout} s"
    for fd in (child.go, child.done):
        if fd is not None:
            os.close(fd)
    return code, texts[0], texts[1], child.peak_rss


def run_child(task, spec: dict, timeout: float, module: str) -> tuple[int, str, str, int]:
    """Run ``task(spec)`` in its own process: (exit code, stdout, stderr, peak RSS of its
    tree)."""
    child = _start(task, spec, module, None, [])
    with PeakRSS(child.pid) as rss:
        code, stdout, stderr, _ = _finish(child, timeout)
    return code, stdout, stderr, rss.peak


def _answer(child: _Child, timeout: float) -> bool:
    """Wait for the child's answer: True when it waits for another turn, False when it
    exited (its last pass done, or failed) or ran past ``timeout`` (then killed)."""
    ready, _, _ = select.select([child.done], [], [], timeout)
    if not ready:
        _kill(child)
        return False
    return os.read(child.done, 1) == b"."


def _turn(child: _Child, timeout: float) -> bool:
    """Let the child run its next pass; whether it waits for another."""
    try:
        os.write(child.go, b"g")
    except BrokenPipeError:  # it exited
        return False
    with PeakRSS(child.pid) as rss:
        more = _answer(child, timeout)
    child.peak_rss = max(child.peak_rss, rss.peak)
    return more


def run_in_turns(
    task, specs: dict[str, dict], timeout: float, module: str, log=None
) -> dict[str, tuple[int, str, str, int]]:
    """Run ``task(spec)`` for every row at once, each in its own process, taking turns at
    each :func:`wait_turn`; per row (exit code, stdout, stderr, peak RSS of its tree, over
    its turns). ``timeout``: the seconds a row may take to set up, or for one turn.
    ``log(message)``: told when each round ends."""
    pipes = {row: (os.pipe(), os.pipe()) for row in specs}  # (turns r, w), (answers r, w)
    everything = [fd for pair in pipes.values() for p in pair for fd in p]
    children = {}
    for row, spec in specs.items():
        (go_r, go_w), (done_r, done_w) = pipes[row]
        mine = (go_r, done_w)
        others = [fd for fd in everything if fd not in mine]
        children[row] = _start(task, spec, module, mine, others)
    for row, child in children.items():  # this side keeps the other ends
        (go_r, go_w), (done_r, done_w) = pipes[row]
        os.close(go_r)
        os.close(done_w)
        child.go, child.done = go_w, done_r
    live = [row for row, child in children.items() if _answer(child, timeout)]  # set up
    start = 0
    while live:
        order = live[start % len(live) :] + live[: start % len(live)]
        ended = {row for row in order if not _turn(children[row], timeout)}
        live = [row for row in live if row not in ended]
        start += 1
        if log and live:
            log(f"  round {start} done ({len(live)} rows go on)")
    return {row: _finish(child, timeout) for row, child in children.items()}
