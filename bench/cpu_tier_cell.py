"""``prefixgate bench --cpu-tier N``: every simulated rank gets a CPU tier of N times its GPU pool
(KV offloading, ``bench/sim/cpu_tier.py``), publishes KV events, and prefixgate follows them
(``--kv-events auto``), so that its index knows which blocks each rank holds in CPU memory.

The ranks load blocks back from the tier at ``CPU_LOAD_RATE`` tokens per second whatever their
compute speed: a host-to-GPU copy, not a computation.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.systems import FleetConfig

#: Tokens per second a rank loads back from CPU memory: PCIe Gen4 x16 at ~25 GB/s over the default
#: model's 128 KiB of KV per token (``bench/sim/config.py``), about 10x the fast ranks' prefill.
CPU_LOAD_RATE = 200_000.0

#: What prefixgate needs to see the tiers: the ranks' KV events.
PREFIXGATE_FLAGS = ("--kv-events", "auto")


def add_cpu_tier_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-tier",
        type=float,
        default=0.0,
        help="each rank offloads evicted KV blocks to a CPU tier of N times its GPU pool, loaded back "
        f"at {CPU_LOAD_RATE:,.0f} tokens/s; the ranks publish KV events and prefixgate follows them "
        "(--kv-events auto); default 0: no tier",
    )


def with_cpu_tier(fleet: FleetConfig, multiple: float) -> FleetConfig:
    """``fleet`` with a CPU tier of ``multiple`` x each pool (unchanged for 0)."""
    if multiple <= 0:
        return fleet
    tokens = int(fleet.kv_tokens * multiple)
    return replace(fleet, cpu_tier_tokens=tokens, cpu_load_rate=CPU_LOAD_RATE, kv_events=True)


def cpu_tier_prefixgate_flags(multiple: float) -> list[str]:
    """The flags every prefixgate system gets with a CPU tier."""
    return list(PREFIXGATE_FLAGS) if multiple > 0 else []
