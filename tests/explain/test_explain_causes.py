"""Each cause of a prefix break, through prefixgate to simulated vLLM ranks."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.explain.conftest import Conversation, Prefixgate, tool

BLOCK = 16


def only_break(pg: Prefixgate, response: httpx.Response) -> dict:
    breaks = pg.breaks(response)
    assert len(breaks) == 1, breaks
    return breaks[0]


def assert_where(record: dict, prev_prompt_tokens: int) -> None:
    """A break sits before the previous turn's end, in the block holding its first differing token."""
    assert 0 <= record["token_offset"] < prev_prompt_tokens
    assert record["block_index"] == record["token_offset"] // BLOCK
    assert record["lost_blocks"] >= 1


def test_turns_that_extend_the_prefix_record_nothing(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate()
    conv = Conversation("extend")
    for _ in range(4):
        response = pg.chat("s-extend", conv.turn())
    assert pg.breaks(response) == []
    assert "prefixgate_prefix_breaks_total{" not in httpx.get(pg.url + "/metrics").text


def test_system_prompt_edit_names_the_first_differing_line(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate()
    conv = Conversation("system")
    first = pg.chat("s-system", conv.turn())
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    conv.messages[0]["content"] = conv.system.replace("Rule 7: read", "Rule 7: always read")
    second = pg.chat("s-system", conv.turn())
    record = only_break(pg, second)
    assert record["cause"] == "system_edited"
    assert record["part"] == "system[0]"
    assert record["line"]["number"] == 8
    assert record["line"]["new"].startswith("Rule 7: always read")
    assert record["turn"] == 1
    assert_where(record, prompt_tokens)
    # the first 7 lines are untouched: the break is well past block 0
    assert record["block_index"] > 3
    metrics = httpx.get(pg.url + "/metrics").text
    assert 'prefixgate_prefix_breaks_total{cause="system_edited"} 1.0' in metrics


def test_tools_added_removed_changed(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate()
    conv = Conversation("tools")
    first = pg.chat("s-tools", conv.turn())
    prompt_tokens = first.json()["usage"]["prompt_tokens"]

    conv.tools.append(tool("fetch_url", "Fetches a web page and returns it as markdown."))
    record = only_break(pg, pg.chat("s-tools", conv.turn()))
    assert record["cause"] == "tools_added"
    assert record["tools"]["added"] == ["fetch_url"]
    assert_where(record, prompt_tokens)

    del conv.tools[1]
    response = pg.chat("s-tools", conv.turn())
    record = pg.breaks(response)[-1]
    assert record["cause"] == "tools_removed"
    assert record["tools"]["removed"] == ["write_file"]
    assert record["part"] == "tool[1]:run_tests"

    conv.tools[0]["function"]["description"] += " Binary files are refused."
    response = pg.chat("s-tools", conv.turn())
    record = pg.breaks(response)[-1]
    assert record["cause"] == "tools_changed"
    assert record["tools"]["changed"] == ["read_file"]
    assert [b["cause"] for b in pg.breaks(response)] == ["tools_added", "tools_removed", "tools_changed"]


def test_reordered_tools_are_reported_only_without_canonicalization(
    prefixgate: Callable[..., Prefixgate],
) -> None:
    pg = prefixgate()
    canon = Conversation("reorder-canon")
    pg.chat("s-reorder-canon", canon.turn())
    canon.tools.reverse()
    # canonicalization restores the session's first-seen order: no drift remains to report
    assert pg.breaks(pg.chat("s-reorder-canon", canon.turn())) == []

    raw = Conversation("reorder-raw")
    off = {"x-prefixgate-canonicalize": "off"}
    pg.chat("s-reorder-raw", raw.turn(), **off)
    raw.tools.reverse()
    record = only_break(pg, pg.chat("s-reorder-raw", raw.turn(), **off))
    assert record["cause"] == "tools_reordered"
    assert record["part"] == "tool[0]:search"


def test_history_edited_and_dropped(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate()
    conv = Conversation("history")
    for _ in range(3):
        pg.chat("s-history", conv.turn("Please look at the failing test in tests/test_db.py\nand fix it."))
    conv.messages[3]["content"] = "Please look at the failing test in tests/test_db.py\nand fix it now."
    response = pg.chat("s-history", conv.turn())
    record = only_break(pg, response)
    assert record["cause"] == "history_edited"
    assert record["message"] == {"index": 3, "role": "user"}
    assert record["part"] == "message[3]"
    assert record["line"]["number"] == 2

    # compaction: the history is replaced by a summary
    conv.messages = [conv.messages[0], {"role": "user", "content": "Summary: the db tests pass now."}]
    response = pg.chat("s-history", conv.turn())
    record = pg.breaks(response)[-1]
    assert record["cause"] == "history_dropped"
    assert record["message"]["index"] == 1
    assert record["block_index"] * BLOCK <= record["token_offset"]


def test_session_moved_to_another_rank(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate(ranks=2, retries=1)
    conv = Conversation("moved")
    first = pg.chat("s-moved", conv.turn())
    home = first.headers["x-prefixgate-backend"]
    pg.rank(home).set_faults(error_rate=1.0)
    try:
        second = pg.chat("s-moved", conv.turn())
    finally:
        pg.rank(home).clear_faults()
    assert second.headers["x-prefixgate-backend"] != home
    record = only_break(pg, second)
    assert record["cause"] == "moved"
    assert record["previous_backend"] == home
    assert record["backend"] == second.headers["x-prefixgate-backend"]
    assert record["cached_tokens"] == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert record["expected_cached_tokens"] >= first.json()["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK


def test_evicted_from_the_ranks_pool(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate(ranks=1)
    conv = Conversation("evicted")
    first = pg.chat("s-evicted", conv.turn())
    rank = pg.rank(first.headers["x-prefixgate-backend"])
    assert httpx.post(rank.url + "/sim/reset").json() == {"reset": True}
    second = pg.chat("s-evicted", conv.turn())
    record = only_break(pg, second)
    assert record["cause"] == "evicted"
    assert record["cached_tokens"] == 0
    assert record["block_index"] == 0
    assert record["lost_blocks"] == first.json()["usage"]["prompt_tokens"] // BLOCK
    # the turn after: the rank holds the prefix again, nothing more to report
    third = pg.chat("s-evicted", conv.turn())
    assert len(pg.breaks(third)) == 1


def test_breaks_are_listed_by_the_admin_session_endpoint(prefixgate: Callable[..., Prefixgate]) -> None:
    pg = prefixgate()
    conv = Conversation("admin")
    off = {"x-prefixgate-canonicalize": "off"}
    pg.chat("s-admin", conv.turn(), **off)
    conv.tools.reverse()
    second = pg.chat("s-admin", conv.turn(), **off)
    key = second.headers["x-prefixgate-session"]
    shown = httpx.get(f"{pg.url}/admin/sessions/{key}", timeout=5.0)
    assert shown.status_code == 200, shown.text
    breaks = shown.json()["breaks"]
    assert [b["cause"] for b in breaks] == ["tools_reordered"]
    assert breaks[0] == pg.breaks(second)[0]
