"""The Jupyter image: token always required, a real kernel runs the shipped stack, tini is PID 1."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import requests
import websocket

PORT = "8888/tcp"
STACK_CODE = (
    "import torch, torchvision, torchaudio, h5py, lmdb, gpufeed\n"
    "print('versions', torch.__version__, torchvision.__version__, torchaudio.__version__,"
    " h5py.__version__, lmdb.__version__, gpufeed.__version__, torch.version.cuda)"
)


def start_jupyter(run_container, image, environment):
    running = run_container(
        image, ports=(PORT,), environment={"GPUFEED_ALLOW_CPU": "1", **environment}
    )
    running.wait_healthy()
    return running, f"http://127.0.0.1:{running.host_port(PORT)}"


def execute(base_url: str, token: str, code: str, timeout: float = 120) -> str:
    """Start a kernel through the REST API, run code over its websocket, return its stdout."""
    headers = {"Authorization": f"token {token}"}
    kernel = requests.post(
        f"{base_url}/api/kernels", headers=headers, json={"name": "python3"}, timeout=30
    )
    kernel.raise_for_status()
    kernel_id = kernel.json()["id"]
    ws_url = base_url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
    connection = websocket.create_connection(
        ws_url, header=[f"Authorization: token {token}"], timeout=timeout
    )
    msg_id = uuid.uuid4().hex
    connection.send(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": "test",
                    "session": uuid.uuid4().hex,
                    "version": "5.3",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "buffers": [],
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": False,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
            }
        )
    )
    output, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            message = json.loads(connection.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["header"]["msg_type"]
            if kind == "stream":
                output.append(message["content"]["text"])
            elif kind == "error":
                raise AssertionError("kernel error: " + "\n".join(message["content"]["traceback"]))
            elif kind == "execute_reply":
                assert message["content"]["status"] == "ok", message["content"]
                return "".join(output)
        raise AssertionError(f"no execute_reply within {timeout} s; output so far: {output}")
    finally:
        connection.close()
        requests.delete(f"{base_url}/api/kernels/{kernel_id}", headers=headers, timeout=30)


def test_token_is_required(run_container, jupyter_image, token):
    _, url = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    assert requests.get(f"{url}/api/kernels", timeout=10).status_code == 403
    wrong = requests.get(f"{url}/api/kernels", headers={"Authorization": "token nope"}, timeout=10)
    assert wrong.status_code == 403
    right = requests.get(
        f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10
    )
    assert right.status_code == 200
    lab = requests.get(f"{url}/lab", timeout=10, allow_redirects=False)
    assert lab.status_code == 302 and "/login" in lab.headers["Location"]


def test_empty_token_gets_a_random_one(run_container, jupyter_image):
    running, url = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": ""})
    assert requests.get(f"{url}/api/kernels", timeout=10).status_code == 403
    printed = re.findall(r"\?token=([0-9a-f]{32,})", running.logs())
    assert printed, running.logs()
    ok = requests.get(
        f"{url}/api/kernels", headers={"Authorization": f"token {printed[-1]}"}, timeout=10
    )
    assert ok.status_code == 200


def test_token_file(run_container, jupyter_image, token, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o644)
    running = run_container(
        jupyter_image,
        ports=(PORT,),
        environment={"GPUFEED_ALLOW_CPU": "1", "JUPYTER_TOKEN_FILE": "/run/secrets/jupyter_token"},
        volumes={str(token_file): {"bind": "/run/secrets/jupyter_token", "mode": "ro"}},
    )
    running.wait_healthy()
    url = f"http://127.0.0.1:{running.host_port(PORT)}"
    assert requests.get(f"{url}/api/kernels", timeout=10).status_code == 403
    ok = requests.get(f"{url}/api/kernels", headers={"Authorization": f"token {token}"}, timeout=10)
    assert ok.status_code == 200


def test_kernel_imports_the_stack(run_container, jupyter_image, token):
    _, url = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    line = execute(url, token, STACK_CODE).strip().splitlines()[-1]
    fields = line.split()
    assert fields[0] == "versions", line
    torch_version, torchvision_version, torchaudio_version = fields[1:4]
    assert torch_version.startswith("2.9.1"), line
    assert torchvision_version.startswith("0.24.1"), line
    assert torchaudio_version.startswith("2.9.1"), line
    assert fields[7] not in ("None", ""), f"torch is not a CUDA build: {line}"


def test_pid1_is_tini_and_the_server_is_not_root(run_container, jupyter_image, token):
    running, _ = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    code, comm = running.exec("cat", "/proc/1/comm")
    assert code == 0 and comm.strip() == "tini"
    code, processes = running.exec("ps", "-o", "user=,uid=,args=", "-C", "jupyter-lab")
    server_lines = [line for line in processes.splitlines() if "jupyter" in line]
    assert server_lines, processes
    for line in server_lines:
        user, uid = line.split()[:2]
        assert uid != "0", line
    code, workdir = running.exec("sh", "-c", "pwd; test -w /workspace && echo writable")
    assert workdir.split() == ["/workspace", "writable"]


@pytest.mark.timeout(60)
def test_docker_stop_is_prompt_and_clean(run_container, jupyter_image, token):
    running, _ = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    running.container.stop(timeout=20)
    running.container.reload()
    # 137 would mean SIGKILL after the grace period: the signal never reached the server.
    assert running.container.attrs["State"]["ExitCode"] != 137, running.logs()


def test_image_metadata(docker_client, jupyter_image, ssh_image):
    for name in (jupyter_image, ssh_image):
        config = docker_client.images.get(name).attrs["Config"]
        env = dict(item.split("=", 1) for item in config["Env"])
        # Every driver >= 525 must start; the preflight gives the verdict (not the toolkit).
        assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=12.0", env["NVIDIA_REQUIRE_CUDA"]
        # the thresholds come from the CUDA 12 file the image installs, never its environment
        assert env["GPUFEED_THRESHOLDS"] == "/etc/gpufeed/thresholds.env"
        assert not [k for k in env if k.startswith("GPUFEED_") and "DRIVER" in k], env
        assert "JUPYTER_TOKEN" not in env
        labels = config["Labels"]
        for key in ("title", "version", "revision", "source", "created"):
            assert labels.get(f"org.opencontainers.image.{key}") not in (None, "", "unknown"), key
        assert labels["io.gpufeed.torch.version"] == "2.9.1"
        assert labels["io.gpufeed.cuda.version"] == "12.8"
        assert labels["io.gpufeed.thresholds"] == "thresholds-cuda12.env"
        assert config["User"] not in ("", "root", "0")
        assert config["Entrypoint"][:3] == ["tini", "-g", "--"]


def wait_for_json(url: str, headers: dict, ready, timeout: float = 90):
    """GET url until ready(json) holds; the first request starts TensorBoard (a few seconds)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        response = requests.get(url, headers=headers, timeout=30)
        last = (response.status_code, response.text[:300])
        if response.ok and ready(response.json()):
            return response.json()
        time.sleep(1)
    raise AssertionError(f"{url} not ready after {timeout} s: {last}")


def test_tensorboard_through_jupyter_behind_the_token(run_container, jupyter_image, token):
    running, url = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    # Without the token: sent to the login page, and TensorBoard is not even started.
    for path in ("/tensorboard/", "/tensorboard/data/runs"):
        refused = requests.get(url + path, timeout=10, allow_redirects=False)
        assert refused.status_code == 302 and "/login" in refused.headers["Location"], path
        wrong = requests.get(
            url + path, headers={"Authorization": "token nope"}, timeout=10, allow_redirects=False
        )
        assert wrong.status_code in (302, 403), path
    assert running.exec("pgrep", "-f", "bin/tensorboard")[0] != 0, "started without the token"

    # A notebook's SummaryWriter() writes under runs/ of its working directory (/workspace).
    execute(
        url,
        token,
        "from torch.utils.tensorboard import SummaryWriter\n"
        "w = SummaryWriter(comment='-probe')\n"
        "for step in range(3): w.add_scalar('loss', 1.0 / (step + 1), step)\n"
        "w.close(); print(w.log_dir)\n",
    )
    headers = {"Authorization": f"token {token}"}
    page = requests.get(f"{url}/tensorboard/", headers=headers, timeout=90)
    assert page.ok and "tb-relative-root" in page.text, page.text[:300]
    (run,) = wait_for_json(f"{url}/tensorboard/data/runs", headers, lambda runs: len(runs) == 1)
    assert run.endswith("-probe"), run
    scalars = requests.get(
        f"{url}/tensorboard/data/plugin/scalars/scalars",
        params={"run": run, "tag": "loss"},
        headers=headers,
        timeout=30,
    ).json()
    assert [round(value, 3) for _, _, value in scalars] == [1.0, 0.5, 0.333]
    # Inside the container it listens on the loopback only: the proxy is the one way in.
    code, args = running.exec("pgrep", "-a", "-f", "bin/tensorboard")
    assert code == 0 and "--host 127.0.0.1" in args and "--logdir /workspace/runs" in args, args


def test_jupyterlab_does_not_fetch_news(run_container, jupyter_image, token):
    # JupyterLab's first-open question "get notified about official Jupyter news?" is answered
    # "never" by the image's overrides.json; asked through the running server's settings API.
    _, url = start_jupyter(run_container, jupyter_image, {"JUPYTER_TOKEN": token})
    response = requests.get(
        f"{url}/lab/api/settings/@jupyterlab/apputils-extension:notification",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    response.raise_for_status()
    setting = response.json()
    properties = setting["schema"]["properties"]
    effective = {
        key: setting["settings"].get(key, properties[key]["default"]) for key in properties
    }
    assert effective["fetchNews"] == "false", effective
    assert effective["checkForUpdates"] is False, effective
