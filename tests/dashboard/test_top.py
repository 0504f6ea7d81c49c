"""``prefixgate top``: one frame rendered from a live prefixgate, and the command's exit codes."""

from __future__ import annotations

import argparse

from rich.console import Console

from proxy.cli import build_parser
from proxy.cli import top as top_cmd
from tests.dashboard.conftest import SYSTEM, converse


def frame_text(url: str, token: str | None = None) -> str:
    client = top_cmd.TopClient(url, token, sessions=10)
    try:
        frame, ok = client.frame()
    finally:
        client.close()
    assert ok
    console = Console(record=True, width=140, color_system=None)
    console.print(frame)
    return console.export_text()


def test_top_renders_fleet_ranks_admission_and_sessions(deployment):
    dep = deployment(2, admin_token="tok")
    converse(dep.url, "top-one", 3)
    converse(dep.url, "top-two", 4)
    converse(dep.url, "top-two", 5, system=SYSTEM.replace("agent", "bot", 1))

    text = frame_text(dep.url, "tok")
    client = top_cmd.TopClient(dep.url, "tok", sessions=10)
    overview, sessions = client.fetch()
    client.close()
    window = overview["fleet"]["window"]
    assert f"{100 * window['hit_rate']:.1f}% last {window['requests']} requests" in text
    assert "active sessions 2" in text and "ranks healthy 2/2" in text
    for rank in overview["ranks"]:
        line = next(line for line in text.splitlines() if line.startswith(rank["name"]))
        assert " up " in line and "|" in line  # health, and the budget mark on the pool bar
        assert f"{rank['working_set_tokens']:,}" in line and "65,536" in line
    assert "admission on · queue 0" in text
    assert "prefix breaks system_edited 1" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("top-")}
    assert set(rows) == {"top-one", "top-two"}
    assert "system_edited @4" in rows["top-two"] and "—" in rows["top-one"]
    two = next(s for s in sessions["data"] if s["key"] == "top-two")
    assert f"{100 * two['hit_rate']:.1f}%" in rows["top-two"]


def test_top_frame_helpers():
    assert top_cmd.sparkline([0.0, 0.5, None, 1.0]) == "▁▅ █"
    bar = top_cmd.occupancy_bar(
        {"pool_tokens": 100, "working_set_tokens": 50, "budget_tokens": 80, "over_pool": False}, width=10
    )
    assert bar.plain == "█████░░░|░ 50.0%"
    assert top_cmd.occupancy_bar({"pool_tokens": None, "working_set_tokens": 5}).plain == "pool size unknown"
    assert top_cmd.idle(5) == "5 s" and top_cmd.idle(125) == "2 m 5 s" and top_cmd.idle(7260) == "2 h 1 m"


def test_top_once_exit_codes(deployment, capsys):
    dep = deployment(1, admin_token="tok")
    converse(dep.url, "once", 1)
    parser = argparse.ArgumentParser()
    top_cmd.configure_parser(parser)
    assert top_cmd.run(parser.parse_args(["--url", dep.url, "--once", "--admin-token", "tok"])) == 0
    assert "once" in capsys.readouterr().out
    assert top_cmd.run(parser.parse_args(["--url", dep.url, "--once", "--admin-token", ""])) == 1
    assert "HTTP 401 (pass --admin-token)" in capsys.readouterr().out
    args = build_parser().parse_args(["top", "--url", dep.url, "--once"])
    assert args.handler is top_cmd.run and args.interval == 2.0


def test_top_shows_client_chosen_keys_as_text_never_as_markup_or_terminal_codes(deployment):
    dep = deployment(1)
    hostile = ["[/bold]", "[link=http://evil.example]click[/link]", "[red]alarm"]
    for key in hostile:
        converse(dep.url, key, 1)
    client = top_cmd.TopClient(dep.url, None, sessions=10)
    overview, sessions = client.fetch()
    client.close()
    # a record stored before keys were made safe (an older replica's, in Redis) may hold anything
    sessions["data"].append({**sessions["data"][0], "key": "esc\x1b]8;;http://evil.example\x1b\\x\x1b[2J"})
    console = Console(record=True, width=200, force_terminal=True, color_system="truecolor")
    console.print(top_cmd.render_frame(overview, sessions, dep.url, width=200))
    shown = console.export_text(styles=True)
    for key in hostile:
        assert key in shown  # the literal key, not its markup's effect
    assert "evil.example\x1b" not in shown and "\x1b[2J" not in shown and "\x1b]8;" not in shown
    assert "\\x1b]8;;http://evil.example" in shown  # written as an escape instead


def test_top_fits_80_columns(deployment):
    dep = deployment(2, admin_token="tok")
    long_key = "a-session-key-far-longer-than-an-80-column-terminal-has-room-for-0123456789"
    converse(dep.url, long_key, 2)
    converse(dep.url, "top-short", 3)
    client = top_cmd.TopClient(dep.url, "tok", sessions=10)
    try:
        frame, ok = client.frame(80)
    finally:
        client.close()
    assert ok
    console = Console(record=True, width=80, color_system=None)
    console.print(frame)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    expected = "rank health pool (| budget) working pool sessions in flight hit rate"
    assert lines[header].split() == expected.split()
    for rank, line in zip(dep.ranks, lines[header + 1 : header + 3], strict=True):
        # one line per rank with every figure whole: no wrapped or cut cells
        assert line.startswith(rank.name + " ") and " up " in line and "|" in line, line
        assert "65,536" in line and line.rstrip().endswith(("%", "–")), line
    text = "\n".join(lines)
    assert "policy prefix_affinity" in text and " req/s · first byte p50 " in text
    assert "· errors 0 · 429s 0" in text
    row = next(line for line in lines if line.startswith("a-session-key"))
    assert "…" in row and row.rstrip().endswith(" s")


def test_top_says_when_the_url_is_not_a_prefixgate(rank_servers, capsys):
    (rank,) = rank_servers.sim(1)
    parser = argparse.ArgumentParser()
    top_cmd.configure_parser(parser)
    assert top_cmd.run(parser.parse_args(["--url", rank.url, "--once"])) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"{rank.url} is not a prefixgate: GET /admin/overview answered HTTP 404" in out
    assert "a vLLM rank?" in out and "--url" in out


def test_a_down_ranks_bar_is_not_green():
    rank = {"pool_tokens": 100, "working_set_tokens": 50, "budget_tokens": 80, "over_pool": False}
    up = top_cmd.occupancy_bar({**rank, "healthy": True}, width=10)
    down = top_cmd.occupancy_bar({**rank, "healthy": False}, width=10)
    assert up.plain == down.plain
    fill = {str(span.style) for span in up.spans if up.plain[span.start] == "█"}
    down_fill = {str(span.style) for span in down.spans if down.plain[span.start] == "█"}
    assert fill == {"green"} and down_fill and "green" not in down_fill
