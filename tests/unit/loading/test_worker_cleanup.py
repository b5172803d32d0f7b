"""A training process killed by SIGTERM, SIGINT or SIGKILL leaves nothing behind: its
DataLoader workers (plain DataLoader and make_loader's persistent ones) exit, and /dev/shm
keeps no segment of the run (torch's file_system sharing puts them there as files, where a
leak shows). Each case runs a real child python over a real pack; issue 37, "what held"."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHM = Path("/dev/shm")
# DataLoader workers check their parent every 5 s (MP_STATUS_CHECK_INTERVAL); generous on top
CLEANUP_DEADLINE_S = 20.0
START_DEADLINE_S = 60.0

CHILD = """
import json, os, sys, time
import torch
import gpufeed

pack, kind, strategy = sys.argv[1:4]
if strategy != "default":
    torch.multiprocessing.set_sharing_strategy(strategy)
ds = gpufeed.open_dataset(pack)
if kind == "dataloader":
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, pin_memory=False)
else:
    dl = gpufeed.make_loader(ds, batch_size=4, num_workers=2)
    assert dl.plan.persistent_workers, dl.plan
reported = False
while True:  # an epoch of 12 steps: the parent signals during the first one
    batches = iter(dl)
    for batch in batches:
        if not reported:  # the workers run now: DataLoader's iterator holds them
            it = batches if kind == "dataloader" else dl.dataloader._iterator
            workers = [w.pid for w in it._workers]
            print(json.dumps({"pid": os.getpid(), "workers": workers}), flush=True)
            reported = True
        time.sleep(0.2)
"""


@pytest.fixture(scope="module")
def pack_dir(pack_factory) -> Path:
    return pack_factory("lmdb", classes={"x": 24, "y": 24}, shape=(3, 16, 16))


Proc = tuple[int, int]  # (pid, start time): a pid reused by another process is not ours


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, None when it no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[19])


def identify(pid: int) -> Proc | None:
    stat = proc_stat(pid)
    return None if stat is None else (pid, stat[1])


def alive(proc: Proc) -> bool:
    """Running or stopped; a zombie (exited, waiting for whoever adopted it) counts as gone."""
    stat = proc_stat(proc[0])
    return stat is not None and stat[1] == proc[1] and stat[0] not in ("Z", "X")


def descendants(pid: int) -> set[Proc]:
    """Every living process under ``pid`` (workers, torch_shm_manager), by /proc's PPid."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            ppid = next(line for line in status.splitlines() if line.startswith("PPid:"))
            parents[int(entry.name)] = int(ppid.split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    procs = {identify(p) for p in found}
    return {p for p in procs if p is not None and alive(p)}


def shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def shm_used_by(pids: set[int]) -> set[str]:
    """/dev/shm entries that ``pids`` hold open or mapped (and that are not unlinked yet)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        paths = [line.split(maxsplit=5)[5] for line in maps if len(line.split(maxsplit=5)) == 6]
        for path in paths + fds:
            if path.startswith(f"{SHM}/") and not path.endswith("(deleted)"):
                names.add(path[len(str(SHM)) + 1 :])
    return names


def of_run(name: str, pids: set[int]) -> bool:
    """Whether a /dev/shm name carries one of the run's pids (torch_<pid>_..., pym-<pid>-...)."""
    tokens = name.replace("-", "_").replace(".", "_").split("_")
    return any(str(pid) in tokens for pid in pids)


def first_line(child: subprocess.Popen, log: Path) -> dict:
    """The child's report, printed once its first batch arrived."""
    ready, _, _ = select.select([child.stdout], [], [], START_DEADLINE_S)
    line = child.stdout.readline() if ready else b""
    assert line, f"no first batch in {START_DEADLINE_S}s: {log.read_text()[-3000:]}"
    return json.loads(line)


def run_and_signal(pack: Path, kind: str, strategy: str, sig: int, env: dict, sabotage=None):
    """Start the child, wait for its first batch, send ``sig``, then return what stayed behind
    after the cleanup deadline: (processes of the run still alive, the child included; /dev/shm
    entries of the run left; what the run had put in /dev/shm). ``sabotage(procs)`` runs just
    before the signal."""
    before = shm_entries()
    log = pack.parent / f"child-{kind}-{strategy}-{sig}.log"
    args = [sys.executable, "-c", textwrap.dedent(CHILD), str(pack), kind, strategy]
    with log.open("wb") as err:
        child = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
    procs: set[Proc] = set()
    pids, run_shm = {child.pid}, set()

    def left_shm() -> set[str]:
        return {n for n in shm_entries() - before if n in run_shm or of_run(n, pids)}

    try:
        report = first_line(child, log)
        assert report["pid"] == child.pid and len(report["workers"]) == 2, report
        # the child stays unreaped until clean_up: a zombie once it exits, so "gone"
        found = {identify(pid) for pid in (child.pid, *report["workers"])}
        procs = {p for p in found if p is not None} | descendants(child.pid)
        pids = {pid for pid, _ in procs}  # child, workers, torch_shm_manager
        run_shm = shm_used_by(pids) | {n for n in shm_entries() - before if of_run(n, pids)}
        if sabotage is not None:
            sabotage(procs - {identify(child.pid)})
        os.kill(child.pid, sig)
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while True:
            left = {p for p in procs if alive(p)}, left_shm(), run_shm
            if not (left[0] or left[1]) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)
    finally:
        clean_up(child, procs)
        for name in left_shm():
            (SHM / name).unlink(missing_ok=True)


def clean_up(child: subprocess.Popen, procs: set[Proc]) -> None:
    """A failed run leaves nothing running either."""
    if child.poll() is None:
        procs = procs | descendants(child.pid)
    for proc in procs:
        if alive(proc):
            os.kill(proc[0], signal.SIGKILL)
    child.kill()  # nothing if it was reaped already
    child.wait()
    child.stdout.close()


CASES = [
    ("dataloader", "file_system", signal.SIGTERM),
    ("dataloader", "file_system", signal.SIGINT),
    ("dataloader", "file_system", signal.SIGKILL),
    ("make_loader", "file_system", signal.SIGKILL),
    ("make_loader", "default", signal.SIGTERM),
]


@pytest.mark.parametrize("kind,strategy,sig", CASES, ids=[f"{k}-{s}-{g.name}" for k, s, g in CASES])
def test_a_killed_loader_leaves_no_worker_and_no_shm_segment(
    pack_dir, python_env, kind, strategy, sig
):
    left_alive, left_shm, run_shm = run_and_signal(pack_dir, kind, strategy, sig, python_env)
    assert not left_alive, f"processes alive {CLEANUP_DEADLINE_S}s after {sig.name}: {left_alive}"
    assert not left_shm, f"/dev/shm entries left after {sig.name}: {sorted(left_shm)}"
    if strategy == "file_system":  # the check above saw the run's segments, so it can fail
        assert run_shm, "torch's file_system sharing put nothing in /dev/shm"
