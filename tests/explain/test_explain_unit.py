"""The explainer's bookkeeping without servers: sessions and memory stay bounded."""

from __future__ import annotations

from array import array

from starlette.datastructures import Headers

from proxy.context import ApiKind, RequestContext
from proxy.explain import Explainer
from tokenization.block_hash import BlockHasher
from tokenization.prompt import PromptBlocks

HASHER = BlockHasher(16)


def ctx_for(session: str, tokens: list[int], system: str) -> RequestContext:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    ctx = RequestContext(ApiKind.CHAT, Headers({}), b"{}" * 50, body, False, "m", 0.0, session_key=session)
    ctx.prompt_blocks = PromptBlocks(
        len(tokens), 16, HASHER.hash_blocks(tokens), (("system", 0, len(tokens)),), array("I", tokens)
    )
    return ctx


def test_sessions_are_bounded_by_count_and_bytes() -> None:
    explainer = Explainer(capacity=3)
    for i in range(5):
        explainer.after_route(ctx_for(f"s{i}", list(range(64)), "a"))
    assert len(explainer._sessions) == 3
    budget = Explainer(budget_bytes=2_000)
    for i in range(5):
        budget.after_route(ctx_for(f"s{i}", list(range(64)), "a"))
    assert budget.nbytes <= 2_000
    assert len(budget._sessions) < 5


def test_divergence_offset_inside_a_block_and_unobserved_requests_expire() -> None:
    explainer = Explainer(max_pending=2)
    first = list(range(100))
    explainer.after_route(ctx_for("s", first, "old"))
    second = [*first[:37], 999, *first[38:]]
    explainer.after_route(ctx_for("s", second, "new"))
    (record,) = explainer.breaks("s")
    assert (record["token_offset"], record["block_index"], record["lost_blocks"]) == (37, 2, 4)
    assert record["cause"] == "system_edited"
    unobserved = [ctx_for("s", second, "new") for _ in range(3)]  # kept alive: distinct ids
    for ctx in unobserved:
        explainer.after_route(ctx)
    assert len(explainer._pending) == 2
    explainer.after_observe(unobserved[-1], 0, 100)
    assert explainer.breaks("s")[-1]["cause"] == "evicted"
    assert len(explainer._pending) == 1


def test_extends_is_true_only_for_the_same_bytes_with_appended_messages() -> None:
    from proxy.explain import _extends, _Turn

    def turn(body: dict) -> _Turn:
        return _Turn(0, body, (), None, 0, 0, None, 0)

    old = {"model": "m", "tools": [{"a": 1, "b": 2}], "messages": [{"role": "user", "content": "x"}]}
    grown = {**old, "messages": [*old["messages"], {"role": "assistant", "content": "y"}]}
    assert _extends(turn(old), turn(old)) and _extends(turn(old), turn(grown))
    assert not _extends(turn(grown), turn(old))  # a dropped message (compaction)
    assert not _extends(turn(old), turn({**grown, "tools": [{"a": 2, "b": 2}]}))
    assert not _extends(turn(old), turn({**grown, "tools": [{"b": 2, "a": 1}]}))  # key order drifts
    assert not _extends(turn(old), turn({**grown, "reasoning_effort": "high"}))
    edited = {**grown, "messages": [{"role": "user", "content": "X"}, *grown["messages"][1:]]}
    assert not _extends(turn(old), turn(edited))
    longer_text = {**old, "messages": [{"role": "user", "content": "xy"}]}
    assert not _extends(turn(old), turn(longer_text))
