"""Running a probe that could block (nvidia-smi, NVML, CUDA initialisation, a hung network
mount) with a deadline: doctor always finishes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["bounded"]


def bounded(fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (True, result) or (False, exception / "timeout")."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported, never raised: doctor must finish
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True, name="gpufeed-doctor-probe")
    t.start()
    t.join(seconds)
    if t.is_alive():
        return False, "timeout"
    if "error" in box:
        return False, box["error"]
    return True, box.get("value")
