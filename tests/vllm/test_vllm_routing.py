"""prefixgate in front of two real ranks: estimated vs reported cached tokens, stickiness, canonical."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import httpx
import pytest

from proxy.server import ServerThread
from tests.helpers.real_vllm import SimpleMirror, TurnResult, agent_turns, chat, hit_tokens
from tokenization.base import ChatPrompt
from tokenization.block_hash import BlockHasher
from tokenization.hf_tokenizer import HfTokenizer

TURNS = 6
THINK_S = 0.2
BLOCK = 32


def _session(
    gw: ServerThread, client: httpx.Client, nonce: str, *, drift: bool = False
) -> list[tuple[list[dict], list[dict], TurnResult]]:
    out = []
    for messages, tools in agent_turns(nonce, TURNS, date_drift=drift):
        out.append((messages, tools, chat(client, gw.url, messages, tools, session=nonce)))
        # An agent thinks between turns. Without a pause, the next turn can be routed before
        # prefixgate's KV-event thread has applied the events of this one (they reach it with the
        # response; see docs/benchmarks.md): the estimate then trails by a turn.
        time.sleep(THINK_S)
    return out


def _check_estimates(
    turns: list[tuple[list[dict], list[dict], TurnResult]], tok: HfTokenizer, hasher: BlockHasher
) -> None:
    mirror = SimpleMirror()
    prev_tokens = 0
    for i, (messages, tools, r) in enumerate(turns):
        assert r.rank is not None and r.estimated is not None, r
        tokens = list(tok.encode_chat(ChatPrompt(messages, tools)).tokens)
        hashes = hasher.hash_blocks(tokens)
        assert r.prompt_tokens == len(tokens)
        ours = mirror.estimate(r.rank, hashes, len(tokens), hasher.block_size)
        mirror.record(r.rank, hashes)
        assert r.cached_tokens == ours, (i, r, ours)
        assert r.estimated == r.cached_tokens, (i, r)
        # Each turn extends the last: the previous prompt's full blocks hit, nothing more.
        bs = hasher.block_size
        assert r.cached_tokens == hit_tokens(prev_tokens // bs, len(tokens), bs), (i, r, prev_tokens)
        prev_tokens = len(tokens)


@pytest.mark.parametrize("kv_events", [False, True], ids=["history_index", "kv_event_index"])
def test_estimates_equal_reported_cached_tokens(
    gateway: Callable[..., ServerThread],
    client: httpx.Client,
    tok: HfTokenizer,
    hasher: BlockHasher,
    nonce: str,
    kv_events: bool,
) -> None:
    turns = _session(gateway(kv_events=kv_events), client, nonce)
    _check_estimates(turns, tok, hasher)


def test_sessions_stay_on_one_rank_and_hit_there(
    gateway: Callable[..., ServerThread], client: httpx.Client, nonce: str
) -> None:
    gw = gateway(kv_events=True)
    sessions = [f"{nonce}-{k}" for k in range(4)]
    served: dict[str, list[TurnResult]] = {s: [] for s in sessions}
    # Interleaved, as concurrent agents arrive: turn t of every session, then turn t + 1.
    plans = {s: list(agent_turns(s, 4)) for s in sessions}
    for t in range(4):
        for s in sessions:
            messages, tools = plans[s][t]
            served[s].append(chat(client, gw.url, messages, tools, session=s))
        time.sleep(THINK_S)
    for s, results in served.items():
        assert len({r.rank for r in results}) == 1, (s, results)
        assert all(r.cached_tokens > 0 for r in results[1:]), (s, results)
        if not all(r.estimated == r.cached_tokens for r in results):
            # Spelled out whole (an assertion's message is cut short by pytest): every session's
            # turns and the gateway's KV-event counters say which feed fell behind and why.
            turns = [f"{k}: {r}" for k, rs in served.items() for r in rs]
            pytest.fail("\n".join([f"estimates of {s} differ from the rank's", *turns, *_feeds(client, gw)]))


def _feeds(client: httpx.Client, gw: ServerThread) -> list[str]:
    """The gateway's KV-event counters (events applied, faults), for a failure's message."""
    text = client.get(f"{gw.url}/metrics").text
    return [line for line in text.splitlines() if line.startswith("prefixgate_kv_event")]


def test_canonicalization_turns_drift_misses_into_hits(
    gateway: Callable[..., ServerThread], client: httpx.Client, nonce: str
) -> None:
    raw = _session(gateway(kv_events=True, no_canonicalize=True), client, f"{nonce}-raw", drift=True)
    canon = _session(gateway(kv_events=True), client, f"{nonce}-canon", drift=True)
    # Without canonicalization the clock in the system prompt breaks the chain every turn: at most
    # the block before the clock line hits.
    assert all(r.cached_tokens <= BLOCK for _, _, r in raw), [r for _, _, r in raw]
    # With it, each turn's canonical prompt extends the last: all its previous full blocks hit.
    for prev, (_, _, r) in itertools.pairwise(canon):
        assert r.cached_tokens == hit_tokens(prev[2].prompt_tokens // BLOCK, r.prompt_tokens, BLOCK), r
        assert r.cached_tokens > 4 * BLOCK, r
    # And prefixgate knew it: its estimates match what the rank reported.
    assert all(r.estimated == r.cached_tokens for _, _, r in canon), [r for _, _, r in canon]
