"""``prefixgate top``: the dashboard's essentials in the terminal, refreshed live (rich).

Polls ``GET /admin/overview`` and ``GET /admin/overview/sessions`` of a running prefixgate (with the
admin token when one is configured) and draws: the fleet's hit rate (last 1,000 requests, since
start, a sparkline of the series), prompt tokens computed per 100 sent, each rank's pool occupancy
against its budget, in-flight requests and health, admission (queue, rejections), prefix breaks by
cause and the most recent sessions.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import httpx
from rich.cells import cell_len
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

SPARKS = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 24
#: The narrowest pool bar: below it the name column gives way instead.
MIN_BAR_WIDTH = 8
#: What the ranks table needs besides its name column and the bar (the other columns at their
#: widest usual values, one space between columns): the bar gets what is left of the screen.
RANK_FIXED_WIDTH = 68


RANK_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("rank", "left"),
    ("health", "left"),
    ("pool (| budget)", "left"),
    ("working", "right"),
    ("pool", "right"),
    ("sessions", "right"),
    ("in flight", "right"),
    ("hit rate", "right"),
)

SESSION_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("session", "left"),
    ("rank", "left"),
    ("turns", "right"),
    ("context", "right"),
    ("hit rate", "right"),
    ("last break", "left"),
    ("idle", "right"),
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="prefixgate's base URL (default %(default)s)"
    )
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("PREFIXGATE_ADMIN_TOKEN"),
        help="the admin token, when prefixgate has one (default: $PREFIXGATE_ADMIN_TOKEN)",
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--sessions", type=int, default=15, help="sessions listed (most recent first)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


def plain(value: object) -> Text:
    """Text a client or a rank chose (a session key, a name), shown as it is: never read as rich
    markup (``[/bold]`` would end the frame, ``[link=...]`` would reach the terminal), and with
    control characters (an ESC sequence would drive the operator's terminal) written as escapes."""
    text = str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return Text(text)


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def num(value: float | None) -> str:
    return "–" if value is None else f"{round(value):,}"


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} ms" if value < 100 else f"{round(value):,} ms"


def idle(seconds: float) -> str:
    if seconds < 60:
        return f"{int(seconds)} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} m {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} m"


def sparkline(values: list[float | None], width: int = 60) -> str:
    """The last ``width`` rates (0..1) as block characters; a gap where a rate is unknown."""
    out = []
    for value in values[-width:]:
        if value is None:
            out.append(" ")
        else:
            out.append(SPARKS[min(len(SPARKS) - 1, max(0, int(value * len(SPARKS))))])
    return "".join(out)


def occupancy_bar(rank: dict[str, Any], width: int = BAR_WIDTH) -> Text:
    """The pool as ``width`` cells: filled by the working set, ``|`` at the budget."""
    pool = rank.get("pool_tokens")
    if not pool:
        return Text("pool size unknown", style="dim")
    used = rank["working_set_tokens"]
    filled = min(width, round(width * used / pool))
    budget = rank.get("budget_tokens")
    mark = min(width - 1, int(width * budget / pool)) if budget is not None else None
    over_budget = budget is not None and used > budget
    style = "red" if rank.get("over_pool") else ("yellow" if over_budget else "green")
    if not rank.get("healthy", True):
        style = "bright_black"  # its sessions still count, but it serves nothing: never green
    text = Text()
    for cell in range(width):
        if cell == mark:
            text.append("|", style="bold")
        elif cell < filled:
            text.append("█", style=style)
        else:
            text.append("░", style="dim")
    text.append(f" {pct(used / pool)}")
    return text


def render_frame(
    overview: dict[str, Any], sessions: dict[str, Any], url: str = "", width: int = 80
) -> RenderableType:
    """One screen of ``prefixgate top`` from the two documents the endpoints return, for a terminal
    ``width`` columns wide (80 and up: every line fits, only names and keys shorten)."""
    fleet = overview["fleet"]
    window, total = fleet["window"], fleet["cumulative"]
    admission = overview["admission"]
    rejected = admission.get("rejected") or {}
    head = Text()
    head.append("prefixgate ", style="bold")
    head.append(url, style="dim")
    head.append("\nhit rate ")
    head.append(pct(window["hit_rate"]), style="bold cyan")
    head.append(f" last {num(window['requests'])} requests · ")
    head.append(pct(total["hit_rate"]), style="bold")
    head.append(" since start")
    computed = window["computed_per_100"]
    head.append(f"\nprompt tokens {num(total['hit_tokens'])} of {num(total['prompt_tokens'])} hit · ")
    head.append(f"{'–' if computed is None else f'{computed:.1f}'} computed per 100 sent")
    head.append(f"\nactive sessions {num(fleet['active_sessions'])}")
    head.append(f" · ranks healthy {fleet['healthy_ranks']}/{fleet['ranks']}")
    settings = overview.get("settings")
    if settings:
        head.append(f" · policy {settings['policy']}")
    traffic = overview.get("traffic")
    if traffic:
        window, totals = traffic["window"], traffic["total"]
        head.append(f"\n{traffic['requests_per_s']:.2f} req/s · first byte p50 {ms(window['ttfb_p50_ms'])}")
        head.append(f" p99 {ms(window['ttfb_p99_ms'])} · errors ")
        head.append(num(totals["errors"]), style="red" if totals["errors"] else "")
        head.append(" · 429s ")
        head.append(num(totals["rate_limited"]), style="yellow" if totals["rate_limited"] else "")
    rates = [p[1] for p in overview["series"]] + [overview["live"][1]]
    head.append("\nhit rate ▕")
    head.append(sparkline(rates, max(10, min(60, width - 16))), style="cyan")
    head.append("▏")

    bar_width = max(MIN_BAR_WIDTH, min(BAR_WIDTH, width - RANK_FIXED_WIDTH))
    ranks = Table(
        title="ranks", title_justify="left", expand=True, box=None, pad_edge=False, collapse_padding=True
    )
    for column, justify in RANK_COLUMNS:
        ranks.add_column(column, justify=justify, no_wrap=True, overflow="ellipsis")
    for rank in overview["ranks"]:
        health = Text("up", style="green") if rank["healthy"] else Text("DOWN", style="bold red")
        ranks.add_row(
            plain(rank["name"]),
            health,
            occupancy_bar(rank, bar_width),
            num(rank["working_set_tokens"]),
            num(rank["pool_tokens"]),
            num(rank["sessions"]),
            num(rank["in_flight"]),
            pct(rank["hit_rate"]),
        )

    hold_widths(ranks, "rank", width)

    adm = Text("admission ")
    adm.append("on" if admission["enabled"] else "off", style="bold")
    adm.append(f" · queue {num(admission['queue_depth'])} · waited {num(admission['queued'])}")
    adm.append(" · rejected ")
    adm.append(
        ", ".join(f"{k} {num(v)}" for k, v in rejected.items()) if rejected else "0",
        style="red" if rejected else "",
    )
    breaks = overview.get("breaks") or {}
    adm.append("\nprefix breaks ")
    adm.append(
        ", ".join(f"{k} {num(v)}" for k, v in sorted(breaks.items(), key=lambda kv: -kv[1])) or "none",
        style="red" if breaks else "",
    )

    table = Table(
        title=f"sessions ({sessions['total']} known, newest first)",
        title_justify="left",
        expand=True,
        box=None,
        pad_edge=False,
        collapse_padding=True,
    )
    for column, justify in SESSION_COLUMNS:
        table.add_column(column, justify=justify, overflow="ellipsis", no_wrap=True)
    for row in sessions["data"]:
        last = row.get("last_break")
        table.add_row(
            plain(row["key"]),
            plain(row["rank"] or "—"),
            num(row["turns"]),
            num(row["context_tokens"]),
            pct(row["hit_rate"]),
            Text(plain(f"{last['cause']} @{last['turn']}").plain, style="red")
            if last
            else Text("—", style="dim"),
            idle(row["idle_s"]),
            style=None if row["active"] else "dim",
        )
    hold_widths(table, "session", width)
    return Group(Panel(head, border_style="cyan"), ranks, Text(""), adm, Text(""), table)


def hold_widths(table: Table, shrinks: str, width: int) -> None:
    """Every column but ``shrinks`` keeps the width of its widest cell; ``shrinks`` gets what is left
    of ``width`` (at least 6): on a narrow terminal the name or key shortens, with an ellipsis, and
    the figures are never cut or wrapped."""
    used = len(table.columns) - 1  # one space between columns (collapsed padding)
    shrinking = None
    for column in table.columns:
        cells = [column.header, *column.cells]
        widest = max(c.cell_len if isinstance(c, Text) else cell_len(str(c)) for c in cells)
        if column.header == shrinks:
            shrinking = column
            continue
        column.min_width = widest
        used += widest
    if shrinking is not None:
        shrinking.max_width = max(6, width - used)


class NotPrefixgate(Exception):
    """The URL answers, but not as a prefixgate does."""


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


class TopClient:
    """Fetches the two documents a frame needs."""

    def __init__(self, url: str, token: str | None, sessions: int, timeout: float = 5.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.sessions = sessions
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)

    def fetch(self) -> tuple[dict[str, Any], dict[str, Any]]:
        overview = self.client.get("/admin/overview")
        if overview.status_code == 401:
            overview.raise_for_status()
        document = _json_or_none(overview) if overview.status_code == 200 else None
        if not isinstance(document, dict) or document.get("object") != "overview":
            raise NotPrefixgate(self._not_prefixgate(overview))
        sessions = self.client.get("/admin/overview/sessions", params={"limit": self.sessions})
        sessions.raise_for_status()
        return document, sessions.json()

    def _not_prefixgate(self, answer: httpx.Response) -> str:
        """What answered instead of a prefixgate, and the likely mix-up."""
        what = f"HTTP {answer.status_code}" if answer.status_code != 200 else "something else"
        try:
            rank = self.client.get("/v1/models").status_code == 200
        except httpx.HTTPError:
            rank = False
        guess = " (it serves /v1/models: a vLLM rank?)" if rank else ""
        return (
            f"{self.url} is not a prefixgate: GET /admin/overview answered {what}{guess}; "
            "point --url at prefixgate's own address (prefixgate serve listens on port 8000 by default)"
        )

    def frame(self, width: int = 80) -> tuple[RenderableType, bool]:
        """The next frame for a ``width``-column terminal, and whether it shows data (False: it
        shows why not)."""
        try:
            overview, sessions = self.fetch()
        except NotPrefixgate as exc:
            return Text(str(exc), style="bold red"), False
        except httpx.HTTPStatusError as exc:
            hint = " (pass --admin-token)" if exc.response.status_code == 401 else ""
            return Text(f"{self.url}: HTTP {exc.response.status_code}{hint}", style="bold red"), False
        except httpx.HTTPError as exc:
            return Text(f"cannot reach {self.url}: {exc}", style="bold red"), False
        return render_frame(overview, sessions, self.url, width), True

    def close(self) -> None:
        self.client.close()


def run(args: argparse.Namespace) -> int:
    client = TopClient(args.url, args.admin_token, args.sessions)
    console = Console()
    try:
        if args.once:
            frame, ok = client.frame(console.width)
            console.print(frame)
            return 0 if ok else 1
        with Live(client.frame(console.width)[0], console=console, screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(client.frame(console.width)[0], refresh=True)
    finally:
        client.close()
