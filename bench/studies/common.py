"""What every study shares: its base options, rounds taken in turn, one output format.

A study (bench/studies/*.py) measures one question with candidates side by side. On a shared
machine the load drifts over minutes, so a study never times one candidate's passes in a
row: :func:`interleaved` runs round after round, each candidate once a round, each round
starting one candidate further on, so the drift falls on every candidate alike. A study
reports ratios (no absolute number stands alone on a shared machine): :func:`ratio_table`
gives them as one markdown table and :func:`write` puts the results beside it as JSON.

Base options (:func:`parser`): ``--rounds N``, ``--quick`` (a smaller run that checks that
everything works, not numbers), ``--out DIR`` (``<study>.json`` and ``<study>.md`` go there)
and ``--json FILE`` (the results alone, where a caller wants one file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "app" / "src"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def parser(doc: str, *, rounds: int = 3) -> argparse.ArgumentParser:
    """A study's argument parser, its description the first line of ``doc``, with the base
    options; the study adds its own."""
    ap = argparse.ArgumentParser(
        description=doc.strip().splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=rounds,
        help=f"rounds: each candidate once a round, the order rotated (default {rounds})",
    )
    ap.add_argument("--quick", action="store_true", help="a small run: that all works, no numbers")
    ap.add_argument("--out", type=Path, default=None, help="write STUDY.json and STUDY.md here")
    ap.add_argument("--json", type=Path, default=None, help="write the results (JSON) here")
    return ap


def interleaved(
    candidates: dict[str, Callable[[], object]], rounds: int, log: Callable | None = None
) -> dict[str, list]:
    """Each candidate's results (what it returns), one a round: round k runs every candidate
    once, starting k candidates further on. A candidate that returns nothing gives its
    seconds."""
    names = list(candidates)
    out: dict[str, list] = {name: [] for name in names}
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            t = time.perf_counter()
            got = candidates[name]()
            out[name].append(time.perf_counter() - t if got is None else got)
        if log is not None:
            log(f"round {k + 1} of {rounds} done")
    return out


def rates(results: dict[str, list], count: float) -> dict[str, list[float]]:
    """Seconds per pass as ``count`` per second."""
    return {name: [count / s for s in runs] for name, runs in results.items()}


def median(values: list[float]) -> float:
    return statistics.median(values)


def best(values: list[float]) -> float:
    """The best of a candidate's passes (its rate with the least of the machine's noise)."""
    return max(values)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def ratio_table(
    values: dict[str, float], against: str, unit: str = "samples/s", title: str = ""
) -> str:
    """A markdown table: each candidate's value and its ratio to ``against``'s (a candidate
    missing from ``values`` is left out; one whose value is None reads "not run")."""
    lines = [title, ""] if title else []
    lines += [f"| candidate | {unit} | vs {against} |", "|---|---|---|"]
    ref = values.get(against)
    for name, v in values.items():
        if v is None:
            lines.append(f"| {name} | not run | |")
            continue
        ratio = f"{v / ref:.2f}x" if ref else ""
        lines.append(f"| {name} | {_fmt(v)} | {ratio} |")
    return "\n".join(lines)


def write(args: argparse.Namespace, study: str, results: dict, markdown: str) -> None:
    """Print the markdown; write ``<study>.json`` and ``<study>.md`` to ``--out`` and the
    results to ``--json``, where given."""
    print(markdown)
    text = json.dumps(results, indent=1, default=str)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{study}.json").write_text(text)
        (args.out / f"{study}.md").write_text(markdown + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)


def logger(start: float | None = None) -> Callable[[str], None]:
    """A log to stderr with the seconds since ``start`` (now)."""
    t0 = time.perf_counter() if start is None else start

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return log
