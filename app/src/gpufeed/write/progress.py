"""Progress bars (tqdm on stderr) for long writes and checks: shown only on a terminal and
when not quiet."""

from __future__ import annotations

import sys

__all__ = ["progress_bar"]


def progress_bar(total: int, initial: int, quiet: bool, desc: str, unit: str = "sample"):
    from tqdm import tqdm

    disable = quiet or not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        unit_scale=True,
        file=sys.stderr,
        disable=disable,
        dynamic_ncols=True,
        smoothing=0.1,
    )
