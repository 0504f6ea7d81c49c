"""``prefixgate sim``: run simulated vLLM ranks until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import replace

from bench.sim.config import DEFAULT_KV_TOKENS, DEFAULT_MODEL, FaultConfig, SimConfig
from bench.sim.runner import SimRankServer, start_fleet, stop_fleet
from proxy.server import tune_collector

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
        "--hash-seed",
        default=None,
        help="NONE_HASH seed (default: PYTHONHASHSEED, else vLLM's 'vllm-none-hash')",
    )
    g = parser.add_argument_group("scheduling and timing")
    _opt(g, "--max-num-seqs", int, _D.max_num_seqs, "running sequences")
    _opt(g, "--max-model-len", int, _D.max_model_len, "context length")
    _opt(g, "--time-scale", float, _D.time_scale, "multiplies every modelled duration")
    _opt(g, "--prefill-rate", float, _D.prefill_rate, "prefill tokens/s")
    _opt(g, "--max-tokens", int, _D.default_max_tokens, "default max_tokens")
    g = parser.add_argument_group("reporting")
    g.add_argument("--kv-events", action="store_true", help="publish KV cache events over ZMQ")
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
    g = parser.add_argument_group("faults (the others are set at run time: POST /sim/faults)")
    g.add_argument(
        "--fault-error-rate", type=float, default=0.0, help="fraction of requests answered HTTP 500"
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
        max_model_len=args.max_model_len,
        hash_seed=args.hash_seed,
        time_scale=args.time_scale,
        prefill_rate=args.prefill_rate,
        default_max_tokens=args.max_tokens,
        kv_events=args.kv_events,
        scripted_tool_calls=args.scripted_tools,
        scripted_subagents=args.scripted_subagents,
        record_path=args.record,
        report_timing=args.report_timing,
        faults=FaultConfig(error_rate=args.fault_error_rate),
    )


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
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in servers:
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
        while not stop.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_fleet(servers)
    return 0
