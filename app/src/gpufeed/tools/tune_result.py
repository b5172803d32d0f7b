"""What ``gpufeed tune`` found: each trial, the recommendation and its ratios to the other
contenders measured side by side, the settings file ``make_loader`` reads, and a snippet."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.formats.files import atomic_write_json
from gpufeed.loading.settings import TUNED_BATCH_SIZE_KEY

__all__ = ["Trial", "TuneResult", "snippet", "write_settings"]


@dataclass
class Trial:
    settings: dict[str, Any]
    batch_size: int
    samples_per_s: float
    first_batch_s: float
    stage: str

    def describe(self) -> str:
        s = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"batch_size={self.batch_size}, {s}"


@dataclass
class TuneResult:
    best: Trial
    trials: list[Trial]
    cpus: int
    seconds: float
    comparison: dict[str, float] = field(default_factory=dict)
    comparison_settings: dict[str, str] = field(default_factory=dict)
    # which contender of the side-by-side check ``best`` is: the search's winner ("tuned"),
    # or one that measured faster there (often the defaults: short trials are noisy)
    chosen: str = "tuned"
    searched: Trial | None = None  # the search's winner, when the check chose another
    # the side-by-side check's noise (the spread across its rounds of the two contenders it
    # decided between, relative) and its verdict in words ("within noise: ...")
    noise: float | None = None
    verdict: str = ""
    # the most one trial's start-up and shutdown took beyond what was measured before it:
    # the part of a run past its budget that the budget could not foresee
    overhead_miss_s: float = 0.0
    # the time of what runs whatever the budget (warm-up, make_loader's probe, the first two
    # trials, a side-by-side check squeezed to its shortest): a budget below it is overrun
    minimum_s: float = 0.0

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.best.settings)

    def file_content(self) -> dict[str, Any]:
        """The settings file: make_loader keys, plus ``_batch_size`` (make_loader warns when
        the file is applied at another batch size) and ``measured`` (notes)."""
        return {
            **self.best.settings,
            TUNED_BATCH_SIZE_KEY: self.best.batch_size,
            "_tuned_by": "gpufeed tune",
            "measured": {
                "samples_per_s": round(self.best.samples_per_s, 1),
                "cpus": self.cpus,
                **{f"vs_{k}": round(v, 3) for k, v in self.ratios().items()},
                **({"noise": round(self.noise, 3)} if self._finite_noise() else {}),
                **({"verdict": self.verdict} if self.verdict else {}),
            },
        }

    def _finite_noise(self) -> bool:
        return self.noise is not None and math.isfinite(self.noise)  # JSON has no infinity

    def overrun_note(self, budget_s: float) -> str:
        """Why a run outlasted its budget."""
        return (
            f"ran {self.seconds:.1f} s for a {budget_s:.0f} s budget: the parts that always run "
            f"(warm-up, make_loader's probe, in-process and one worker, one side-by-side round) "
            f"took {self.minimum_s:.1f} s; give --budget more"
        )

    def ratios(self) -> dict[str, float]:
        """The chosen settings' samples/s over each other contender's, side by side."""
        c = self.comparison
        if self.chosen not in c:
            return {}
        return {k: c[self.chosen] / v for k, v in c.items() if k != self.chosen and v > 0}

    def to_json(self) -> dict[str, Any]:
        return {
            "best": {
                "batch_size": self.best.batch_size,
                **self.best.settings,
                "samples_per_s": self.best.samples_per_s,
            },
            "cpus": self.cpus,
            "seconds": self.seconds,
            "comparison_samples_per_s": self.comparison,
            "comparison_settings": self.comparison_settings,
            "chosen": self.chosen,
            "ratios": self.ratios(),
            "noise": self.noise if self._finite_noise() else None,
            "verdict": self.verdict,
            "trials": [
                {
                    "stage": t.stage,
                    "batch_size": t.batch_size,
                    **t.settings,
                    "samples_per_s": t.samples_per_s,
                    "first_batch_s": t.first_batch_s,
                }
                for t in self.trials
            ],
        }


def snippet(
    result: TuneResult, path: str, settings_file: str | None = None, crop: int | None = None
) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in result.best.settings.items())
    decode = f", decode=gpufeed.RandomResizedCrop({crop})" if crop else ""
    lines = [
        "import gpufeed",
        f"dataset = gpufeed.open_dataset({str(path)!r}{decode})",
        f"loader = gpufeed.make_loader(dataset, batch_size={result.best.batch_size}, {args})",
    ]
    if settings_file:
        lines += [
            "# or, from the file `gpufeed tune --write` made:",
            f"loader = gpufeed.make_loader(dataset, batch_size={result.best.batch_size}, "
            f"settings={settings_file!r})",
            f"# or: export GPUFEED_LOADER_SETTINGS={settings_file}",
        ]
    return "\n".join(lines)


def write_settings(result: TuneResult, path: str | Path) -> Path:
    """Write the settings file atomically (make_loader's ``settings=`` reads it)."""
    path = Path(path)
    atomic_write_json(path, result.file_content())
    return path
