"""Docker HEALTHCHECK for the Jupyter image: ask the running server itself.

As jupyter/docker-stacks does: the server's runtime file (jpserver-*.json) gives its URL, and
GET <url>api answers without a token when the server is up.
"""

import json
import sys
import urllib.request
from pathlib import Path

from jupyter_core.paths import jupyter_runtime_dir

runtime_files = sorted(Path(jupyter_runtime_dir()).glob("jpserver-*.json"))
if not runtime_files:
    sys.exit(f"no jpserver-*.json in {jupyter_runtime_dir()}: the server has not started")
for runtime_file in runtime_files:
    url = json.loads(runtime_file.read_text())["url"]
    url = url.replace("0.0.0.0", "127.0.0.1")
    with urllib.request.urlopen(f"{url.rstrip('/')}/api", timeout=4) as response:
        version = json.load(response)["version"]
    print(f"jupyter_server {version} answers at {url}")
    break
