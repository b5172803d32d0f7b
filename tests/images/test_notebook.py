"""The Jupyter image's first start and its getting-started notebook, in real containers.

- /data empty: the notebook is copied into the workspace, the demo dataset is made there in
  the background (the server is healthy without waiting for it), and the server's
  environment points GPUFEED_DATA_DIR at it; a second start on the same workspace keeps the
  user's notebook and does not remake the data.
- /data mounted: no demo data, GPUFEED_DATA_DIR stays /data.
- The shipped notebook executes headless (nbconvert --execute) without an error, and its
  outputs show each step: the doctor's verdict, the loading comparison, the watch summary.
"""

from __future__ import annotations

import json
import time

PORT = "8888/tcp"
DEMO = "/workspace/demo-data"


def server_env(running) -> dict[str, str]:
    code, out = running.exec("sh", "-c", "tr '\\0' '\\n' </proc/$(pgrep -f -o jupyter-lab)/environ")
    assert code == 0, out
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for_demo(running, timeout: float = 60) -> int:
    """JPEG count of the demo data once it is complete (renamed from .partial)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, out = running.exec(
            "sh", "-c", f"test -f {DEMO}/synth.json && find {DEMO} -name '*.jpg' | wc -l"
        )
        if code == 0:
            return int(out.strip())
        time.sleep(0.5)
    raise AssertionError(f"no complete {DEMO} after {timeout} s:\n{running.logs()}")


def test_first_start_makes_demo_data_and_keeps_user_files(run_container, jupyter_image, volume):
    mounts = {volume: {"bind": "/workspace", "mode": "rw"}}
    first = run_container(jupyter_image, ports=(PORT,), volumes=mounts)
    first.wait_healthy()
    assert server_env(first)["GPUFEED_DATA_DIR"] == DEMO
    count = wait_for_demo(first)
    code, out = first.exec(
        "python", "-c", f"import json; print(json.load(open('{DEMO}/synth.json'))['count'])"
    )
    assert code == 0 and int(out) == count >= 1000, out
    assert "making a demo dataset" in first.logs()
    code, out = first.exec("sh", "-c", "ls /workspace; test ! -e /workspace/demo-data.partial")
    assert code == 0 and "getting-started.ipynb" in out, out
    code, out = first.exec("sh", "-c", "echo '# mine' >>/workspace/getting-started.ipynb")
    assert code == 0, out
    first.container.remove(force=True)

    second = run_container(jupyter_image, ports=(PORT,), volumes=mounts)
    second.wait_healthy()
    code, out = second.exec("tail", "-c", "7", "/workspace/getting-started.ipynb")
    assert out == "# mine\n", "the user's notebook was replaced"
    assert "making a demo dataset" not in second.logs()
    assert server_env(second)["GPUFEED_DATA_DIR"] == DEMO
    assert wait_for_demo(second, timeout=5) == count


def test_mounted_data_is_used_as_is(run_container, jupyter_image, tmp_path):
    data = tmp_path / "data"
    (data / "cats").mkdir(parents=True)
    (data / "cats" / "a.jpg").write_bytes(b"not really")
    tmp_path.chmod(0o755)
    data.chmod(0o755)
    running = run_container(
        jupyter_image, ports=(PORT,), volumes={str(data): {"bind": "/data", "mode": "ro"}}
    )
    running.wait_healthy()
    assert server_env(running)["GPUFEED_DATA_DIR"] == "/data"
    code, _ = running.exec("test", "-e", DEMO)
    assert code != 0, "demo data was made although /data has files"


def test_getting_started_notebook_executes(run_container, jupyter_image):
    running = run_container(jupyter_image, ports=(PORT,), shm_size="1g")
    running.wait_healthy()
    start = time.monotonic()
    code, out = running.exec(
        "sh",
        "-c",
        "cd /workspace && jupyter nbconvert --to notebook --execute getting-started.ipynb "
        "--output /tmp/executed.ipynb --ExecutePreprocessor.timeout=600 2>&1",
    )
    seconds = time.monotonic() - start
    assert code == 0, f"the notebook failed ({seconds:.0f} s):\n{out[-6000:]}"
    code, text = running.exec("cat", "/tmp/executed.ipynb")
    assert code == 0
    nb = json.loads(text)
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    stdout = "".join("".join(o.get("text", "")) for o in outputs if o.get("name") == "stdout")
    for expected in (
        "[ OK ] torch 2.9.1",  # the doctor's report
        "exit 0",
        "source: /workspace/demo-data",
        "packed / per-file:",  # the loading comparison
        "gpufeed.watch: 60 steps",  # the watched training
        "verdict:",
    ):
        assert expected in stdout, f"{expected!r} not in the notebook's output:\n{stdout}"
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "expected the sample grid, the comparison chart, the step plot"
    code, _ = running.exec("test", "-s", "/workspace/gpufeed-demo/steps.png")
    assert code == 0
    print(f"notebook executed in {seconds:.0f} s")
