"""gpufeed.loading.make: what make_loader refuses before it measures anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufeed.errors import UsageError
from gpufeed.loading.make import make_loader


@pytest.mark.parametrize(
    "path", ["/path/to/pack", b"/path/to/pack", Path("/path/to/pack"), bytearray(b"/p")]
)
def test_a_path_is_not_iterated_as_samples(path):
    """make_loader("/path/to/pack") read each character as a sample; now it says to open the
    dataset first, naming the path."""
    with pytest.raises(UsageError, match=r"not a dataset; open it first.*gpufeed\.open_dataset"):
        make_loader(path, batch_size=2, num_workers=0)
    if not isinstance(path, bytearray):
        with pytest.raises(UsageError, match="/path/to/pack"):
            make_loader(path, 2)
