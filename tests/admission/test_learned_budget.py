"""Each rank's share of its KV cache that seats may fill, learned from whether seated sessions keep
their blocks (``proxy/admission/budget.py``): grown while they keep them and others wait, cut when
one loses them, fixed by ``--target-fraction``."""

from __future__ import annotations

import httpx
import pytest

from proxy.admission.budget import CUT, MAX_FRACTION, MIN_FRACTION, STEP, WINDOW, LearnedBudget
from proxy.config import DEFAULT_TARGET_FRACTION
from proxy.context import Expectation
from tests.admission.conftest import KV_TOKENS, Background, chat, metric, prompt_of
from tests.helpers.wait import wait_until

BLOCK = 16
PROMPT = 1000


def returned(rank: str = "r0", previous: str | None = "r0", expected: int = 960) -> Expectation:
    """A turn of ``PROMPT`` tokens on ``rank`` sharing ``expected`` tokens with its previous turn's
    prompt, which went to ``previous``."""
    return Expectation(3, expected, PROMPT, BLOCK, rank, previous)


def window(budget: LearnedBudget, *, waiting: bool = True, rank: str = "r0") -> None:
    """One decision's worth of judged returns on ``rank`` that kept their blocks."""
    for _ in range(WINDOW):
        budget.judge(rank, returned(rank, rank), PROMPT, 960, waiting)


def lose(budget: LearnedBudget, rank: str = "r0") -> None:
    """A judged return on ``rank`` one block short of its prefix."""
    budget.judge(rank, returned(rank, rank), PROMPT, 960 - BLOCK, False)


def test_kept_blocks_while_sessions_wait_grow_the_share_one_step_a_window() -> None:
    budget = LearnedBudget()
    assert budget.fraction("r0") == DEFAULT_TARGET_FRACTION
    for n in range(WINDOW - 1):
        budget.judge("r0", returned(), PROMPT, 960, wanted=n == 0)
    assert budget.fraction("r0") == DEFAULT_TARGET_FRACTION  # not before a whole window
    budget.judge("r0", returned(), PROMPT, 960, wanted=False)
    assert budget.fraction("r0") == pytest.approx(DEFAULT_TARGET_FRACTION + STEP)
    window(budget)
    assert budget.fraction("r0") == pytest.approx(DEFAULT_TARGET_FRACTION + 2 * STEP)
    assert budget.fraction("r1") == DEFAULT_TARGET_FRACTION  # per rank


def test_room_nobody_waits_for_teaches_nothing() -> None:
    budget = LearnedBudget()
    for _ in range(3):
        window(budget, waiting=False)
    assert budget.fraction("r0") == DEFAULT_TARGET_FRACTION


def test_a_seated_session_losing_blocks_cuts_the_share_at_once_once_a_window() -> None:
    budget = LearnedBudget()
    window(budget)
    grown = DEFAULT_TARGET_FRACTION + STEP
    for _ in range(WINDOW - 1):
        budget.judge("r0", returned(), PROMPT, 960, wanted=True)
    lose(budget)  # one block short, the window's last: cut now, whoever waits
    assert budget.fraction("r0") == pytest.approx(grown * CUT)
    lose(budget)  # the next window's first loss cuts again
    assert budget.fraction("r0") == pytest.approx(grown * CUT * CUT)
    for _ in range(WINDOW - 2):  # the same crowding: no more cuts this window
        lose(budget)
    budget.judge("r0", returned(), PROMPT, 960, wanted=True)
    assert budget.fraction("r0") == pytest.approx(grown * CUT * CUT)  # nor growth at its end
    window(budget)
    assert budget.fraction("r0") == pytest.approx(grown * CUT * CUT + STEP)


def test_a_rank_preempting_running_requests_cuts_its_share() -> None:
    budget = LearnedBudget()
    budget.preempted("r0", 3.0)  # the first scrape: a baseline, nothing since
    budget.preempted("r0", 3.0)
    budget.preempted("r0", None)  # a rank that does not export the counter
    assert budget.fraction("r0") == DEFAULT_TARGET_FRACTION
    budget.preempted("r0", 5.0)
    assert budget.fraction("r0") == pytest.approx(DEFAULT_TARGET_FRACTION * CUT)
    assert budget.fraction("r1") == DEFAULT_TARGET_FRACTION
    budget.preempted("r0", 6.0)  # the same window: cut once
    lose(budget)
    assert budget.fraction("r0") == pytest.approx(DEFAULT_TARGET_FRACTION * CUT)
    window(budget)  # a window without growth (the cut's), then one that may grow it
    window(budget)
    assert budget.fraction("r0") == pytest.approx(DEFAULT_TARGET_FRACTION * CUT + STEP)


def test_the_share_stays_within_its_bounds() -> None:
    budget = LearnedBudget()
    for _ in range(100):
        lose(budget)
        for _ in range(WINDOW - 1):
            budget.judge("r0", returned(), PROMPT, 960, wanted=True)
    assert budget.fraction("r0") == MIN_FRACTION
    for _ in range(100):
        window(budget)
    assert budget.fraction("r0") == MAX_FRACTION


def test_only_a_return_extending_its_turn_on_the_same_rank_is_judged() -> None:
    budget = LearnedBudget()
    for _ in range(WINDOW):
        budget.judge("r0", returned(previous="r1"), PROMPT, 0, True)  # moved: lost by the move
        budget.judge("r0", returned(rank="r1"), PROMPT, 0, True)  # answered elsewhere than routed
        budget.judge("r0", returned(expected=0), PROMPT, 0, True)  # its prompt was rewritten
        budget.judge("r0", returned(), PROMPT + 5, 0, True)  # the rank counted another prompt
        budget.judge("r0", returned(), PROMPT, None, True)  # the rank did not say
        budget.judge("r0", None, PROMPT, 0, True)  # no previous turn
    assert budget.fraction("r0") == DEFAULT_TARGET_FRACTION


def test_a_configured_fraction_is_never_learned() -> None:
    budget = LearnedBudget(1.2)
    window(budget)
    lose(budget)
    budget.preempted("r0", 1.0)
    budget.preempted("r0", 2.0)
    assert budget.fraction("r0") == budget.fraction("r1") == 1.2


def test_a_waiter_is_seated_once_seated_sessions_show_the_pool_holds_more(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    """Two ~720-token sessions fill a 2,048-token rank's starting budget (0.8); a third waits (no
    rotation, no idling out) while the two keep returning and keep their blocks: the share grows a
    step a window until the third fits."""
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=120, session_idle_ttl=120)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    waiter = Background(lambda: chat(proxy.url, "c", 700, timeout=60))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    seated = [httpx.get(f"{proxy.url}/admin/sessions/{k}", timeout=5).json() for k in "ab"]
    rank = seated[0]["rank"]
    # c's prompt is as long as a's (the same text under another name): what its admission counts
    needs = sum(s["context_tokens"] for s in seated) + seated[0]["turns_log"][0]["prompt_tokens"]

    def share() -> float | None:
        return metric(proxy.url, "prefixgate_admission_budget_fraction", backend=rank)

    windows = 0
    while share() * KV_TOKENS < needs:  # type: ignore[operator]
        assert windows < 12, "the share never grew enough"
        assert waiter.response is None and metric(proxy.url, "prefixgate_admission_queue_depth") == 1
        for turn in range(WINDOW):
            assert chat(proxy.url, "ab"[turn % 2], 700).status_code == 200
        windows += 1
        grown = DEFAULT_TARGET_FRACTION + windows * STEP
        wait_until(lambda grown=grown: share() == pytest.approx(grown), "the share did not grow a step")
    assert windows > 0
    assert waiter.result(timeout=10).status_code == 200
    record = httpx.get(f"{proxy.url}/admin/sessions/c", timeout=5).json()["admission"]
    assert record["decision"] == "room" and record["rank"] == rank  # nobody parked or idled out for it


def test_a_rank_that_preempts_has_its_share_cut(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    """Two seated sessions decoding together outgrow a 2,048-token pool: the rank preempts one, says
    so in its ``/metrics``, and the proxy cuts the rank's share once it scrapes that."""
    # decoding at a fifth of the modelled speed (~0.6 s an answer), so the second session is admitted
    # while the first is in flight, at its prompt's size; an instant first answer would have grown
    # it to 1,111 tokens and left the second waiting for a seat
    ranks = rank_servers.sim(1, time_scale=0.2)
    proxy = gateway(ranks, admission_wait=120, session_idle_ttl=120)

    def long_answer(key: str) -> httpx.Response:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": prompt_of(key, 600)}],
            "max_tokens": 500,
        }
        return httpx.post(
            f"{proxy.url}/v1/chat/completions", json=body, headers={"x-session-id": key}, timeout=30
        )

    answers = [Background(lambda key=key: long_answer(key)) for key in "ab"]  # 2 x 1,100 > 2,048
    assert all(a.result().status_code == 200 for a in answers)
    preemptions = httpx.get(f"{ranks[0].url}/metrics", timeout=5).text
    assert "vllm:num_preemptions_total 0.0" not in preemptions  # the rank did preempt
    rank = httpx.get(f"{proxy.url}/admin/sessions/a", timeout=5).json()["rank"]
    wait_until(
        lambda: (
            metric(proxy.url, "prefixgate_admission_budget_fraction", backend=rank)
            == pytest.approx(DEFAULT_TARGET_FRACTION * CUT)
        ),
        "the share was not cut after the rank's preemption",
    )
