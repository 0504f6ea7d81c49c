"""A simulated vLLM rank that behaves like vLLM where prefixgate cares (issue 3).

What it reproduces: the simulated model's tokenizer and chat template
(``tokenization.tiktoken_tokenizer``: cl100k_base), vLLM's chained block hashes, the block pool
(free queue, ref counts, LRU eviction tail block first, no de-duplication), continuous batching with
chunked prefill and preemption, the OpenAI-shaped responses with ``cached_tokens``, ``/metrics``
with vLLM's names, KV-cache events over ZMQ (0.33 and 0.11 payloads) and fault injection. Timing
defaults model an H100-class rank serving an ~8B model (``bench/sim/config.py``); ``time_scale``
shrinks every modelled duration.

Python API::

    from bench.sim import SimConfig, SimRankServer, start_fleet, stop_fleet

    cfg = SimConfig(kv_tokens=16_384, time_scale=0.01, kv_events=True)
    with SimRankServer(cfg) as rank:          # start() in a background thread, stop() on exit
        rank.url                              # "http://127.0.0.1:PORT"
        rank.name                             # "sim-0"
        rank.kv_events_endpoint               # "tcp://127.0.0.1:PORT" (PUB) or None
        rank.kv_replay_endpoint               # "tcp://127.0.0.1:PORT" (ROUTER) or None
        rank.set_faults(error_rate=0.5)       # see FaultConfig; rank.clear_faults()
        rank.rank.counters.prefix_cache_hits  # in-process state: .engine, .pool, .counters, .processor
        rank.call(lambda r: r.pool.free_queue_ids())  # run on the server's loop (race-free)

    fleet = start_fleet(4, cfg)               # names sim-0..sim-3, each on its own free port
    stop_fleet(fleet)

    engine = Engine(cfg)                      # the scheduler alone, stepped by hand (no HTTP)
    PromptProcessor(engine.hasher).chat(...)  # a chat request's Prompt as the rank tokenizes and hashes it

This package imports nothing else of ``bench/``; the demo, the benchmarks and the tests outside
``tests/sim`` use it through these names (``tests/sim`` tests its modules one by one).

HTTP: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``, ``/version``,
``/tokenize``, ``/detokenize``, ``/metrics``, ``/kv_event_sources``, ``/server_info``, ``/model_info``,
and the controls ``POST /sim/faults`` (JSON knobs), ``POST /sim/reset`` (clear the prefix cache,
409 while requests hold blocks), ``GET /sim/state``.

CLI: ``prefixgate sim --port P`` or ``prefixgate sim --ranks 4 --base-port P`` (``bench/sim/cli.py``).
"""

from bench.sim.cli import DEFAULT_SIM_PORT
from bench.sim.config import DEFAULT_KV_TOKENS, DEFAULT_MODEL, DEFAULT_PREFILL_RATE, FaultConfig, SimConfig
from bench.sim.prompts import Prompt, PromptProcessor
from bench.sim.rank import SimRank
from bench.sim.runner import SimRankServer, start_fleet, stop_fleet
from bench.sim.scheduler import Engine

__all__ = [
    "DEFAULT_KV_TOKENS",
    "DEFAULT_MODEL",
    "DEFAULT_PREFILL_RATE",
    "DEFAULT_SIM_PORT",
    "Engine",
    "FaultConfig",
    "Prompt",
    "PromptProcessor",
    "SimConfig",
    "SimRank",
    "SimRankServer",
    "start_fleet",
    "stop_fleet",
]
