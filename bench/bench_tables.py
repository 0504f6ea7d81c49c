"""The tables of a ``prefixgate bench`` scenario: on the terminal (rich) and in Markdown (the docs).

Both read the per-system summaries of ``bench.bench_run.summarize`` (a ``failed`` key for a system
that did not finish); ``/ RR`` is prefill against the round-robin baseline (``rr_baseline``). The
columns of ``bench.turn_figures`` (generated tokens/s, TTFT of first and returning turns, seat wait,
rank queue) read ``-`` in a summary that lacks them (one written before they existed).
"""

from __future__ import annotations

import sys
from typing import Any

#: The columns of ``bench.turn_figures``, after "mean turn".
NEW_COLUMNS = ("gen tok/s", "TTFT 1st p50/p99", "TTFT ret p50/p99", "seat wait p99", "rank queue p99")
COLUMNS = (
    "system",
    "hit rate",
    "/ bound",
    "prefill Mtok",
    "/ RR",
    "preempt",
    "TTFT p50",
    "TTFT p99",
    "e2e p50",
    "e2e p99",
    "mean turn",
    *NEW_COLUMNS,
    "completion",
    "sessions",
    "errors",
    "429s",
    "CPU ms/req",
)


def print_table(scenario: str, results: dict[str, dict[str, Any]], notes: list[str]) -> None:
    """One row per system, then the bound and working set, then ``notes``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scenario {scenario}: measured from the ranks' usage and /metrics")
    table.add_column(COLUMNS[0], justify="left", no_wrap=True)  # must stay readable when the rest squeeze
    for column in COLUMNS[1:]:
        table.add_column(column, justify="right")
    base = rr_baseline(results)
    for name, r in results.items():
        if "failed" in r:
            table.add_row(name, *["-"] * (len(COLUMNS) - 2), r["failed"][:40])
        else:
            table.add_row(name, *row_cells(r, base, "ms", cpu_decimals=2))
    console = Console(width=None if sys.stdout.isatty() else 250)
    console.print(table)
    done = [r for r in results.values() if "failed" not in r]
    if done:
        r = done[0]
        console.print(
            f"infinite-cache bound {r['bound']:.3f}; working set {r['working_set_mean_x_pools']:.2f}x "
            f"the pools on average (peak {r['working_set_peak_x_pools']:.2f}x)"
        )
    for note in notes:
        console.print(f"note: {note}")


def row_cells(r: dict[str, Any], base: int | None, unit: str, cpu_decimals: int) -> list[str]:
    """The cells after ``system`` of summary ``r`` (``base``: the ``/ RR`` baseline's prefill;
    ``unit``: how milliseconds are written, seconds alike)."""
    cpu = r["proxy_cpu_ms_per_request"]
    latencies = ("ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms")
    return [
        f"{r['hit_rate']:.3f}",
        f"{r['hit_rate'] / r['bound']:.3f}" if r["bound"] else "-",
        f"{r['prefill_tokens'] / 1e6:.2f}",
        f"{r['prefill_tokens'] / base:.2f}" if base else "-",
        str(r["preemptions"]),
        *(f"{r[key]:.0f}{unit}" for key in latencies),
        f"{r.get('latency_mean_ms', 0):.0f}{unit}",
        *new_cells(r, unit),
        f"{r['wall_s']:.1f}{unit.replace('ms', 's')}",
        str(r["completed_sessions"]),
        str(r["errors"]),
        retried(r),
        f"{cpu:.{cpu_decimals}f}" if cpu is not None else "-",
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def new_cells(r: dict[str, Any], unit: str) -> list[str]:
    """The ``NEW_COLUMNS`` cells of summary ``r`` (``unit``: how milliseconds are written)."""
    tok_s = r.get("generated_tok_s")
    first = (r.get("ttft_first_p50_ms"), r.get("ttft_first_p99_ms"))
    returning = (r.get("ttft_returning_p50_ms"), r.get("ttft_returning_p99_ms"))
    return [
        "-" if tok_s is None else f"{tok_s:.0f}",
        f"{_ms(first[0])}/{_ms(first[1])}{unit}",
        f"{_ms(returning[0])}/{_ms(returning[1])}{unit}",
        f"{_ms(r.get('seat_wait_p99_ms'))}{unit}",
        f"{_ms(r.get('rank_queue_p99_ms'))}{unit}",
    ]


def retried(r: dict[str, Any]) -> str:
    """The 429s column: every 429 answer, then ``+N`` other answers retried (502/503/504, a refused
    connection) when there were; a summary without the 429 count gives every retried answer."""
    if "rate_limited" not in r:
        return str(r["rejections"])
    others = r["rejections"] - r["rate_limited"]
    return f"{r['rate_limited']}" + (f" +{others}" if others > 0 else "")


def rr_baseline(results: dict[str, dict[str, Any]]) -> int | None:
    """Prefill tokens of the round-robin baseline: the plain one when it ran, else prefixgate's."""
    for name in ("plain round_robin", "prefixgate round_robin"):
        prefill = results.get(name, {}).get("prefill_tokens")
        if prefill:
            return int(prefill)
    return None


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """The scenario's results as a Markdown table (for docs/benchmarks.md)."""
    base = rr_baseline(results)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed'][:60]} |" + " |" * (len(COLUMNS) - 2))
        else:
            lines.append(f"| {name} | " + " | ".join(row_cells(r, base, " ms", cpu_decimals=1)) + " |")
    return "\n".join(lines) + "\n"
