"""The systems a benchmark compares, each in front of a fresh simulated fleet in its own process.

``SimFleetProcess`` runs K simulated ranks (``prefixgate sim --ranks K``) in a subprocess and reads
their ``/metrics`` (prefix cache hits and queries, preemptions: what the ranks report, never the
proxy's estimates). ``system_under_test`` starts prefixgate (``prefixgate serve --policy P`` as a
subprocess, so its CPU time is its own) or a peer router; ``ProcessCpu`` measures a process's CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.common import free_port_run, metric_totals, stop_process, wait_until_up
from bench.peers import PEERS, PeerRouter, PeerSpec
from bench.sim import DEFAULT_KV_TOKENS, DEFAULT_MODEL, DEFAULT_PREFILL_RATE
from proxy.server import free_port

#: Counters summed over the fleet (Prometheus exposes counters with a ``_total`` suffix).
FLEET_COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    # The ranks' own time to first token (arrival at the rank to its first token), against which a
    # client's TTFT shows what the proxy in front added.
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    # With a CPU tier (``bench --cpu-tier``): tokens loaded back from it, and prompts sent away from
    # a rank holding more of them there (``bench/sim/cpu_tier.py: passed_over_cpu_blocks``).
    "vllm:external_prefix_cache_hits",
    "prefixgate_sim:passed_over_cpu_tier",
)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    ranks: int = 4
    kv_tokens: int = DEFAULT_KV_TOKENS
    time_scale: float = 0.02
    block_size: int = 16
    model: str = DEFAULT_MODEL
    #: Prefill tokens per second of each rank (before ``time_scale``): its compute speed.
    prefill_rate: float = DEFAULT_PREFILL_RATE
    #: Each rank publishes KV events (ZMQ, a free port each, named by its ``/kv_event_sources``).
    kv_events: bool = False
    #: Sequences a rank runs at once (vLLM's ``--max-num-seqs``): its seats.
    max_num_seqs: int = 256
    #: Streams tell when the rank got the request and first scheduled it (``sim --report-timing``).
    report_timing: bool = False
    #: Each rank's CPU tier (KV offloading, ``sim --cpu-tier-tokens``): 0 for none.
    cpu_tier_tokens: int = 0
    #: Tokens per (modelled) second the ranks load back from their CPU tier (``sim --cpu-load-rate``).
    cpu_load_rate: float = 0.0


#: Tries to start a server whose port another process took between its choice and its bind.
START_ATTEMPTS = 3
#: ``prefixgate serve``'s exit status for a configuration it refuses, a port in use among them.
EXIT_CONFIG = 2


def _came_up(proc: subprocess.Popen[bytes], urls: Sequence[str], timeout: float = 30.0) -> bool:
    """Whether every one of ``urls`` answers ``/health`` within ``timeout``; False at once when
    ``proc`` exits."""
    deadline = time.monotonic() + timeout
    try:
        for url in urls:
            wait_until_up(url + "/health", deadline - time.monotonic(), proc)
    except TimeoutError:
        return False
    return True


class SimFleetProcess:
    """``ranks`` simulated vLLM ranks in one subprocess on consecutive loopback ports."""

    def __init__(self, config: FleetConfig, log: Path | None = None) -> None:
        self.config = config
        self.base_port = free_port_run(config.ranks)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base_port + i}" for i in range(self.config.ranks)]

    def start(self) -> SimFleetProcess:
        """Start the ranks; on a fresh run of ports again when one was taken before they bound it (the
        ports are free when chosen, but another process's outgoing connection may take one of them
        from the same ephemeral range before the fleet listens)."""
        for attempt in range(START_ATTEMPTS):
            if attempt:
                self.base_port = free_port_run(self.config.ranks)
            self._spawn()
            assert self.proc is not None
            if _came_up(self.proc, self.urls):
                return self
            lost = self.proc.poll() is not None  # exited: a port was taken
            self.stop()
            if not lost:
                break
        raise RuntimeError("the simulated fleet did not start")

    def _spawn(self) -> None:
        c = self.config
        args = [sys.executable, "-m", "proxy.cli", "sim", "--host", "127.0.0.1"]
        args += ["--ranks", str(c.ranks), "--base-port", str(self.base_port)]
        args += ["--kv-tokens", str(c.kv_tokens), "--time-scale", str(c.time_scale)]
        args += ["--block-size", str(c.block_size), "--model", c.model]
        args += ["--prefill-rate", str(c.prefill_rate), "--max-num-seqs", str(c.max_num_seqs)]
        if c.report_timing:
            args += ["--report-timing"]
        if c.kv_events:
            args += ["--kv-events"]
        if c.cpu_tier_tokens:
            args += ["--cpu-tier-tokens", str(c.cpu_tier_tokens), "--cpu-load-rate", str(c.cpu_load_rate)]
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "ab") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        else:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """The fleet's counters (``FLEET_COUNTERS``, suffix-free names) summed over its ranks."""
        totals = dict.fromkeys(FLEET_COUNTERS, 0.0)
        for url in self.urls:
            for name, value in metric_totals(url, FLEET_COUNTERS).items():
                totals[name] += value
        return totals

    def __enter__(self) -> SimFleetProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ProcessCpu:
    """CPU seconds (user + system) a process used between ``start()`` and ``stop()``."""

    def __init__(self, pid: int | None) -> None:
        self.process = psutil.Process(pid) if pid else None
        self._start = 0.0
        self.seconds: float | None = None

    def _now(self) -> float:
        assert self.process is not None
        times = self.process.cpu_times()  # every thread's, from the OS
        return times.user + times.system

    def start(self) -> None:
        if self.process is not None:
            self._start = self._now()

    def stop(self) -> None:
        if self.process is not None:
            self.seconds = self._now() - self._start


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system of a comparison: prefixgate with a policy, or a peer router."""

    name: str
    kind: str  # "prefixgate" or "peer"
    policy: str
    peer: PeerSpec | None = None
    #: Extra ``prefixgate serve`` flags of this system (after the run's own ``--prefixgate-args``).
    args: tuple[str, ...] = ()
    #: The source tree this system's prefixgate runs from (None: this one): another commit's
    #: worktree, side by side with this one in the same run.
    root: Path | None = None


#: What a fleet has without prefixgate: requests dealt out in turn by a plain load balancer, no
#: session state, no admission, prompts untouched. Run through prefixgate's proxy with every stage
#: off (it only forwards), so it needs nothing installed; the baseline of "prefill / RR".
PLAIN_ROUND_ROBIN = SystemSpec(
    "plain round_robin", "prefixgate", "round_robin", args=("--no-admission", "--no-canonicalize")
)


def prefixgate_systems(policies: Sequence[str]) -> list[SystemSpec]:
    return [SystemSpec(f"prefixgate {p}", "prefixgate", p) for p in policies]


def peer_systems() -> list[SystemSpec]:
    return [SystemSpec(p.name, "peer", p.policy, p) for p in PEERS]


@dataclass
class RunningSystem:
    url: str
    pid: int | None


def log_name(system: str) -> str:
    """A system's log file name: its name with anything but letters, digits, ``.``, ``_`` and ``-``
    as ``_`` (a system's serve flags may hold paths, ``prefixgate:prefix_affinity:--config a/b.yaml``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", system) + ".log"


@contextmanager
def system_under_test(
    spec: SystemSpec,
    rank_urls: Sequence[str],
    log_dir: Path,
    prefixgate_args: Sequence[str] = (),
) -> Iterator[RunningSystem]:
    """Start ``spec`` in front of ``rank_urls``; yields its URL and PID; stops it on exit.

    Output goes to a log file per system under ``log_dir`` (a pipe nobody reads could fill up and
    stall the process under test).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / log_name(spec.name)
    if spec.kind == "prefixgate":
        args = [*prefixgate_args, *spec.args]
        with _prefixgate(spec.policy, rank_urls, log, args, spec.root) as running:
            yield running
        return
    assert spec.peer is not None
    with PeerRouter(spec.peer, rank_urls, log=log) as router:
        yield RunningSystem(router.url, router.pid)


@contextmanager
def _prefixgate(
    policy: str,
    rank_urls: Sequence[str],
    log: Path,
    extra: Sequence[str],
    root: Path | None,
) -> Iterator[RunningSystem]:
    flags = ["--policy", policy, "--log-level", "warning"]
    for i, url in enumerate(rank_urls):
        flags += ["--backend", f"sim-{i}={url}"]
    flags += list(extra)
    env = {**os.environ, "PYTHONPATH": str(root)} if root is not None else None
    with open(log, "ab") as out:
        for _ in range(START_ATTEMPTS):  # again on another port when the chosen one was taken meanwhile
            port = free_port()
            args = [sys.executable, "-m", "proxy.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(args + flags, stdout=out, stderr=subprocess.STDOUT, cwd=root, env=env)
            up = _came_up(proc, [f"http://127.0.0.1:{port}"])
            if up or proc.poll() != EXIT_CONFIG:  # exit 2 at start: the port in use, or a wrong flag
                break
        url = f"http://127.0.0.1:{port}"
        try:
            if not up:
                how = "exited on start" if proc.poll() is not None else "did not start"
                raise RuntimeError(f"prefixgate --policy {policy} {how} (log: {log})")
            yield RunningSystem(url, proc.pid)
        finally:
            stop_process(proc)
