"""The native JPEG extension (gpufeed-jpeg, app/native): one import, one reason when absent.

Lowest layer, so that both the pack check (write) and the decoders (data) use it."""

from __future__ import annotations

import functools

__all__ = ["jpeg_module"]


@functools.lru_cache(maxsize=1)
def jpeg_module():
    """(gpufeed_jpeg, None), or (None, why it is not there)."""
    try:
        import gpufeed_jpeg
    except ImportError as exc:
        return None, f"gpufeed-jpeg is not installed ({exc}): pip install ./app/native"
    return gpufeed_jpeg, None
