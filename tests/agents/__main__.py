"""``python -m tests.agents [--only NAME,...]``: run the real-agent tier's scenarios, print the
figures of issue 20's "Done when" and write them to ``bench/out/agents.json``.

Targets: Claude Code's hit rate with a file edited between ``--continue`` prompts within 0.002 of
the same session without the edit; three sessions in different directories share at least their
system + tools; no false break in any session; side requests and sub-agents listed
as threads; every estimate within one block of the reported cached tokens; no index correction;
every session keyed by the agent's own session header; a session's last request with the
end-of-session header leaves it ended, its seat free, as soon as it is answered.
Exits 1 when a target is missed (0 when met; 2 when the CLIs are not installed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import write_json
from tests.agents import clis
from tests.agents.scenarios import SCENARIOS
from tests.agents.tier import SIM, SessionFigures

HIT_RATE_TOLERANCE = 0.002
#: Variants run with a rule off, to show what it buys: their sessions' breaks are the rule's to avoid.
CONTROLS = frozenset({"edit_rule_off", "late_rule_off"})


def _sessions(results: dict[str, Any]) -> dict[str, SessionFigures]:
    """Every session measured, by scenario/variant (the rule-off controls excluded)."""
    out: dict[str, SessionFigures] = {}
    for name, result in results.items():
        variants = {"": result} if "_figures" in result else result
        for variant, data in variants.items():
            if variant in CONTROLS or not isinstance(data, dict):
                continue
            found = data.get("_figures")
            for i, fig in enumerate(found if isinstance(found, list) else [found]):
                if isinstance(fig, SessionFigures):
                    out[f"{name}/{variant or '-'}/{i}"] = fig
    return out


def _variants(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every deployment's result, by scenario/variant."""
    out: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        if "corrections" in result:
            out[name] = result
        else:
            out.update({f"{name}/{v}": r for v, r in result.items() if isinstance(r, dict)})
    return out


def targets(results: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """Each target: (met, the figure)."""
    out: dict[str, tuple[bool, str]] = {}
    if "claude_edit" in results:
        r = results["claude_edit"]
        edit, still, off = r["edit"]["hit_rate"], r["no_edit"]["hit_rate"], r["edit_rule_off"]["hit_rate"]
        out["claude edit == no edit"] = (
            abs(edit - still) <= HIT_RATE_TOLERANCE,
            f"edit {edit:.4f} vs no edit {still:.4f} (rule off: {off:.4f})",
        )
    if "claude_dirs" in results:
        dirs = results["claude_dirs"]
        on, off, late = dirs["defaults"], dirs["memory_rule_off"], dirs["late_rule_off"]
        out["3 dirs share system + tools"] = (
            on["covers_system_tools"],
            f"{on['shared_prefix_tokens']} shared of {on['system_tools_tokens']} system+tools tokens "
            f"(claude_memory off: {off['shared_prefix_tokens']}, late_system off: "
            f"{late['shared_prefix_tokens']} of {late['system_tools_tokens']})",
        )
    sessions = _sessions(results)
    false = {k: [b.get("cause") for b in f.false_breaks] for k, f in sessions.items() if f.false_breaks}
    real = {k: [b.get("cause") for b in f.breaks] for k, f in sessions.items() if f.breaks}
    out["no false break"] = (
        not false,
        f"{len(sessions)} sessions; false: {false or 'none'}; breaks the ranks confirm: {real or 'none'}",
    )
    kinds: dict[str, set[str]] = {}
    for key, fig in sessions.items():
        kinds.setdefault(key.split("/")[0], set()).update(t["kind"] for t in fig.threads)
    wanted = {"opencode": "side", "claude_agents": "subagent"}
    missing = {a: k for a, k in wanted.items() if a in kinds and k not in kinds[a]}
    out["side requests and sub-agents are threads"] = (
        not missing,
        ", ".join(f"{a}: {sorted(k)}" for a, k in sorted(kinds.items())),
    )
    errors = [abs(e) for f in sessions.values() for e in f.estimate_errors]
    out["|estimated - reported| <= 1 block"] = (
        max(errors, default=0) <= SIM.block_size,
        f"max {max(errors, default=0)} tokens over {len(errors)} requests (block {SIM.block_size}); "
        f"exact on {sum(1 for e in errors if e == 0)}",
    )
    deployments = _variants(results)
    identified = {k: r["identified"] for k, r in deployments.items() if "identified" in r}
    strays = {k: i["unmatched"] for k, i in identified.items() if i["unmatched"] or not i["sessions"]}
    out["sessions identified from the agents' own headers"] = (
        bool(identified) and not strays,
        ", ".join(f"{k}: {i['sessions']} by {i['header']}" for k, i in identified.items())
        + (f"; not matching: {strays}" if strays else ""),
    )
    ended = [(k, e) for k, r in deployments.items() for e in r.get("ended", [])]
    not_freed = [
        (k, e)
        for k, e in ended
        if not (e["status"] == 200 and e["decision"] == "ended" and e["released"] and not e["active"])
    ]
    out["end-of-session header frees the seat within one request"] = (
        bool(ended) and not not_freed,
        f"{len(ended) - len(not_freed)} of {len(ended)} sessions ended and freed right after their "
        f"last request" + (f"; not: {not_freed}" if not_freed else ""),
    )
    # steady state: a deployment's corrections after its first session (all of them where there is one)
    steady = total = 0.0
    for r in results.values():
        variants: list[dict[str, Any]] = (
            [r] if "corrections" in r else [x for x in r.values() if isinstance(x, dict)]
        )
        for v in variants:
            if "corrections" in v:
                total += float(v["corrections"])
                steady += float(v.get("corrections_steady", v["corrections"]))
    out["no index corrections in steady state"] = (
        steady == 0,
        f"{steady:.0f} (while learning an agent's answers: {total - steady:.0f})",
    )
    return out


def _public(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_public(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--keep", default=None, help="keep the workspaces and request records here")
    args = parser.parse_args(argv)
    missing = clis.installed()
    if missing:
        print(
            f"agent CLIs not installed ({', '.join(missing)}): run tests/agents/install.sh", file=sys.stderr
        )
        return 2
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="prefixgate-agents-"))
    results: dict[str, Any] = {}
    for name in [n for n in args.only.split(",") if n]:
        print(f"running {name} ...", flush=True)
        results[name] = SCENARIOS[name](root / name)
    met = targets(results)
    print(f"\nreal-agent tier: {', '.join(f'{k} {v}' for k, v in clis.VERSIONS.items())}")
    for target, (ok, figure) in met.items():
        print(f"  {'met   ' if ok else 'MISSED'}  {target}: {figure}")
    path = write_json(
        "agents.json",
        {"versions": clis.VERSIONS, "results": _public(results), "targets": {k: v for k, v in met.items()}},
    )
    print(f"wrote {path}")
    return 0 if all(ok for ok, _ in met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
