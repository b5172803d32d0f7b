"""Jupyter server settings of the Jupyter image (/etc/jupyter/jupyter_server_config.py).

TensorBoard is started on first visit to /tensorboard/ by jupyter-server-proxy, bound to
127.0.0.1 inside the container and reached only through the Jupyter server, so it is behind the
same token and no port is published for it. It reads TENSORBOARD_LOGDIR, by default
/workspace/runs: where torch.utils.tensorboard.SummaryWriter() writes from a notebook, whose
working directory is /workspace.
"""

import os

c = get_config()  # noqa: F821 (defined by Jupyter when it loads this file)

c.ServerProxy.servers = {
    "tensorboard": {
        "command": [
            "tensorboard",
            "--logdir",
            os.environ.get("TENSORBOARD_LOGDIR") or "/workspace/runs",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            # TensorBoard's own links carry the prefix, so the proxy passes paths unchanged
            "--path_prefix",
            "{base_url}tensorboard",
        ],
        "absolute_url": True,
        # TensorBoard takes a few seconds to import and to read the first event files.
        "timeout": 120,
        "launcher_entry": {"title": "TensorBoard"},
    }
}
