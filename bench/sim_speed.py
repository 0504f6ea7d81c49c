"""How many 100k-token requests per second one simulated rank can account for on this machine.

Two measurements, first turns (a conversation never seen: every segment encoded, every block hashed)
and follow-up turns (the previous turn seen: only the new messages encoded and hashed):
- ``engine``: in process, PromptProcessor + scheduler steps, no HTTP;
- ``http``: through the rank's HTTP API with ``time_scale=0`` (JSON parse, template, engine, response).
The modelled GPU time of the same request on the default H100 profile gives the rank's real rate; the
sim is a bottleneck of a proxy benchmark when its CPU time per request exceeds the modelled time x
``time_scale``. Prints a table and writes ``bench/out/sim_speed.json``.

    python bench/sim_speed.py [--prompt-tokens 100000] [--conversations 3] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.sim import SimConfig, SimRankServer  # noqa: E402
from bench.sim.rank import SimRank  # noqa: E402
from bench.sim.scheduler import Engine  # noqa: E402
from tokenization.encoding import encode  # noqa: E402

OUT = ROOT / "bench" / "out" / "sim_speed.json"


def _text(rng: random.Random, n_words: int) -> str:
    vocab = ["def", "return", "self", "import", "class", "value", "error", "file", "path", "test", "data"]
    vocab += [f"name{i}" for i in range(300)]
    return " ".join(rng.choice(vocab) for _ in range(n_words))


def conversation(seed: int, prompt_tokens: int, turn_tokens: int = 1500) -> list[dict[str, Any]]:
    """A conversation of about ``prompt_tokens`` tokens: a big system prompt and many turns."""
    rng = random.Random(seed)
    system = f"session {seed}\n" + _text(rng, prompt_tokens // 10)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    total = len(encode(system))
    while total < prompt_tokens:
        user = _text(rng, turn_tokens // 2)
        reply = _text(rng, turn_tokens // 6)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        total += len(encode(user)) + len(encode(reply)) + 10
    messages.append({"role": "user", "content": "next?"})
    return messages


def follow_ups(messages: list[dict[str, Any]], turns: int, seed: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    cur = list(messages)
    for _ in range(turns):
        cur = [
            *cur,
            {"role": "assistant", "content": _text(rng, 60)},
            {"role": "user", "content": _text(rng, 400)},
        ]
        out.append(cur)
    return out


def bench_engine(convs: list[list[dict[str, Any]]], turns: int) -> dict[str, Any]:
    import asyncio

    async def run() -> dict[str, Any]:
        rank = SimRank(SimConfig(time_scale=0))
        engine: Engine = rank.engine
        first: list[float] = []
        follow: list[float] = []
        tokens: list[int] = []
        model_first: list[float] = []
        model_follow: list[float] = []

        def one(messages: list[dict[str, Any]], times: list[float], model: list[float]) -> None:
            t0 = time.perf_counter()
            prompt = rank.processor.chat(messages)
            engine.submit(prompt, 16)
            modelled = 0.0
            while engine.running or engine.waiting:
                plan = engine.schedule()
                modelled += engine.step_time(plan)
                engine.update(plan)
            times.append(time.perf_counter() - t0)
            model.append(modelled)
            tokens.append(len(prompt.token_ids))

        for i, conv in enumerate(convs):
            one(conv, first, model_first)
            for msgs in follow_ups(conv, turns, seed=i):
                one(msgs, follow, model_follow)
        return {
            "first_s": first,
            "follow_s": follow,
            "model_first_s": model_first,
            "model_follow_s": model_follow,
            "tokens": tokens,
        }

    return asyncio.run(run())


def bench_http(convs: list[list[dict[str, Any]]], turns: int) -> dict[str, Any]:
    first: list[float] = []
    follow: list[float] = []
    follow_cached: list[int] = []
    with SimRankServer(SimConfig(time_scale=0)) as sim, httpx.Client(base_url=sim.url, timeout=60) as client:

        def one(messages: list[dict[str, Any]], times: list[float]) -> None:
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
            if times is follow:
                follow_cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        for i, conv in enumerate(convs):
            one(conv, first)
            for msgs in follow_ups(conv, turns, seed=i):
                one(msgs, follow)
    return {"first_s": first, "follow_s": follow, "follow_cached": follow_cached}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=100_000)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4, help="follow-up turns per conversation")
    args = ap.parse_args(argv)

    convs = [conversation(1000 + i, args.prompt_tokens) for i in range(args.conversations)]
    eng = bench_engine(convs, args.turns)
    http = bench_http(convs, args.turns)

    def rate(xs: list[float]) -> float:
        return 1.0 / statistics.mean(xs)

    rows = [
        ("engine", "first turn", eng["first_s"], eng["model_first_s"]),
        ("engine", "follow-up", eng["follow_s"], eng["model_follow_s"]),
        ("http", "first turn", http["first_s"], eng["model_first_s"]),
        ("http", "follow-up", http["follow_s"], eng["model_follow_s"]),
    ]
    print(
        f"prompt ~{statistics.mean(eng['tokens']):,.0f} tokens, "
        f"{args.conversations} conversations x {args.turns} follow-ups"
    )
    print(
        f"{'path':<7} {'turn':<11} {'req/s':>8} {'ms/req':>8} {'p max ms':>9} "
        f"{'model ms (H100)':>16} {'min time_scale':>15}"
    )
    result: dict[str, Any] = {"prompt_tokens_mean": statistics.mean(eng["tokens"]), "rows": []}
    bottleneck = False
    for path, turn, times, model in rows:
        cpu = statistics.mean(times)
        modelled = statistics.mean(model)
        min_scale = cpu / modelled
        print(
            f"{path:<7} {turn:<11} {rate(times):>8.1f} {cpu * 1e3:>8.1f} {max(times) * 1e3:>9.1f} "
            f"{modelled * 1e3:>16.1f} {min_scale:>15.4f}"
        )
        result["rows"].append(
            {
                "path": path,
                "turn": turn,
                "req_per_s": rate(times),
                "cpu_ms": cpu * 1e3,
                "model_ms": modelled * 1e3,
                "min_time_scale": min_scale,
            }
        )
        bottleneck |= min_scale > 1
    follow_hit = http["follow_cached"]
    result["http_follow_up_cached_tokens"] = follow_hit
    print()
    print(
        "min time_scale = the sim's CPU time per request / the modelled GPU time: "
        "with a smaller --time-scale the sim, not the modelled GPU, sets the pace."
    )
    if bottleneck:
        print(
            "VERDICT: the sim is SLOWER than the real rank it models: "
            "it could be the bottleneck of a proxy benchmark."
        )
    else:
        print(
            "VERDICT: at time_scale=1 the sim is faster than the rank it models; it is not a bottleneck "
            "unless time_scale is set below the figures above (or several ranks share this 2-core machine)."
        )
    result["bottleneck_at_time_scale_1"] = bottleneck
    result["follow_up_cached_tokens_min"] = min(follow_hit) if follow_hit else None
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
