"""The mmap format's ``.pt`` container: one tensor saved by ``torch.save``, mapped back with
``torch.load(mmap=True)``.

The one module of ``gpufeed.formats`` that imports torch (when such a pack is written or
opened, never on import): the file is torch's own, and only torch reads it back as a map.
Everything else in the formats layer hands numpy arrays to ``gpufeed.data``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpufeed.errors import DataError

__all__ = ["map_pt", "save_npy_as_pt"]


def save_npy_as_pt(npy: Path, pt: Path) -> None:
    """Write the array in the .npy file `npy` as one tensor in the .pt file `pt`."""
    import torch

    arr = np.load(npy, mmap_mode="r+")
    torch.save(torch.from_numpy(arr), pt)
    del arr


def map_pt(path: Path) -> np.ndarray:
    """The tensor in `path`, memory-mapped (nothing read yet), as a numpy array over the map.
    weights_only: torch's restricted unpickler, so no code in the file is ever run; anything
    but one plain tensor is an error naming the file."""
    import torch

    try:
        t = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"holds a {type(t).__name__}, not one tensor")
        return t.numpy()
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a crafted file
        raise DataError(
            f"{path}: not a readable tensor file ({type(e).__name__}: {e}); check it with "
            "gpufeed verify, or re-pack it"
        ) from None
