"""The native JPEG extension (gpufeed-jpeg, app/native): one import, one reason when absent.

Lowest layer, so that both the pack check (write) and the decoders (data) use it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["install_hint", "jpeg_module"]

# gpufeed-jpeg is not on PyPI: it builds from app/native beside app/src in gpufeed's source tree
_SOURCE_TREE_NATIVE = Path(__file__).resolve().parents[3] / "native"


def install_hint(native_dir: str | os.PathLike = _SOURCE_TREE_NATIVE) -> str:
    """How to install gpufeed-jpeg from here: the absolute path of app/native when gpufeed
    runs from its source tree (an editable install, a checkout), else where to find it."""
    native = Path(native_dir)
    if (native / "pyproject.toml").is_file():
        return f"pip install {native} (needs a C++17 compiler and libjpeg-dev)"
    return (
        "pip install ./app/native from a checkout of gpufeed's source repository (needs a "
        "C++17 compiler and libjpeg-dev); the gpufeed images carry it"
    )


@functools.lru_cache(maxsize=1)
def jpeg_module():
    """(gpufeed_jpeg, None), or (None, why it is not there)."""
    try:
        import gpufeed_jpeg
    except ImportError as exc:
        return None, f"gpufeed-jpeg is not installed ({exc}): {install_hint()}"
    return gpufeed_jpeg, None
