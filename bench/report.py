"""The comparison suite's reporting: its results (results.json) as tables, ratios and a chart.

    python -m bench.report --markdown bench/results/results.json   # the tables, to stdout

The headline of a row depends on its page cache. Cold, it is the whole pass: samples over the
time from the loader's making to its last batch, what a user waits for; a loader that reads
most of a small file before its first batch (FFCV) then pays for it there. Warm, it is the
steady rate, timed from the first batch. The steady rate stands beside a cold headline: it
tells how fast batches come once they come, and is warm for a loader that read its file
first. bench/suite.py runs the rows and calls :func:`write`; :func:`latest_results` is the
section docs/benchmarks.md takes from a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.pagecache import NOT_COLD  # noqa: E402

WHOLE, STEADY = "whole pass", "steady"
HEADLINE_NOTE = (
    "samples/s: cold, the whole pass (from the loader's making to its last batch); warm, the "
    "steady rate (from the first batch). The other rate stands beside it."
)


def headline_kind(condition: str) -> str:
    """Which rate heads a condition's rows: the whole pass cold, the steady rate warm."""
    return WHOLE if condition.startswith("cold/") else STEADY


def _rates(c: dict, cold: bool) -> dict:
    """A row's headline and the other rate, from its condition's measurements."""
    steady, whole = c["samples_per_s"], c.get("pass_samples_per_s")
    head = whole if cold and whole else steady
    return {
        "samples_per_s": steady,
        "pass_samples_per_s": whole,
        "pass_s": c.get("pass_s"),
        "headline": WHOLE if cold and whole else STEADY,
        "headline_samples_per_s": head,
        # pass k of every row ran in the same round: comparable pass by pass
        "runs": c.get("pass_runs" if cold and whole else "runs"),
        "steady_runs": c.get("runs"),
    }


def _row_entry(case: str, cond: str, row: str, rr: dict, base: dict | None, cr: dict) -> dict:
    """One table line for a row that ran."""
    cold = cond.startswith("cold/")
    c = rr["conditions"][cond]
    rates = _rates(c, cold)
    head = rates["headline_samples_per_s"]
    resident = c.get("resident_after_evict")
    label = rr["label"]
    if resident is not None and resident > NOT_COLD:  # NaN: cannot tell
        label += f" (not cold: {resident:.0%} of its files stayed cached)"
    base_rate = _rates(base, cold)["headline_samples_per_s"] if base else None
    bound = cr["bound"]["cold" if cold else "warm"]["samples_per_s"]
    return {
        "case": case,
        "condition": cond,
        "row": label,
        "resident_after_evict": resident,
        "key": row,
        **rates,
        "MBps": head * cr["sample_bytes"] / 1e6,
        "vs_perfile": head / base_rate if base_rate else None,
        "vs_bound": head / bound,
        "first_batch_s": c["first_batch_s"],
        "cached_at_first_batch": c.get("cached_at_first_batch"),
        "peak_rss_MB": rr["peak_rss_bytes"] / 1e6,
        "disk_MB": rr["disk_bytes"] / 1e6,
        "workers": rr.get("workers"),
    }


def build_table(results: dict) -> list[dict]:
    """One line per case, condition and row (and the case's read bound): the JSON's table."""
    table = []
    turns = results.get("rows_took_turns")
    for case_name, cr in results["cases"].items():
        for cond in cr["conditions"]:
            base = cr["rows"].get("perfile:0", {}).get("conditions", {}).get(cond)
            for row, rr in cr["rows"].items():
                if "error" in rr or "skipped" in rr:
                    status = rr.get("error") or rr.get("skipped")
                    table.append(
                        {"case": case_name, "condition": cond, "row": rr["label"], "status": status}
                    )
                    continue
                t = _row_entry(case_name, cond, row, rr, base, cr)
                if not turns:  # one row after another: passes are not comparable pass by pass
                    t["runs"] = t["steady_runs"] = None
                table.append(t)
            bound = cr["bound"][cond.split("/")[0]]
            table.append(
                {
                    "case": case_name,
                    "condition": cond,
                    "row": "read bound",
                    "headline": headline_kind(cond),
                    "headline_samples_per_s": bound["samples_per_s"],
                    "samples_per_s": bound["samples_per_s"],
                    "MBps": bound["MBps"],
                    "vs_bound": 1.0,
                }
            )
    return table


# one column each: (header, key, format)
COLUMNS = (
    ("samples/s (headline)", "headline_samples_per_s", ",.0f"),
    ("headline is", "headline", ""),
    ("steady samples/s", "samples_per_s", ",.0f"),
    ("whole pass samples/s", "pass_samples_per_s", ",.0f"),
    ("whole pass s", "pass_s", ".2f"),
    ("MB/s", "MBps", ",.1f"),
    ("x per-file", "vs_perfile", ".1f"),
    ("vs bound", "vs_bound", ".0%"),
    ("1st batch s", "first_batch_s", ".2f"),
    ("cached at 1st batch", "cached_at_first_batch", ".0%"),
    ("peak RSS MB", "peak_rss_MB", ",.0f"),
    ("disk MB", "disk_MB", ",.0f"),
    ("workers", "workers", ""),
)


def _cell(t: dict, key: str, spec: str) -> str:
    v = t.get(key)
    return "" if v is None else format(v, spec)


def fmt_table(table: list[dict]) -> str:
    """The whole table in markdown, one line per entry of ``table``."""
    head = ("case", "cache/order", "row", *(c[0] for c in COLUMNS))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        first = [t["case"], t["condition"], t["row"]]
        if "status" in t:
            lines.append(
                "| " + " | ".join(first) + f" | not run: {t['status']} |" + " |" * (len(head) - 4)
            )
            continue
        cells = first + [_cell(t, key, spec) for _, key, spec in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(r: float, against: str) -> str:
    if against == "read bound":
        return f"{r:.0%}"
    return f"{r:,.0f}x" if r >= 10 else f"{r:.2f}x"


def _by_round(mine: list | None, theirs: list | None) -> str:
    """The range of a format's rate over another row's, pass by pass (the rows take turns:
    pass k of each ran in the same round), where both ran several; else nothing."""
    a, b = mine or [], theirs or []
    if len(a) < 2 or len(a) != len(b) or not all(b):
        return ""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return f" ({min(ratios):.2f}-{max(ratios):.2f})"


def _ratio_line(cond: str, other: dict, mine: list[dict | None], measure: str) -> str:
    """A ratio-table line: each format's rate (``measure``) over ``other``'s."""
    key, runs = (
        ("headline_samples_per_s", "runs")
        if measure != STEADY
        else ("samples_per_s", "steady_runs")
    )
    theirs = other.get(key)
    cells = [
        _ratio(t[key] / theirs, other["row"]) + _by_round(t.get(runs), other.get(runs))
        if t and theirs and t.get(key)
        else ""
        for t in mine
    ]
    return f"| {cond} | {other['row']} | {measure} | " + " | ".join(cells) + " |"


def _case_ratios(case: str, rows: list[dict], formats: list[str]) -> list[str]:
    out = [
        f"`{case}`: each gpufeed format's samples/s over the row named; cold, the whole pass "
        "heads and the steady rate follows (in brackets, the lowest and highest of its passes "
        "over the other row's pass in the same round)",
        "",
        "| condition | vs | rate | " + " | ".join(f[8:] for f in formats) + " |",
        "|---|---|---|" + "---|" * len(formats),
    ]
    for cond in dict.fromkeys(t["condition"] for t in rows):
        here = {t.get("key", t["row"]): t for t in rows if t["condition"] == cond}
        mine = [here.get(f) for f in formats]
        for key, other in here.items():
            if key in formats:
                continue
            out.append(_ratio_line(cond, other, mine, headline_kind(cond)))
            if headline_kind(cond) == WHOLE and other["row"] != "read bound":
                out.append(_ratio_line(cond, other, mine, STEADY))
    return out + [""]


def ratio_tables(table: list[dict]) -> str:
    """Per case: each gpufeed format's headline over every other row of the same condition
    (the per-file baselines, the peers, the read bound), cold with the steady rate's too."""
    out = []
    for case in dict.fromkeys(t["case"] for t in table):
        rows = [t for t in table if t["case"] == case and "samples_per_s" in t]
        formats = list(
            dict.fromkeys(t["key"] for t in rows if t.get("key", "").startswith("gpufeed:"))
        )
        if formats:
            out += _case_ratios(case, rows, formats)
    return "\n".join(out)


def _goal(case: str, cond: str, g: dict, p: dict) -> str:
    rate = "headline_samples_per_s"
    worst = min(g.values(), key=lambda t: t[rate])
    line = f"{case} {cond}: slowest gpufeed format {worst['key'][8:]}"
    if worst.get("vs_perfile"):
        line += f" {worst['vs_perfile']:.1f}x per-file"
    if p:
        bp = max(p.values(), key=lambda t: t[rate])
        line += (
            f"; {worst[rate] / bp[rate]:.2f}x the best peer ({bp['key'][5:]}), {worst['headline']}"
        )
        cached = bp.get("cached_at_first_batch")
        if cached is not None and cached > NOT_COLD:
            line += f", which had {cached:.0%} of its files cached by its first batch"
        if worst["headline"] == WHOLE:
            line += f"; steady {worst['samples_per_s'] / bp['samples_per_s']:.2f}x"
    best = max(g.values(), key=lambda t: t[rate])
    return line + f"; best gpufeed {best['key'][8:]} at {best['vs_bound']:.0%} of the read bound"


def goals(table: list[dict]) -> list[str]:
    """Where each speed goal stands, by the headline (no assertion: the note reports it)."""
    by = {}
    for t in table:
        if "samples_per_s" in t and "key" in t:
            by.setdefault((t["case"], t["condition"]), {})[t["key"]] = t
    out = []
    for (case, cond), rows_ in sorted(by.items()):
        g = {k: v for k, v in rows_.items() if k.startswith("gpufeed:")}
        p = {k: v for k, v in rows_.items() if k.startswith("peer:")}
        if g:
            out.append(_goal(case, cond, g, p))
    return out


def _bar_color(row: str) -> str:
    if row.startswith("gpufeed"):
        return "#2b7bba"
    if row == "read bound":
        return "#999999"
    return "#d95f02" if row.startswith("per-file") else "#66a61e"


def chart(table: list[dict], path: Path) -> bool:
    """Bars of each condition's headline rates (log scale); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    groups = list(dict.fromkeys((t["case"], t["condition"]) for t in table))
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 2.6 * len(groups)))
    for ax, (case, cond) in zip(np.atleast_1d(axes), groups, strict=True):
        ts = [
            t
            for t in table
            if t["case"] == case and t["condition"] == cond and "samples_per_s" in t
        ]
        names = [t["row"] for t in ts]
        ax.barh(
            names, [t["headline_samples_per_s"] for t in ts], color=[_bar_color(n) for n in names]
        )
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{case}, {cond}: {headline_kind(cond)} samples/s (log scale)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def markdown(results: dict) -> str:
    """The run's tables in markdown: the whole table, the goals, the ratio tables."""
    table = results.get("table") or build_table(results)
    goal_lines = results.get("goals") or goals(table)
    md = HEADLINE_NOTE + "\n\n" + fmt_table(table)
    if results.get("read_as"):
        md = f"Rows read as uid {results['read_as']} over packs written as root.\n\n" + md
    return md + "\n\n" + "\n".join(f"- {g}" for g in goal_lines) + "\n\n" + ratio_tables(table)


def latest_results(results: dict) -> str:
    """The "latest results" section of docs/benchmarks.md: how the run was made, then its
    ratio tables (the full table stays in results.md)."""
    table = results.get("table") or build_table(results)
    setup = (
        f"{'QUICK run (a tenth of the data)' if results.get('quick') else 'Full run'}: "
        f"{results.get('cpus')} CPUs, torch {results.get('torch')}, batch size "
        f"{results.get('batch_size')}, {results.get('runs')} timed passes a condition, each "
        f"capped at {results.get('cap_s')} s from its first batch, rows "
        f"{'taking turns pass by pass' if results.get('rows_took_turns') else 'one after another'}."
    )
    return "\n".join(
        ["## Latest results", "", setup, "", HEADLINE_NOTE, "", ratio_tables(table).rstrip(), ""]
    )


def write(results: dict, out_dir: Path) -> bool:
    """results.json, results.md, latest.md (for docs/benchmarks.md) and benchmarks.png into
    ``out_dir``; whether the chart was drawn."""
    results["table"] = build_table(results)
    results["goals"] = goals(results["table"])
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out_dir / "results.md").write_text(markdown(results))
    (out_dir / "latest.md").write_text(latest_results(results))
    return chart(results["table"], out_dir / "benchmarks.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results.json the suite wrote")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--markdown", action="store_true", help="every table (the default)")
    what.add_argument("--latest", action="store_true", help="docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    print(latest_results(results) if args.latest else markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
