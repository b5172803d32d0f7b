"""Where doctor runs: in a container (Docker, Podman, Kubernetes, LXC) or on a host. The fix
for the same finding differs: ``docker run --gpus all`` means nothing on a laptop, and a
CPU-only host is an ordinary machine, not a container started without its GPU.

The markers are read under ``root`` (``/`` unless a test points it at a folder of its own):
``/.dockerenv`` (Docker), ``/run/.containerenv`` (Podman), a container runtime's name in
``/proc/self/cgroup`` (cgroup v1, and v2 without a cgroup namespace), and the ``container``
variable (systemd's convention, set by Podman, LXC, systemd-nspawn) or Kubernetes' own.
``GPUFEED_IN_CONTAINER=1`` or ``0`` overrides them all, where they are wrong.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Place", "detect_place"]

_FILES = ((".dockerenv", "Docker"), ("run/.containerenv", "Podman"))
_CGROUP_WORDS = ("docker", "kubepods", "containerd", "libpod", "lxc", "crio")


@dataclass(frozen=True)
class Place:
    container: bool
    evidence: str  # what showed it, or that nothing did

    @property
    def where(self) -> str:
        return "in this container" if self.container else "on this host"

    def fix(self, container: str, host: str) -> str:
        """The fix that applies here."""
        return container if self.container else host


def _cgroup_word(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    return next((w for w in _CGROUP_WORDS if w in text), None)


def detect_place(root: str | os.PathLike = "/", env: Mapping[str, str] | None = None) -> Place:
    """A container when any marker says so (``root``: the file system's root to look in)."""
    env = os.environ if env is None else env
    told = (env.get("GPUFEED_IN_CONTAINER") or "").strip().lower()
    if told in ("1", "true", "yes", "0", "false", "no"):
        return Place(told in ("1", "true", "yes"), f"GPUFEED_IN_CONTAINER={told}")
    base = Path(root)
    for name, runtime in _FILES:
        if (base / name).exists():
            return Place(True, f"/{name} exists ({runtime})")
    word = _cgroup_word(base / "proc" / "self" / "cgroup")
    if word:
        return Place(True, f"/proc/self/cgroup names {word}")
    if env.get("container"):
        return Place(True, f"container={env['container']} is set")
    if env.get("KUBERNETES_SERVICE_HOST"):
        return Place(True, "KUBERNETES_SERVICE_HOST is set (a Kubernetes pod)")
    return Place(False, "no container marker (/.dockerenv, /run/.containerenv, cgroup)")
