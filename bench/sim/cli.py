"""``prefixgate sim``: run simulated vLLM ranks until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace

from bench.sim.config import DEFAULT_KV_TOKENS, DEFAULT_MODEL, FaultConfig, SimConfig
from bench.sim.runner import SimRankServer, start_fleet, stop_fleet
from proxy.server import tune_collector
from tokenization.block_hash import HashAlgo

_D = SimConfig()
DEFAULT_SIM_PORT = 8001


def _opt(group: argparse._ArgumentGroup, flag: str, kind: type, default: object, help: str) -> None:
    """A typed flag whose help ends with its default."""
    group.add_argument(flag, type=kind, default=default, help=f"{help} (default %(default)s)")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``sim`` command's flags to ``parser``."""
    parser.description = (
        "Run simulated vLLM ranks (prefix cache, block pool, continuous batching, KV events, faults). "
        "Default timing models one H100-class rank serving an ~8B model: prefill 20,000 tokens/s, "
        "decode step 6 ms + 0.08 ms per running sequence + 40 ns per context token, "
        "max 256 sequences, 8,192 batched tokens per step, KV pool of 181,777 tokens."
    )
    g = parser.add_argument_group("serving")
    _opt(g, "--host", str, _D.host, "address to listen on")
    # not prefixgate serve's 8000: both run side by side on one machine in the quickstart
    _opt(g, "--port", int, DEFAULT_SIM_PORT, "port of a single rank; 0 = a free port")
    _opt(g, "--ranks", int, 1, "number of ranks in this process")
    g.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="with --ranks N: rank i listens on BASE_PORT+i (default: --port)",
    )
    g.add_argument("--name", default=None, help="rank name (single rank; default sim-0, fleets use sim-0..)")
    _opt(g, "--model", str, DEFAULT_MODEL, "served model name")
    _opt(g, "--keep-alive", float, _D.keep_alive_s, "seconds an idle HTTP connection stays open (uvicorn's)")
    g = parser.add_argument_group("KV cache")
    _opt(g, "--block-size", int, _D.block_size, "tokens per KV block")
    _opt(g, "--kv-tokens", int, DEFAULT_KV_TOKENS, "KV pool size in tokens")
    g.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-tokens)"
    )
    _opt(
        g,
        "--cpu-tier-tokens",
        int,
        _D.cpu_tier_tokens,
        "CPU tier (KV offloading to host memory) in tokens: blocks evicted from the KV pool go there, "
        "least recently used out first, and a prompt whose prefix continues there loads them back "
        "(reported in cached_tokens; KV events with medium CPU); 0 = no tier",
    )
    _opt(
        g,
        "--cpu-load-rate",
        float,
        _D.cpu_load_rate,
        "tokens/s a prompt's CPU-tier blocks load back at, instead of being prefilled (scaled by "
        "--time-scale like every modelled time); 0 = loading takes no time",
    )
    g.add_argument(
        "--hash-algo",
        choices=[a.value for a in HashAlgo],
        default=_D.hash_algo,
        help="block hash (default %(default)s)",
    )
    g.add_argument(
        "--hash-seed",
        default=None,
        help="NONE_HASH seed (default: PYTHONHASHSEED, else vLLM's 'vllm-none-hash')",
    )
    g = parser.add_argument_group("scheduling and timing")
    _opt(g, "--max-num-seqs", int, _D.max_num_seqs, "running sequences")
    _opt(g, "--max-num-batched-tokens", int, _D.max_num_batched_tokens, "tokens per step")
    _opt(g, "--max-model-len", int, _D.max_model_len, "context length")
    _opt(g, "--time-scale", float, _D.time_scale, "multiplies every modelled duration")
    _opt(g, "--prefill-rate", float, _D.prefill_rate, "prefill tokens/s")
    _opt(g, "--decode-base-ms", float, _D.decode_base_s * 1e3, "decode step ms")
    _opt(g, "--decode-per-seq-ms", float, _D.decode_per_seq_s * 1e3, "ms per running seq")
    _opt(
        g,
        "--decode-per-context-token-ns",
        float,
        _D.decode_per_context_token_s * 1e9,
        "ns per context token in a decode step",
    )
    _opt(g, "--max-tokens", int, _D.default_max_tokens, "default max_tokens")
    g = parser.add_argument_group("reporting")
    g.add_argument("--kv-events", action="store_true", help="publish KV cache events over ZMQ")
    g.add_argument(
        "--kv-events-version",
        choices=["0.33", "0.11"],
        default="0.33",
        help="payload shape (default %(default)s)",
    )
    g.add_argument(
        "--kv-events-port", type=int, default=0, help="PUB port; 0 = free port; fleets add the index"
    )
    g.add_argument(
        "--kv-replay-port",
        type=int,
        default=0,
        help="replay ROUTER port; 0 = free port; fleets add the index",
    )
    g.add_argument("--kv-events-topic", default="kv", help="ZMQ topic (default %(default)s)")
    g.add_argument(
        "--no-prompt-tokens-details",
        action="store_true",
        help="omit usage.prompt_tokens_details (vLLM without --enable-prompt-tokens-details)",
    )
    g.add_argument("--force-include-usage", action="store_true", help="usage chunk in every stream")
    g.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="append every POST request (path, headers, body) to FILE",
    )
    g.add_argument(
        "--report-timing",
        action="store_true",
        help="a stream's usage chunk also carries sim_timing: the wall-clock times the request reached "
        "the rank and was first scheduled (for a benchmark's seat wait)",
    )
    g = parser.add_argument_group("agents")
    _opt(
        g,
        "--scripted-tools",
        int,
        0,
        "scripted-tool mode: answer with this many calls to the request's shell tool per user turn, "
        "then a final text; 0 = off",
    )
    g.add_argument(
        "--scripted-subagents",
        action="store_true",
        help="scripted-tool mode: a conversation offering a sub-agent tool (Agent, task) calls it once first",
    )
    g = parser.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    g.add_argument(
        "--fault-latency", type=float, default=0.0, help="seconds added before each inference request"
    )
    g.add_argument(
        "--fault-error-rate", type=float, default=0.0, help="fraction of requests answered HTTP 500"
    )
    g.add_argument("--fault-die-after-chunks", type=int, default=None, help="drop streams after N SSE chunks")
    g.add_argument("--fault-refuse", action="store_true", help="start refusing connections")
    g.add_argument(
        "--fault-refuse-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --fault-refuse: listen again after this many seconds (default: refuse until stopped)",
    )
    g.add_argument(
        "--fault-malformed-sse", action="store_true", help="emit a malformed SSE line in each stream"
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` the flags describe (port = --base-port or --port)."""
    base_port = args.base_port if args.base_port is not None else args.port
    return SimConfig(
        name=args.name or "sim-0",
        host=args.host,
        port=base_port,
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_tokens=args.kv_tokens,
        cpu_tier_tokens=args.cpu_tier_tokens,
        cpu_load_rate=args.cpu_load_rate,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
        time_scale=args.time_scale,
        prefill_rate=args.prefill_rate,
        decode_base_s=args.decode_base_ms / 1e3,
        decode_per_seq_s=args.decode_per_seq_ms / 1e3,
        decode_per_context_token_s=args.decode_per_context_token_ns / 1e9,
        default_max_tokens=args.max_tokens,
        kv_events=args.kv_events,
        kv_events_version=args.kv_events_version,
        kv_events_topic=args.kv_events_topic,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        enable_prompt_tokens_details=not args.no_prompt_tokens_details,
        force_include_usage=args.force_include_usage,
        keep_alive_s=args.keep_alive,
        scripted_tool_calls=args.scripted_tools,
        scripted_subagents=args.scripted_subagents,
        record_path=args.record,
        report_timing=args.report_timing,
        faults=FaultConfig(
            latency_s=args.fault_latency,
            error_rate=args.fault_error_rate,
            die_after_chunks=args.fault_die_after_chunks,
            refuse_connections=False,  # applied after start: the rank must bind its port first
            malformed_sse=args.fault_malformed_sse,
        ),
    )


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived: leave the serving loop."""


def run(args: argparse.Namespace) -> int:
    """Start the ranks, print one JSON line per rank, serve until SIGINT/SIGTERM."""
    config = config_from_args(args)
    if args.ranks < 1:
        print("--ranks must be >= 1")
        return 2
    if args.ranks == 1:
        servers = [SimRankServer(config).start()]
    else:
        servers = start_fleet(args.ranks, replace(config, name="sim-0"))
    tune_collector()  # a process of its own serving requests, like prefixgate serve (proxy/server.py)

    # The handler raises rather than set a threading.Event: Event.set() takes the lock that the main
    # thread holds inside Event.wait(), and a signal landing there deadlocked the stop (seen once in CI).
    def on_signal(signum: int, frame: object) -> None:
        raise _Stopped

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in servers:
            if args.fault_refuse:
                s.set_faults(refuse_connections=True, refuse_for_s=args.fault_refuse_for)
            info = {
                "name": s.name,
                "url": s.url,
                "kv_events": s.kv_events_endpoint,
                "kv_replay": s.kv_replay_endpoint,
            }
            print(json.dumps(info), flush=True)
        # stdout stays one JSON line per rank; what to run next goes to stderr, names included (an
        # unnamed --backend would be called rank-N, not the sim-N its rank reports)
        backends = " ".join(f"--backend {s.name}={s.url}" for s in servers)
        print(
            f"prefixgate sim: {len(servers)} rank(s) up; in front: prefixgate serve {backends}",
            file=sys.stderr,
        )
        while True:
            signal.pause()
    except _Stopped:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_fleet(servers)
    return 0
