"""``gpufeed.watch(loader)``: where does a training loop's time go, data or compute?

    for images, labels in gpufeed.watch(loader):      # or: with gpufeed.watch(loader) as w:
        loss = model(images).loss; loss.backward(); opt.step()

Per step it records the time spent waiting for the next batch (inside ``next()`` on the
loader) and the time spent in the step (from handing the batch out to asking for the next
one), the batch's sample count and, a few times a second, GPU utilisation and memory from NVML
(nvidia-ml-py) when a GPU is there. A progress bar (tqdm; a widget in notebooks) shows the
data-wait share and throughput; at the end a summary says whether the job is input-bound and
which setting to change. :meth:`Watch.to_csv` and :meth:`Watch.plot` export the series.

What the times mean with CUDA: the host runs ahead of the GPU until something synchronises
(``loss.item()``, a full launch queue). A loop that never synchronises shows short steps and
the GPU time surfaces as wait wherever the host blocks; ``sync=True`` calls
``torch.cuda.synchronize()`` at the end of every step for exact step times (at the cost of
the overlap of one step with the next). GPU utilisation from NVML is the cross-check.

The cost is a few microseconds per step (clock reads, list appends, a progress-bar counter);
``app/examples/watch_overhead.py`` measures it, docs/watch.md states it.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.errors import UsageError
from gpufeed.tools.watch_advice import INPUT_BOUND, PARTLY, advice, quantile

__all__ = ["INPUT_BOUND", "PARTLY", "PLOT_EXTRA", "Watch", "WatchSummary", "watch"]

PLOT_EXTRA = "pip install 'gpufeed[plot]'"
# what Figure.savefig writes (matplotlib's Agg, PDF, PS, SVG, PGF backends); no suffix is PNG
_PLOT_SUFFIXES = frozenset(
    ".eps .jpeg .jpg .pdf .pgf .png .ps .raw .rgba .svg .svgz .tif .tiff .webp".split()
)


def _matplotlib_missing() -> str | None:
    """Why a plot cannot be drawn here, or None (found, not imported: that is slow)."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken or blocked entry in sys.modules
        found = False
    return None if found else f"matplotlib is not installed ({PLOT_EXTRA})"


def _output_path(path: str | os.PathLike, what: str, suffixes=None) -> None:
    """A file the watch writes when it ends: refused now, before the training it follows,
    when its folder is missing or (a plot) its format is not one matplotlib writes."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(
            f"gpufeed.watch({what}={os.fspath(path)!r}): the folder {parent} does not exist; "
            "create it first (the file is written when the watch ends)"
        )
    if suffixes is not None and p.suffix and p.suffix.lower() not in suffixes:
        raise UsageError(
            f"gpufeed.watch({what}={os.fspath(path)!r}): {p.suffix} is not an image format "
            f"matplotlib writes; use one of {', '.join(sorted(suffixes))}"
        )


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _Gpu:
    """NVML readings for the device torch uses, or nothing (no NVML, no GPU: no error)."""

    def __init__(self, device: int | None):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = self._handle(pynvml, device)
        except Exception:
            self.handle = None

    @staticmethod
    def _handle(pynvml, device: int | None):
        index = 0 if device is None else device
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if 0 <= index < len(visible) and visible[index].strip():
            entry = visible[index].strip()
            if entry.isdigit():
                return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            if entry.startswith(("GPU-", "MIG-")):
                return pynvml.nvmlDeviceGetHandleByUUID(entry)
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> tuple[float, float]:
        """(utilisation %, memory used MiB); NaNs when unavailable."""
        if self.handle is None:
            return math.nan, math.nan
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
            mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
            return float(util), float(mem)
        except Exception:
            return math.nan, math.nan


@dataclass
class WatchSummary:
    steps: int
    samples: int
    startup_s: float  # wait for each pass's first batch (worker start, first reads)
    wait_s: float  # data wait over the other steps
    step_s: float  # time in those steps
    wait_fraction: float
    samples_per_s: float
    step_ms_median: float
    wait_ms_median: float
    wait_ms_p90: float
    gpu_util_mean: float | None
    gpu_mem_max_mib: float | None
    verdict: str
    input_bound: bool = False
    advice: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.steps == 0:
            return "gpufeed.watch: no steps recorded"
        total = self.wait_s + self.step_s
        lines = [
            f"gpufeed.watch: {self.steps} steps, {self.samples} samples, "
            f"{self.samples_per_s:.0f} samples/s",
            f"  data wait {self.wait_s:.2f} s ({self.wait_fraction:.0%}) vs step "
            f"{self.step_s:.2f} s of {total:.2f} s; median step {self.step_ms_median:.1f} ms, "
            f"wait median {self.wait_ms_median:.2f} ms, p90 {self.wait_ms_p90:.2f} ms; "
            f"first batch {self.startup_s:.2f} s",
        ]
        if self.gpu_util_mean is not None:
            lines.append(
                f"  GPU utilisation {self.gpu_util_mean:.0f}% on average, memory up to "
                f"{self.gpu_mem_max_mib:.0f} MiB"
            )
        lines.append(f"  verdict: {self.verdict}")
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


class Watch:
    """Iterate ``loader`` and record data wait vs step time; see the module docstring.

    Args:
        loader: any iterable of batches (a DataLoader, a make_loader loader, a
            DevicePrefetcher).
        total: steps the progress bar counts to (None: ``len(loader)`` when it has one).
        progress: True, False or "auto" (a terminal or a notebook).
        desc: the progress bar's label.
        gpu: read GPU utilisation and memory from NVML ("auto": when CUDA is available).
        gpu_interval: seconds between NVML reads.
        sync: synchronise CUDA at each step end, for exact step times (at the cost of the
            overlap of one step with the next).
        csv: a path the series is written to when the watch ends (its folder is checked at
            the start).
        plot: a path the plot is saved to when the watch ends (its folder is checked at the
            start; needs matplotlib, ``gpufeed[plot]``: without it a warning at the start and
            a line under the summary say so, and the rest is reported).
        report: print the summary at the end (of each pass; of the ``with`` block when used
            as a context manager).
        file: where the summary and progress bar go (None: stdout for the summary, stderr
            for the bar).
    """

    def __init__(
        self,
        loader: Iterable,
        *,
        total: int | None = None,
        progress: bool | str = "auto",
        desc: str | None = "steps",
        gpu: bool | str = "auto",
        gpu_interval: float = 0.5,
        sync: bool = False,
        csv: str | os.PathLike | None = None,
        plot: str | os.PathLike | None = None,
        report: bool = True,
        file=None,
    ) -> None:
        self.loader = loader
        self.total = total
        self.progress = progress
        self.desc = desc
        self.gpu_interval = gpu_interval
        self.sync = sync
        self.csv_path = csv
        self.plot_path = plot
        self.report = report
        self.file = file
        self.wait: list[float] = []
        self.step: list[float] = []
        self.samples: list[int] = []
        self.passes: list[int] = []
        self.gpu_util: list[float] = []
        self.gpu_mem: list[float] = []
        self._pass = 0
        self._in_context = False
        self._uses_cuda = self._cuda_in_use()
        self._gpu_wanted = self._uses_cuda if gpu == "auto" else bool(gpu)
        self._gpu: _Gpu | None = None
        self._plot_missing: str | None = None
        if csv is not None:
            _output_path(csv, "csv")
        if plot is not None:
            _output_path(plot, "plot", _PLOT_SUFFIXES)
            self._plot_missing = _matplotlib_missing()
            if self._plot_missing:
                warnings.warn(
                    f"gpufeed.watch(plot={os.fspath(plot)!r}): {self._plot_missing}; the plot "
                    "will be skipped, the summary and verdict are still reported",
                    UserWarning,
                    stacklevel=3 if type(self) is Watch else 2,
                )

    @staticmethod
    def _cuda_in_use() -> bool:
        torch = sys.modules.get("torch")
        try:
            return bool(torch is not None and torch.cuda.is_available())
        except Exception:
            return False

    def _bar(self):
        enabled = self.progress
        if enabled == "auto":
            enabled = _in_notebook() or bool(getattr(sys.stderr, "isatty", lambda: False)())
        if not enabled:
            return None
        total = self.total
        if total is None:
            try:
                total = len(self.loader)  # type: ignore[arg-type]
            except TypeError:
                total = None
        import importlib.util

        if _in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.notebook import tqdm
        else:
            from tqdm import tqdm
        return tqdm(total=total, desc=self.desc, unit="step", mininterval=0.5, file=self.file)

    # -- the loop
    def __iter__(self) -> Iterator:
        """One pass over the loader, timed.

        Yields:
            The loader's batches, unchanged.
        """
        self._pass += 1
        if self._gpu_wanted and self._gpu is None:
            torch = sys.modules.get("torch")
            self._gpu = _Gpu(torch.cuda.current_device() if self._uses_cuda else None)
        gpu = self._gpu if self._gpu is not None and self._gpu.handle is not None else None
        sync = sys.modules["torch"].cuda.synchronize if self.sync and self._uses_cuda else None
        from gpufeed.batch import batch_len  # not at import: watch itself needs no torch

        def count(batch) -> int:
            return batch_len(batch) or 1

        bar = self._bar()
        wait, step, samples = self.wait.append, self.step.append, self.samples.append
        passes, util, mem = self.passes.append, self.gpu_util.append, self.gpu_mem.append
        pass_no, nan, interval = self._pass, math.nan, self.gpu_interval
        clock = time.perf_counter
        next_poll = clock() + interval
        it = iter(self.loader)
        try:
            t0 = clock()
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                t1 = clock()
                try:
                    yield batch
                except GeneratorExit:  # the loop broke out after finishing this step
                    wait(t1 - t0)
                    step(clock() - t1)
                    samples(count(batch))
                    passes(pass_no)
                    util(nan)
                    mem(nan)
                    raise
                if sync is not None:
                    sync()
                t2 = clock()
                wait(t1 - t0)
                step(t2 - t1)
                samples(count(batch))
                passes(pass_no)
                if t2 >= next_poll:
                    next_poll = t2 + interval
                    u, m = gpu.read() if gpu is not None else (nan, nan)
                    util(u)
                    mem(m)
                    if bar is not None:
                        bar.set_postfix_str(self._postfix(u), refresh=False)
                else:
                    util(nan)
                    mem(nan)
                if bar is not None:
                    bar.update(1)
                t0 = clock()
        finally:
            if bar is not None:
                bar.close()
            if not self._in_context:
                self._finish()

    def _postfix(self, util: float) -> str:
        recent = slice(-50, None)
        w, s, n = sum(self.wait[recent]), sum(self.step[recent]), sum(self.samples[recent])
        text = f"data wait {w / max(w + s, 1e-12):.0%}, {n / max(w + s, 1e-12):.0f} samples/s"
        return text + ("" if math.isnan(util) else f", GPU {util:.0f}%")

    def __enter__(self) -> Watch:
        self._in_context = True
        return self

    def __exit__(self, *exc) -> None:
        self._in_context = False
        self._finish()

    def _finish(self) -> None:
        note = None
        try:
            if self.csv_path is not None:
                self.to_csv(self.csv_path)
            if self.plot_path is not None and self.step:
                note = self._save_plot()
        finally:  # a file that could not be written never costs the verdict
            if self.report:
                out = self.file or sys.stdout
                print(self.summary(), file=out)
                if note:
                    print(f"  {note}", file=out)

    def _save_plot(self) -> str | None:
        """Writes the plot; without matplotlib, a line saying so (warned as well, unless the
        start already did), never an error after the training."""
        try:
            self.plot(self.plot_path)
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("matplotlib"):
                raise
            note = f"plot not written to {os.fspath(self.plot_path)}: {e}"
            if not self._plot_missing:
                warnings.warn(note, UserWarning, stacklevel=2)
            return note
        return None

    # -- results
    def _steady(self) -> list[int]:
        """Steps that are not a pass's first (whose wait is the workers' start)."""
        p = self.passes
        return [i for i in range(len(p)) if i and p[i] == p[i - 1]]

    def summary(self) -> WatchSummary:
        """What the steps recorded so far say.

        Returns:
            A :class:`WatchSummary`: the data-wait share, throughput, step and wait
            quantiles, GPU use and the advice (whether the job is input-bound, which setting
            to change).
        """
        n = len(self.step)
        if n == 0:
            return WatchSummary(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, None, None, "no steps recorded")
        steady = self._steady() or list(range(n))
        steady_set = set(steady)
        firsts = [i for i in range(n) if i not in steady_set]
        waits = [self.wait[i] for i in steady]
        steps = [self.step[i] for i in steady]
        wait_s, step_s = sum(waits), sum(steps)
        fraction = wait_s / max(wait_s + step_s, 1e-12)
        util = [u for u in self.gpu_util if not math.isnan(u)]
        mem = [m for m in self.gpu_mem if not math.isnan(m)]
        if fraction >= INPUT_BOUND:
            verdict = f"input-bound: the loop waits for data {fraction:.0%} of the time"
        elif fraction >= PARTLY:
            verdict = f"partly input-bound: {fraction:.0%} of the time goes to waiting for data"
        else:
            verdict = f"not input-bound: data wait is {fraction:.1%} of the time"
        if util and fraction >= PARTLY and sum(util) / len(util) < 70:
            verdict += f" (and the GPU is busy only {sum(util) / len(util):.0f}% of the time)"
        return WatchSummary(
            steps=n,
            samples=sum(self.samples),
            startup_s=sum(self.wait[i] for i in firsts),
            wait_s=wait_s,
            step_s=step_s,
            wait_fraction=fraction,
            samples_per_s=sum(self.samples[i] for i in steady) / max(wait_s + step_s, 1e-12),
            step_ms_median=quantile(steps, 0.5) * 1e3,
            wait_ms_median=quantile(waits, 0.5) * 1e3,
            wait_ms_p90=quantile(waits, 0.9) * 1e3,
            gpu_util_mean=sum(util) / len(util) if util else None,
            gpu_mem_max_mib=max(mem) if mem else None,
            verdict=verdict,
            input_bound=fraction >= INPUT_BOUND,
            advice=advice(self.loader, fraction, waits, self._uses_cuda),
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        start = 0.0
        for i in range(len(self.step)):
            yield {
                "step": i,
                "pass": self.passes[i],
                "start_s": round(start, 6),
                "data_wait_s": self.wait[i],
                "compute_s": self.step[i],
                "samples": self.samples[i],
                "gpu_util_pct": "" if math.isnan(self.gpu_util[i]) else self.gpu_util[i],
                "gpu_mem_mib": "" if math.isnan(self.gpu_mem[i]) else round(self.gpu_mem[i], 1),
            }
            start += self.wait[i] + self.step[i]

    CSV_FIELDS = (
        "step",
        "pass",
        "start_s",
        "data_wait_s",
        "compute_s",
        "samples",
        "gpu_util_pct",
        "gpu_mem_mib",
    )

    def to_csv(self, path: str | os.PathLike) -> None:
        tmp = f"{os.fspath(path)}.partial"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.CSV_FIELDS)
            writer.writeheader()
            writer.writerows(self.rows())
        os.replace(tmp, path)

    def plot(self, path: str | os.PathLike | None = None, ax=None):
        """Step time stacked into data wait (bottom) and compute (top), per step, in ms.

        Draws into ``ax`` when given (a notebook's axes), else on a new Figure (no pyplot
        state touched) that is saved to ``path`` when given. Returns the Figure."""
        if ax is None:
            try:
                from matplotlib.figure import Figure
            except ImportError as e:
                raise ModuleNotFoundError(
                    f"Watch.plot needs matplotlib ({PLOT_EXTRA}): {e}", name="matplotlib"
                ) from e

            fig = Figure(figsize=(9, 3.5), layout="constrained")
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        x = list(range(len(self.step)))
        wait_ms = [w * 1e3 for w in self.wait]
        step_ms = [s * 1e3 for s in self.step]
        if len(x) <= 300:
            ax.bar(x, wait_ms, width=1.0, color="#d62728", label="data wait")
            ax.bar(x, step_ms, width=1.0, bottom=wait_ms, color="#1f77b4", label="compute")
        else:
            ax.stackplot(
                x, wait_ms, step_ms, colors=["#d62728", "#1f77b4"], labels=["data wait", "compute"]
            )
        s = self.summary()
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.set_title(f"{s.wait_fraction:.0%} data wait, {s.samples_per_s:.0f} samples/s")
        ax.legend(loc="upper right")
        if len(x) > 2:  # the first step's wait (worker start) would flatten the rest
            totals = sorted(w + c for w, c in zip(wait_ms[1:], step_ms[1:], strict=True))
            top = totals[min(len(totals) - 1, int(0.99 * len(totals)))]
            if top > 0:
                ax.set_ylim(0, top * 1.3)
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def watch(loader: Iterable, **kwargs) -> Watch:
    """Time a training loop's data wait against its steps.

    ``for batch in gpufeed.watch(loader): ...`` or ``with gpufeed.watch(loader) as w:``.

    Args:
        loader: any iterable of batches.
        **kwargs: as :class:`Watch` takes them (total, progress, gpu, sync, csv, plot,
            report, ...).

    Returns:
        A :class:`Watch`: iterate it in place of ``loader``.
    """
    return Watch(loader, **kwargs)
