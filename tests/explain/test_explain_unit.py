"""The explainer's bookkeeping without servers: sessions and memory stay bounded."""

from __future__ import annotations

from array import array

from starlette.datastructures import Headers

from proxy.apis import CHAT
from proxy.apis.base import Usage
from proxy.context import Outcome, RequestContext
from proxy.explain import Explainer, Turn, extends
from proxy.explain.explainer import line_change
from proxy.state.local import SessionLocals
from tokenization.block_hash import BlockHasher
from tokenization.prompt import PromptBlocks

HASHER = BlockHasher(16)


def ctx_for(locals_: SessionLocals, session: str, tokens: list[int], system: str) -> RequestContext:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    ctx = RequestContext(CHAT, Headers({}), b"{}" * 50, body, False, "m", 0.0, session_key=session)
    ctx.local = locals_.open(session)
    ctx.prompt = body
    ctx.prompt_blocks = PromptBlocks(
        len(tokens), 16, HASHER.hash_blocks(tokens), (("system", 0, len(tokens)),), array("I", tokens)
    )
    return ctx


def test_sessions_are_bounded_by_count_and_bytes() -> None:
    # the explainer's memory of each session lives on its local state: bounded by the owner's count...
    counted = SessionLocals(max_sessions=3)
    explainer = Explainer(counted)
    for i in range(5):
        explainer.routed(ctx_for(counted, f"s{i}", list(range(64)), "a"))
    assert len(counted) == 3
    # ... and by its bytes
    budget = SessionLocals(budget_bytes=2_000)
    explainer = Explainer(budget)
    for i in range(5):
        explainer.routed(ctx_for(budget, f"s{i}", list(range(64)), "a"))
    assert budget.nbytes <= 2_000
    assert len(budget) < 5


def test_divergence_offset_inside_a_block_and_unobserved_requests_expire() -> None:
    locals_ = SessionLocals()
    explainer = Explainer(locals_)
    first = list(range(100))
    explainer.routed(ctx_for(locals_, "s", first, "old"))
    second = [*first[:37], 999, *first[38:]]
    explainer.routed(ctx_for(locals_, "s", second, "new"))
    (record,) = explainer.breaks("s")
    assert (record["token_offset"], record["block_index"], record["lost_blocks"]) == (37, 2, 4)
    assert record["cause"] == "system_edited"
    # what a routed request should hit rides on its own context: an unobserved one leaves nothing behind
    unobserved = [ctx_for(locals_, "s", second, "new") for _ in range(3)]
    for ctx in unobserved:
        explainer.routed(ctx)
    assert all(ctx.expectation is not None for ctx in unobserved)
    explainer.finished(Outcome(unobserved[-1], "r0", 200, Usage(100, 1, 0)))
    assert explainer.breaks("s")[-1]["cause"] == "evicted"


def test_extends_is_true_only_for_the_same_bytes_with_appended_messages() -> None:
    def turn(body: dict) -> Turn:
        return Turn(0, body, (), None, 0, 0, None, 0)

    old = {"model": "m", "tools": [{"a": 1, "b": 2}], "messages": [{"role": "user", "content": "x"}]}
    grown = {**old, "messages": [*old["messages"], {"role": "assistant", "content": "y"}]}
    assert extends(turn(old), turn(old)) and extends(turn(old), turn(grown))
    assert not extends(turn(grown), turn(old))  # a dropped message (compaction)
    assert not extends(turn(old), turn({**grown, "tools": [{"a": 2, "b": 2}]}))
    assert not extends(turn(old), turn({**grown, "tools": [{"b": 2, "a": 1}]}))  # key order drifts
    assert not extends(turn(old), turn({**grown, "reasoning_effort": "high"}))
    edited = {**grown, "messages": [{"role": "user", "content": "X"}, *grown["messages"][1:]]}
    assert not extends(turn(old), turn(edited))
    longer_text = {**old, "messages": [{"role": "user", "content": "xy"}]}
    assert not extends(turn(old), turn(longer_text))


def test_an_edited_lines_column_is_where_it_first_differs() -> None:
    assert line_change(1, "abcdef", "abcXef")["column"] == 3
    assert line_change(1, "abc", "abcdef")["column"] == 3  # one a prefix of the other
    assert line_change(1, "same", "same")["column"] == 4
    long = "word " * 20_000  # a prompt of one 100 kB line
    change = line_change(3, long, long[:77_777] + "X" + long[77_778:])
    assert change["column"] == 77_777 and change["old_chars"] == change["new_chars"] == 100_000
