"""No secret in any layer of the shipped images: no SSH host key, no private key, no Jupyter
token or runtime file. Every layer is read, not just the final filesystem, since a file deleted
in a later layer still ships in the earlier one."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SMALL = 16 * 1024  # keys (RSA 4096: 3.3 kB) and tokens are small; larger files are not read
# Code and assets of the venv (tens of thousands of files) are not where a key lands by mistake;
# skipping their contents keeps the scan to about a minute. Their names are still checked.
CODE_SUFFIXES = (
    ".py",
    ".pyc",
    ".pyi",
    ".so",
    ".h",
    ".hpp",
    ".cuh",
    ".js",
    ".mjs",
    ".map",
    ".css",
    ".svg",
    ".png",
    ".woff",
    ".woff2",
    ".ttf",
    ".mo",
    ".typed",
)
# Test fixtures that third-party packages ship (tornado's test.key, say) are not our secrets.
FIXTURE_PATTERNS = ("*/site-packages/*/test/*", "*/site-packages/*/tests/*")
FORBIDDEN_NAMES = (
    "*ssh_host_*key*",
    "*/jupyter/runtime/jpserver-*",
    "*/jupyter_server_config.json",
)


def finding(path: str, read) -> str | None:
    if any(fnmatch.fnmatch(path, pattern) for pattern in FORBIDDEN_NAMES):
        return f"{path}: must be made at run time, not shipped"
    if any(fnmatch.fnmatch(path, pattern) for pattern in FIXTURE_PATTERNS):
        return None
    if path.endswith(CODE_SUFFIXES) or ".so." in path:
        return None
    data = read()
    if data is not None and b"PRIVATE KEY-----" in data:
        return f"{path}: holds a private key"
    return None


def overlay_layers(docker_client, images) -> list[Path] | None:
    """The layer folders of overlay2 images on this host (much faster than docker save)."""
    layers: list[Path] = []
    for name in images:
        driver = docker_client.images.get(name).attrs["GraphDriver"]
        if driver["Name"] != "overlay2":
            return None
        data = driver["Data"]
        paths = [data["UpperDir"], *data.get("LowerDir", "").split(":")]
        for path in filter(None, paths):
            if not os.access(path, os.R_OK):
                return None
            if Path(path) not in layers:
                layers.append(Path(path))
    return layers


def scan_folder(layer: Path) -> Iterator[str]:
    for root, _, files in os.walk(layer):
        for file in files:
            full = Path(root, file)
            if not full.is_file() or full.is_symlink():
                continue  # whiteouts are character devices; links hold no data here

            def read(full=full):
                return full.read_bytes() if full.stat().st_size <= SMALL else None

            problem = finding("/" + str(full.relative_to(layer)), read)
            if problem:
                yield f"{layer.name[:12]}: {problem}"


def scan_saved(images) -> Iterator[str]:
    """Portable fallback: stream `docker save` and read every layer tar in it."""
    proc = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
        for member in outer:
            if not member.isfile() or member.size < 1024:
                continue
            try:
                inner = tarfile.open(fileobj=outer.extractfile(member), mode="r|*")
            except tarfile.ReadError:
                continue  # a JSON config blob, not a layer
            for item in inner:
                if not item.isfile():
                    continue

                def read(item=item, inner=inner):
                    return inner.extractfile(item).read() if item.size <= SMALL else None

                problem = finding("/" + item.name, read)
                if problem:
                    yield f"{member.name[:20]}: {problem}"
    assert proc.wait() == 0


@pytest.mark.timeout(900)
def test_no_secrets_in_any_layer(docker_client, jupyter_image, ssh_image):
    images = (jupyter_image, ssh_image)
    layers = overlay_layers(docker_client, images)
    if layers is None:
        problems = list(scan_saved(images))
    else:
        assert len(layers) >= 5, layers
        problems = [problem for layer in layers for problem in scan_folder(layer)]
    assert problems == []


def test_the_scanner_finds_what_it_looks_for(tmp_path):
    """The scan above passes only if it can fail: plant each kind of secret and look."""
    layer = tmp_path / "layer"
    (layer / "etc/ssh").mkdir(parents=True)
    (layer / "etc/ssh/ssh_host_ed25519_key").write_text("x")
    (layer / "home/trainer/.local/share/jupyter/runtime").mkdir(parents=True)
    (layer / "home/trainer/.local/share/jupyter/runtime/jpserver-7.json").write_text("{}")
    (layer / "root").mkdir()
    (layer / "root/id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    fixture = layer / "opt/venv/lib/python3.12/site-packages/tornado/test"
    fixture.mkdir(parents=True)
    (fixture / "test.key").write_text("-----BEGIN PRIVATE KEY-----\n")
    found = sorted(problem.split(": ", 1)[1] for problem in scan_folder(layer))
    assert found == [
        "/etc/ssh/ssh_host_ed25519_key: must be made at run time, not shipped",
        "/home/trainer/.local/share/jupyter/runtime/jpserver-7.json: must be made at run time,"
        " not shipped",
        "/root/id_rsa: holds a private key",
    ]
