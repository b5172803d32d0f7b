"""Data safety under faults: a full disk (small tmpfs mounts; CI runs as root) is one error
line naming the file in every format and stage, never a bus error or a traceback; kill -9 of
a pack leaves no worker process behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import numpy as np
import pytest
from faults import alive, descendants, gpufeed_cmd, run_gpufeed, small_disk, wait_for
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.write.assemble import STREAMED_FORMATS

# 48 arrays of 32 KiB: about 1.5 MiB of samples
SAMPLES, SAMPLE_BYTES = 48, 32 << 10


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("full-disk-src")
    rng = np.random.default_rng(3)
    for c in ("a", "b"):
        (root / c).mkdir()
        for i in range(SAMPLES // 2):
            np.save(root / c / f"{i:03d}.npy", rng.integers(0, 256, SAMPLE_BYTES, np.uint8))
    return root


def assert_one_line_disk_full(r, name: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])  # -7 (135 in a shell): SIGBUS
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]  # no traceback, no "Exception ignored" noise
    assert "no space left on device" in lines[0] and f"{name}: " in lines[0], lines[0]
    assert "--resume" in lines[0]


@pytest.mark.parametrize(
    "fmt, name",
    [
        ("hdf5", "data.h5"),
        ("lmdb", "data.mdb"),
        ("tar", "shard-000000.tar"),
        ("mmap", "samples.npy"),
    ],
)
def test_a_full_disk_while_writing_the_format_names_the_file(source, tmp_path, fmt, name):
    if fmt in STREAMED_FORMATS:
        # samples written once, as each part is committed: 6 parts of 256 KiB, 4 fit
        size, args = "1200k", ["--part-size", "8"]
    else:
        size, args = "2200k", []  # the parts (1.5 MiB) fit, the format's copy of them does not
    with small_disk(tmp_path / "disk", size) as disk:
        r = run_gpufeed("pack", source, disk / "d", "-f", fmt, "-j", "1", *args)
        assert_one_line_disk_full(r, name)
        assert not (disk / "d").exists()
        assert list((disk / "d.partial" / "parts").glob("*.npz"))  # kept for --resume


def test_a_full_disk_while_staging_parts_names_the_part(source, tmp_path):
    # compressed hdf5: its parts hold the samples (a streamed pack's hold their places)
    with small_disk(tmp_path / "disk", "600k") as disk:
        args = ["-f", "hdf5", "--compression", "lzf", "-j", "1", "--part-size", "8"]
        r = run_gpufeed("pack", source, disk / "d", *args)
        assert_one_line_disk_full(r, "npz.tmp")


@pytest.mark.parametrize("fmt", ["lmdb", "tar"])
def test_a_full_disk_then_resume_on_a_bigger_one_is_complete(source, tmp_path, fmt):
    args = ["-f", fmt, "-j", "1", "--part-size", "8"]
    with small_disk(tmp_path / "disk", "1200k") as disk:
        r = run_gpufeed("pack", source, disk / "d", *args)
        assert r.returncode == 1
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        r = run_gpufeed("pack", source, disk / "d", *args, "--resume")
        assert r.returncode == 0, r.stderr
        assert gpufeed.verify(disk / "d").ok


# ------------------------------------------------------------------------ kill -9
def drained(stream) -> bool:
    """Read what is there; True at end of file (every writer has closed the pipe)."""
    while True:
        try:
            chunk = stream.read(65536)
        except BlockingIOError:
            return False
        if chunk is None:
            return False
        if chunk == b"":
            return True


@pytest.mark.timeout(120)
def test_kill_9_of_a_pack_leaves_no_worker_behind(source, tmp_path):
    env = {**PYTHON_ENV, "GPUFEED_TEST_SLOW_MS": "200"}
    cmd = gpufeed_cmd("pack", source, tmp_path / "d", "-f", "tar", "-j", "2", "--part-size", "4")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the 2 workers (forked; spawned ones come with multiprocessing's resource tracker)
        workers = wait_for(lambda: len(descendants(proc.pid)) >= 2 and descendants(proc.pid), 60)
        assert workers and len(workers) >= 2, "expected 2 workers"
        time.sleep(0.5)  # the workers are past their start-up
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_for(lambda: not alive(workers), 10)
        assert left, f"still running 10 s after kill -9: {sorted(alive(workers))}"
        # nothing holds the caller's stdout any more: reading it ends
        assert wait_for(lambda: select.select([proc.stdout], [], [], 0)[0], 10)
        os.set_blocking(proc.stdout.fileno(), False)
        assert wait_for(lambda: drained(proc.stdout), 10), "stdout still held open"
    finally:
        for pid in alive(workers if "workers" in locals() and workers else {}):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.stdout.close()
