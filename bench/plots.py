"""PNG plots of a ``prefixgate bench`` run (matplotlib, the optional ``bench`` extra).

Per scenario: the hit rate the ranks reported over the replay (a window of requests, in sent
order, like vLLM's hit-rate panel), prefill tokens computed per system, and the TTFT CDF.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plots_available() -> bool:
    """Whether matplotlib is installed (the ``bench`` extra)."""
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # optional: the tables and JSON do not need it
        raise RuntimeError("plots need matplotlib: pip install 'prefixgate[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def windowed_hit_rate(turns: Sequence[Mapping[str, Any]], window: int) -> tuple[list[int], list[float]]:
    """Hit rate (cached / prompt tokens) over a sliding window of ``window`` requests in sent order."""
    ordered = sorted(turns, key=lambda t: t["sent_s"])
    xs: list[int] = []
    ys: list[float] = []
    prompt = cached = 0
    for i, turn in enumerate(ordered):
        prompt += turn["prompt_tokens"]
        cached += turn["cached_tokens"]
        if i >= window:
            prompt -= ordered[i - window]["prompt_tokens"]
            cached -= ordered[i - window]["cached_tokens"]
        if i + 1 >= min(window, len(ordered)):
            xs.append(i + 1)
            ys.append(cached / prompt if prompt else 0.0)
    return xs, ys


def write_plots(
    scenario: str, results: Mapping[str, Mapping[str, Any]], bound: float, out: Path
) -> list[Path]:
    """Write the three PNGs of one scenario into ``out``; returns their paths."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    systems = [name for name, r in results.items() if r.get("turns")]

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=80)
    for name in systems:
        turns = results[name]["turns"]
        xs, ys = windowed_hit_rate(turns, max(10, len(turns) // 25))
        ax.plot(xs, ys, label=name, linewidth=1.3)
    ax.axhline(bound, color="black", linestyle="--", linewidth=1, label="infinite-cache bound")
    ax.set_xlabel("requests sent")
    ax.set_ylabel("prefix cache hit rate (window)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"hit rate over the replay ({scenario})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(plt, fig, out / f"{scenario}_hit_rate.png"))

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    values = [results[n]["prefill_tokens"] / 1e6 for n in systems]
    bars = ax.barh(systems, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.invert_yaxis()
    ax.set_xlabel("prefill tokens computed (millions, from the ranks' usage)")
    ax.set_title(f"prefill ({scenario})")
    ax.tick_params(axis="y", labelsize=8)
    paths.append(_save(plt, fig, out / f"{scenario}_prefill.png"))

    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=80)
    for name in systems:
        ttfts = sorted(t["ttft_s"] * 1000 for t in results[name]["turns"])
        ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.plot(ttfts, ys, label=name, linewidth=1.3)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF ({scenario})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    paths.append(_save(plt, fig, out / f"{scenario}_ttft_cdf.png"))
    return paths
