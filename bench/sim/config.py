"""Configuration of a simulated vLLM rank.

Default timing: one H100-class rank (80 GB HBM3, ~3.3 TB/s) serving an ~8B dense model in bf16
(Llama-3-8B-like: 32 layers, 8 KV heads of 128, 128 KiB of KV per token):

| knob | default | where it comes from |
|---|---|---|
| ``prefill_rate`` | 20,000 tokens/s | ~16 GFLOP/token at ~35 % of 990 TFLOP/s, chunked prefill |
| ``decode_base_s`` | 6 ms per step | reading 16 GB of weights at ~3 TB/s, plus launch overhead |
| ``decode_per_seq_s`` | 0.08 ms per running sequence | sampling and per-sequence kernels |
| ``decode_per_context_token_s`` | 40 ns per context token | reading 128 KiB of KV per token |
| ``max_num_seqs`` | 256 | vLLM's default on H100 |
| ``max_num_batched_tokens`` | 8,192 | vLLM's chunked-prefill budget on H100 |
| ``kv_tokens`` | 181,777 tokens | measured on a real rank |
| ``cpu_tier_tokens`` | 0 (off) | KV offloading to host memory (``bench/sim/cpu_tier.py``) |
| ``cpu_load_rate`` | 0 (free) | tokens/s loaded back from the CPU tier |

A step (one forward pass of the continuous batch) costs
``prefill_tokens / prefill_rate + decode_base_s + decode_per_seq_s * seqs + decode_per_context_token_s *
context_tokens`` (the decode terms only when the step decodes), plus ``loaded_tokens / cpu_load_rate``
for prefix blocks loaded back from the CPU tier. Every duration is multiplied by
``time_scale``: 0.01 makes the rank a hundred times faster, 0 removes the model time altogether.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from tokenization.block_hash import HashAlgo, none_hash_seed

DEFAULT_KV_TOKENS = 181_777
DEFAULT_MODEL = "prefixgate-sim"
DEFAULT_PREFILL_RATE = 20_000.0

KvEventsVersion = Literal["0.33", "0.11"]


#: The JSON values each fault knob's annotation accepts (ints count as floats).
_KNOB_TYPES: dict[str, tuple[type, ...]] = {
    "float": (float, int),
    "int": (int,),
    "int | None": (int, type(None)),
    "float | None": (float, int, type(None)),
    "bool": (bool,),
}


@dataclass
class FaultConfig:
    """Fault knobs, settable at start-up and at run time (``POST /sim/faults``).

    - ``latency_s``: added before any work on an inference request (real seconds, not scaled).
    - ``error_rate``: fraction of inference requests answered HTTP ``error_status`` with an
      OpenAI error body (drawn from a generator seeded with ``seed``).
    - ``die_after_chunks``: a streamed response drops the connection after this many SSE chunks;
      a non-streamed one drops it before answering when 0.
    - ``hang``: inference requests wait without answering until the fault is cleared.
    - ``refuse_connections``: the rank stops listening (clients get ECONNREFUSED) and listens
      again on the same port once cleared; idle keep-alive connections are closed.
    - ``refuse_for_s``: with ``refuse_connections``, listen again by itself after this many
      (real) seconds. ``POST /sim/faults`` cannot reach a rank that refuses connections, so this is
      how an HTTP client takes a rank away and gets it back (in process: ``set_faults``).
    - ``malformed_sse``: streams emit one undecodable ``data:`` line after the first chunk.
    """

    latency_s: float = 0.0
    error_rate: float = 0.0
    error_status: int = 500
    die_after_chunks: int | None = None
    hang: bool = False
    refuse_connections: bool = False
    refuse_for_s: float | None = None
    malformed_sse: bool = False
    seed: int = 0

    def updated(self, **knobs: Any) -> FaultConfig:
        """A copy with ``knobs`` changed; an unknown knob or a value of the wrong type raises
        ``ValueError`` naming the knobs there are."""
        known = {f.name: f for f in fields(self)}
        unknown = set(knobs) - set(known)
        if unknown:
            raise ValueError(f"unknown fault knobs: {sorted(unknown)}; the knobs are: {', '.join(known)}")
        for name, value in knobs.items():
            kinds = _KNOB_TYPES.get(str(known[name].type), (object,))
            # bool is an int to isinstance, but true is no latency
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"fault knob {name!r} takes {wanted}, got {value!r}")
        return replace(self, **knobs)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class SimConfig:
    """Everything that defines one simulated rank. ``port=0`` (and the KV event ports) pick a free port."""

    name: str = "sim-0"
    host: str = "127.0.0.1"
    port: int = 0
    model: str = DEFAULT_MODEL
    block_size: int = 16
    #: Pool size in blocks; when None, ``kv_tokens // block_size``.
    num_blocks: int | None = None
    kv_tokens: int = DEFAULT_KV_TOKENS
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    hash_algo: str = HashAlgo.SHA256.value
    #: NONE_HASH seed; None = PYTHONHASHSEED of the environment, else vLLM 0.33's default seed.
    hash_seed: str | None = None
    time_scale: float = 1.0
    prefill_rate: float = DEFAULT_PREFILL_RATE
    decode_base_s: float = 0.006
    decode_per_seq_s: float = 0.00008
    decode_per_context_token_s: float = 4e-8
    #: CPU tier (KV offloading): tokens of host memory that blocks evicted from the pool go to, LRU;
    #: 0: no tier (an evicted block is gone).
    cpu_tier_tokens: int = 0
    #: Tokens per (modelled) second a prompt's CPU-tier hits load back at; 0: loading takes no time.
    cpu_load_rate: float = 0.0
    default_max_tokens: int = 16
    kv_events: bool = False
    kv_events_version: KvEventsVersion = "0.33"
    kv_events_topic: str = "kv"
    kv_events_port: int = 0
    kv_replay_port: int = 0
    data_parallel_rank: int = 0
    enable_prompt_tokens_details: bool = True
    force_include_usage: bool = False
    #: Seconds an idle keep-alive connection stays open: uvicorn's default, which vLLM's API server
    #: runs with (a client reusing a connection idle this long races the rank's close).
    keep_alive_s: float = 5.0
    #: Scripted-tool mode (``bench.sim.scripted``): answer with this many shell-tool calls per user
    #: turn before a final text; 0: off (words until max_tokens).
    scripted_tool_calls: int = 0
    #: Scripted-tool mode: a conversation offering a sub-agent tool calls it once first.
    scripted_subagents: bool = False
    #: Append every POST request (path, headers, body) to this JSONL file; None: off.
    record_path: str | None = None
    #: A stream's usage chunk also carries ``sim_timing``: the wall-clock times (``time.time()``) the
    #: request reached the rank and was first scheduled, from which a benchmark on the same machine
    #: reads how long the system in front held it and how long it waited for a seat in the rank.
    report_timing: bool = False
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        self.hash_algo = HashAlgo(self.hash_algo).value
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.kv_events_version not in ("0.33", "0.11"):
            raise ValueError(f"kv_events_version must be '0.33' or '0.11', got {self.kv_events_version!r}")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.cpu_tier_tokens < 0 or self.cpu_load_rate < 0:
            raise ValueError("cpu_tier_tokens and cpu_load_rate must be >= 0")
        if self.total_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (one is vLLM's reserved null block)")

    @property
    def total_blocks(self) -> int:
        """Blocks in the pool, including vLLM's reserved null block (``num_gpu_blocks``)."""
        return self.num_blocks if self.num_blocks is not None else self.kv_tokens // self.block_size

    @property
    def cpu_tier_blocks(self) -> int:
        """Blocks the CPU tier holds (0: no tier)."""
        return self.cpu_tier_tokens // self.block_size

    @property
    def none_hash_seed(self) -> str:
        """The NONE_HASH seed this rank uses (``--hash-seed``, else PYTHONHASHSEED, else vLLM's default)."""
        return self.hash_seed if self.hash_seed is not None else none_hash_seed(dict(os.environ))
