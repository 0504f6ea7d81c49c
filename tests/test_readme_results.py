"""The README's table of results is copied from docs/benchmarks.md's current seed-fleet tables: each
figure is prefixgate's and the better peer's of the same cell, as written there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
CELL = re.compile(r"\*\*seed-([a-z-]+)\*\*.*?\n\n(\|.*?)\n\ninfinite-cache bound ([0-9.]+)", re.S)


def cells(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def p99(figure: str) -> int:
    """``p50/p99 ms`` -> p99."""
    return int(figure.split("/")[1].split()[0])


def expected_rows() -> dict[str, list[str]]:
    """Each current seed cell's README row, computed from its table in docs/benchmarks.md."""
    current = BENCHMARKS.split("### Seed fleet", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for cell, table, bound in CELL.findall(current):
        prefixgate, *peers = cells(table)
        assert prefixgate[0].startswith("prefixgate") and len(peers) == 2, cell
        hit = max(peer[1] for peer in peers)
        generated = max(peers, key=lambda peer: float(peer[3]))[3]
        first = min(p99(peer[4]) for peer in peers)
        returning = min(p99(peer[5]) for peer in peers)
        completion = min(peers, key=lambda peer: float(peer[7].split()[0]))[7]
        rows[cell] = [
            cell,
            f"{prefixgate[1]} / {hit} ({bound})",
            f"{prefixgate[3]} / {generated}",
            f"{p99(prefixgate[4])} / {first} ms",
            f"{p99(prefixgate[5])} / {returning} ms",
            f"{prefixgate[7].split()[0]} / {completion}",
        ]
    return rows


def test_the_readme_table_is_the_current_seed_cells_of_docs_benchmarks():
    results = README.split("## Results", 1)[1].split("\n## ", 1)[0]
    table = results.split("\n| cell |", 1)[1].split("\n\n", 1)[0]
    shown = {row[0]: row for row in cells("| cell |" + table)}
    expected = expected_rows()
    assert len(expected) == 8  # two shapes x two speeds x two pressures
    assert shown == expected
    assert "(docs/benchmarks.md)" in results


def test_the_readme_names_the_commit_of_the_figures():
    heading = re.search(r"### Seed fleet \(commit `([0-9a-f]+)`, medians of 3 rounds\)", BENCHMARKS)
    assert heading is not None
    results = README.split("## Results", 1)[1].split("\n## ", 1)[0]
    assert f"`{heading.group(1)}`" in results and "medians of 3 rounds" in results
