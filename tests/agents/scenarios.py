"""The real-agent tier's scenarios, each on a fresh deployment (``tests.agents.tier``), and the
figures of issue 20's "Done when" they measure.

- ``claude_edit``: Claude Code in a git repository, ``claude -p`` then two ``--continue`` prompts,
  a file edited before each (or not): its hit rate against the same session without the edits,
  and with the ``claude_git_status`` rule off (what the edit cost before);
- ``claude_dirs``: three concurrent Claude Code sessions in different directories: the prefix their
  first requests share, against their system + tools (with the defaults, and ``claude_memory`` or
  ``late_system`` off);
- ``claude_agents``: Claude Code calling its Agent tool: sub-agents under the session;
- ``codex``: ``codex exec`` then ``exec resume --last``;
- ``opencode``: ``opencode run`` then ``--continue`` (its title generator first).

Every session's breaks, threads and per-request estimate errors are kept; the index corrections per
deployment too. Per deployment, ``identified``: whether prefixgate's sessions are the ids the agent
sent in its own session header; per agent session, once measured, ``ended``: its last, minimal
request with Dynamo's session-final header (as a harness sends it), and the session read back at
once (ended, its seat free).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.agents import clis
from tests.agents.tier import Deployment, SessionFigures, figures, shared_prefix

#: Each agent's own session header (Codex's and opencode's as the README's session-header table names them).
CLAUDE_HEADER = "x-claude-code-session-id"
CODEX_HEADER = "session-id"
OPENCODE_HEADER = "x-session-affinity"
MEMORY_OFF = {"canonical": {"rules": {"claude_memory": {"enabled": False}}}}
LATE_RULE_OFF = {"canonical": {"rules": {"late_system": {"enabled": False}}}}
GIT_RULE_OFF = {"canonical": {"rules": {"claude_git_status": {"enabled": False}}}}


def _claude_session(dep: Deployment, ws: clis.Workspace, prompts: int, edit: bool) -> SessionFigures:
    result = clis.claude(ws, dep.url, "List the files and tell me what they hold.")
    for n in range(1, prompts):
        if edit:
            ws.edit()
        clis.claude(ws, dep.url, f"Now check the notes again ({n}).", resume=True)
    return figures(dep, str(result["session_id"]))


def claude_edit(root: Path) -> dict[str, Any]:
    """The hit rate of a Claude Code session with a file edited between ``--continue`` prompts."""
    out: dict[str, Any] = {}
    for name, edit, flags in (
        ("no_edit", False, {}),
        ("edit", True, {}),
        ("edit_rule_off", True, GIT_RULE_OFF),
    ):
        with Deployment(root / name, flags=flags, subagents=False) as dep:
            ws = clis.Workspace(root / name / "ws")
            ws.git_init()
            fig = _claude_session(dep, ws, 3, edit)
            out[name] = {**fig.to_dict(), "corrections": dep.corrections()}
            out[name]["identified"] = dep.identified(CLAUDE_HEADER)
            out[name]["ended"] = [dep.end_session(fig.key, CLAUDE_HEADER)]
            out[name]["_figures"] = fig
    return out


def _concurrently(jobs: list[Callable[[], object]]) -> list[object]:
    """Every job at once, each in a thread; the first job's error (in order) is raised here."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def claude_dirs(root: Path, sessions: int = 3) -> dict[str, Any]:
    """Concurrent Claude Code sessions in different directories: what their first requests share."""
    out: dict[str, Any] = {}
    for name, flags in (
        ("defaults", {}),
        ("memory_rule_off", MEMORY_OFF),
        ("late_rule_off", LATE_RULE_OFF),
    ):
        with Deployment(root / name, flags=flags, subagents=False) as dep:
            spaces = [clis.Workspace(root / name / f"dir-{i}") for i in range(sessions)]
            for ws in spaces:
                ws.git_init()

            def session(ws: clis.Workspace) -> Callable[[], SessionFigures]:
                return lambda: _claude_session(dep, ws, 2, edit=False)

            found = _concurrently([session(ws) for ws in spaces])
            firsts: dict[str, dict[str, Any]] = {}
            for request in dep.requests():
                key = request["headers"].get(CLAUDE_HEADER)
                if key and "x-claude-code-agent-id" not in request["headers"]:
                    firsts.setdefault(key, request)
            common, head = shared_prefix(list(firsts.values()))
            measured = [f for f in found if isinstance(f, SessionFigures)]
            identified = dep.identified(CLAUDE_HEADER)
            out[name] = {
                "sessions": [f.to_dict() for f in found if isinstance(f, SessionFigures)],
                "shared_prefix_tokens": common,
                "system_tools_tokens": head,
                "covers_system_tools": common >= head > 0,
                "corrections": dep.corrections(),
                "identified": identified,
                "ended": [dep.end_session(f.key, CLAUDE_HEADER) for f in measured],
                "_figures": measured,
            }
    return out


def claude_agents(root: Path) -> dict[str, Any]:
    """Claude Code with its Agent tool called: the sub-agents' conversations under the session."""
    with Deployment(root / "claude-agents", subagents=True) as dep:
        ws = clis.Workspace(root / "claude-agents" / "ws")
        ws.git_init()
        fig = _claude_session(dep, ws, 1, edit=False)
        return {
            **fig.to_dict(),
            "corrections": dep.corrections(),
            "identified": dep.identified(CLAUDE_HEADER),
            "ended": [dep.end_session(fig.key, CLAUDE_HEADER)],
            "_figures": fig,
        }


def _only_session(dep: Deployment, prefix: str = "") -> str:
    keys = [s["key"] for s in dep.sessions() if s["key"].startswith(prefix)]
    if not keys:
        raise RuntimeError("the agent's requests reached no session")
    return str(max(keys, key=lambda k: dep.session(k)["turns"]))


def codex(root: Path) -> dict[str, Any]:
    with Deployment(root / "codex") as dep:
        ws = clis.Workspace(root / "codex" / "ws")
        clis.codex(ws, dep.url, "List the files and tell me what they hold.")
        clis.codex(ws, dep.url, "Now check them again.", resume=True)
        fig = figures(dep, _only_session(dep))
        return {
            **fig.to_dict(),
            "corrections": dep.corrections(),
            "identified": dep.identified(CODEX_HEADER),
            "ended": [dep.end_session(fig.key, CODEX_HEADER)],
            "_figures": fig,
        }


def opencode(root: Path) -> dict[str, Any]:
    """Two opencode sessions one after the other: the first teaches prefixgate how opencode sends its
    answers back (it re-serializes tool calls' arguments); the second is the steady state."""
    with Deployment(root / "opencode", subagents=False) as dep:
        found: list[SessionFigures] = []
        learning = 0.0
        for n in range(2):
            ws = clis.Workspace(root / "opencode" / f"ws-{n}")
            before = {s["key"] for s in dep.sessions()}
            clis.opencode(ws, dep.url, "List the files and tell me what they hold.")
            clis.opencode(ws, dep.url, "Now check them again.", resume=True)
            new = [s["key"] for s in dep.sessions() if s["key"] not in before and s["key"].startswith("ses_")]
            found.append(figures(dep, new[0]))
            if n == 0:
                learning = dep.corrections()
        total = dep.corrections()
        identified = dep.identified(OPENCODE_HEADER)
        return {
            "sessions": [f.to_dict() for f in found],
            "corrections": total,
            "corrections_steady": total - learning,
            "identified": identified,
            "ended": [dep.end_session(f.key, OPENCODE_HEADER) for f in found],
            "_figures": found,
        }


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "claude_edit": claude_edit,
    "claude_dirs": claude_dirs,
    "claude_agents": claude_agents,
    "codex": codex,
    "opencode": opencode,
}
