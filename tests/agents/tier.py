"""The real-agent tier's deployment: simulated ranks in scripted-tool mode, prefixgate in front.

``Deployment`` starts fresh ranks (``bench.sim``, ``scripted_tool_calls``: each conversation with a
shell tool makes that many calls per user turn; sub-agent tools are called once) recording what
reaches them, and prefixgate with its defaults (plus the flags a scenario sets) on loopback, and
reads back what prefixgate measured: the session table, each session's threads, its turns with the
estimated and reported cached tokens, the index corrections. ``end_session`` sends a session's last,
minimal request as an agent harness does (Dynamo's session-final header), and ``identified`` checks
that prefixgate keyed every session by the agent's own session header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from bench.common import metric_totals
from bench.sim import SimConfig, SimRankServer, start_fleet, stop_fleet
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread
from tokenization.base import ChatPrompt, common_prefix_len
from tokenization.chat_conversion import anthropic_to_chat, responses_to_chat
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

#: Dynamo's session-final header: a harness sends it on a session's last, minimal request.
END_HEADER = "x-dynamo-session-final"
_ENDING = "The session ends."
#: That last request, per API the agents speak (the agent's model added).
_END_REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": _ENDING}]},
    "/v1/responses": {"max_output_tokens": 16, "input": _ENDING},
    "/v1/chat/completions": {"max_tokens": 1, "messages": [{"role": "user", "content": _ENDING}]},
}

#: The ranks of the tier: fast (no modelled time), pools large enough that nothing is evicted.
SIM = SimConfig(time_scale=0.0, kv_tokens=1_000_000, scripted_tool_calls=2, scripted_subagents=True)


@dataclass
class Deployment:
    """Ranks and prefixgate for one scenario."""

    root: Path
    ranks: int = 2
    flags: dict[str, Any] = field(default_factory=dict)
    subagents: bool = True
    fleet: list[SimRankServer] = field(default_factory=list)
    proxy: ServerThread | None = None

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    @property
    def records(self) -> Path:
        return self.root / "requests.jsonl"

    def start(self) -> Deployment:
        self.root.mkdir(parents=True, exist_ok=True)
        sim = replace(SIM, record_path=str(self.records), scripted_subagents=self.subagents)
        self.fleet = start_fleet(self.ranks, sim)
        flags = {"log_level": "warning", **self.flags}
        backends = [f"{r.name}={r.url}" for r in self.fleet]
        settings = load_settings(flags=flags, backend_specs=backends, environ={})
        self.proxy = ServerThread(create_app(settings)).start(60.0)
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        stop_fleet(self.fleet)

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what prefixgate measured -----------------------------------------------------------------
    def _get(self, path: str) -> Any:
        response = httpx.get(self.url + path, timeout=30, trust_env=False)
        response.raise_for_status()
        return response.json()

    def sessions(self) -> list[dict[str, Any]]:
        return list(self._get("/admin/sessions?limit=1000")["data"])

    def session(self, key: str) -> dict[str, Any]:
        """One session with its breaks and threads (``GET /admin/sessions/{id}``)."""
        return dict(self._get(f"/admin/sessions/{key}"))

    def turns(self, key: str) -> list[dict[str, Any]]:
        """The session's answered requests: prompt, reported and estimated cached tokens."""
        return list(self._get(f"/admin/overview/sessions/{key}")["turns_log"])

    def corrections(self) -> float:
        """Index corrections so far (``prefixgate_index_corrections_total``, over its labels)."""
        return metric_totals(self.url, ["prefixgate_index_corrections"])["prefixgate_index_corrections"]

    def requests(self) -> list[dict[str, Any]]:
        """Every request the ranks received (canonicalized by prefixgate), in arrival order."""
        if not self.records.exists():
            return []
        return [json.loads(line) for line in self.records.read_text(encoding="utf-8").splitlines()]

    def identified(self, header: str) -> dict[str, Any]:
        """Whether prefixgate's sessions are exactly the ids the agent sent in its own session
        ``header`` (its child sessions, which name a parent, are threads of the parent's)."""
        sent = {
            r["headers"][header]
            for r in self.requests()
            if r["headers"].get(header) and not any(r["headers"].get(h) for h in _PARENT_HEADERS)
        }
        keys = {s["key"] for s in self.sessions()}
        return {"header": header, "sessions": len(keys), "unmatched": sorted(keys ^ sent)}

    def end_session(self, key: str, header: str) -> dict[str, Any]:
        """Send session ``key``'s last request as an agent harness does when the session ends (a
        minimal one, in the agent's API, with its session header and ``END_HEADER``), then read the
        session back at once: ended and its seat free after that one request?"""
        first = next(
            r for r in self.requests() if r["headers"].get(header) == key and r["path"] in _END_REQUESTS
        )
        body = {"model": first["body"].get("model"), **_END_REQUESTS[first["path"]]}
        answer = httpx.post(
            self.url + first["path"],
            json=body,
            headers={header: key, END_HEADER: "true"},
            timeout=60,
            trust_env=False,
        )
        session = self.session(key)
        return {
            "status": answer.status_code,
            "decision": (session.get("admission") or {}).get("decision"),
            "released": session["released"],
            "active": session["active"],
        }


@dataclass(frozen=True)
class SessionFigures:
    """One agent session as prefixgate saw it."""

    key: str
    requests: int
    hit_rate: float | None
    breaks: list[dict[str, Any]]
    threads: list[dict[str, Any]]
    #: Per answered request: reported minus estimated cached tokens.
    estimate_errors: list[int]
    #: Breaks of threads whose every prompt, as the rank rendered it, extends the thread's previous one.
    false_breaks: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "requests": self.requests,
            "hit_rate": self.hit_rate,
            "breaks": [b.get("cause") for b in self.breaks],
            "false_breaks": len(self.false_breaks),
            "threads": [{k: t[k] for k in ("kind", "requests", "label", "hit_rate")} for t in self.threads],
            "max_estimate_error": max((abs(e) for e in self.estimate_errors), default=0),
        }


def figures(dep: Deployment, key: str) -> SessionFigures:
    session = dep.session(key)
    turns = dep.turns(key)
    errors = [
        t["cached_tokens"] - t["estimated_cached_tokens"]
        for t in turns
        if t["cached_tokens"] is not None and t["estimated_cached_tokens"] is not None
    ]
    extending = thread_extends(dep.requests(), key) if session["breaks"] else {}
    false = [b for b in session["breaks"] if extending.get(b.get("thread", MAIN_THREAD), False)]
    return SessionFigures(
        key, session["turns"], session["hit_rate"], session["breaks"], session["threads"], errors, false
    )


MAIN_THREAD = "main"
_SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "x-session-id", "x-session-affinity")
_THREAD_HEADERS = ("x-claude-code-agent-id", "thread-id")
#: opencode's sub-agent: a child session naming its parent; a thread of the parent's session.
_PARENT_HEADERS = ("x-parent-session-id",)


def thread_extends(requests: list[dict[str, Any]], session: str) -> dict[str, bool]:
    """Per thread of ``session`` (``main``, or ``agent:<id>`` from the agent's header): whether each of
    its prompts, as the rank tokenized it, extends the previous one (no break really happened). The
    previous prompt's generation prompt (its last 3 tokens) is left out: the answer follows it."""
    chains: dict[str, list[list[int]]] = {}
    for request in requests:
        headers = request["headers"]
        own = next((headers[h] for h in _SESSION_HEADERS if headers.get(h)), None)
        if any(headers.get(h) == session for h in _PARENT_HEADERS) and own and own != session:
            agent: str | None = own  # a child session of this one
        elif any(headers.get(h) == session for h in _SESSION_HEADERS):
            named = (headers[h] for h in _THREAD_HEADERS if headers.get(h) and headers[h] != session)
            agent = next(named, None)
        else:
            continue
        if request["path"] not in ("/v1/messages", "/v1/responses", "/v1/chat/completions"):
            continue
        tokens, _ = prompt_tokens(request["body"], request["path"])
        chains.setdefault(f"agent:{agent}" if agent else MAIN_THREAD, []).append(tokens)
    return {
        thread: all(new[: len(old) - 3] == old[: len(old) - 3] for old, new in pairwise(chain))
        for thread, chain in chains.items()
    }


def prompt_tokens(body: dict[str, Any], path: str) -> tuple[list[int], int]:
    """A recorded request as the simulated rank tokenizes it, and where its system + tools end."""
    chat = anthropic_to_chat(body) if path == "/v1/messages" else body
    if path == "/v1/responses":
        chat = responses_to_chat(body, None)
    encoded = TiktokenTokenizer().encode_chat(ChatPrompt(chat["messages"], chat.get("tools")))
    head = next((end for label, _, end in encoded.parts if label == "system+tools"), 0)
    return list(encoded.tokens), head


def shared_prefix(requests: list[dict[str, Any]]) -> tuple[int, int]:
    """(tokens every one of ``requests`` shares from token 0, the shortest system + tools)."""
    rendered = [prompt_tokens(r["body"], r["path"]) for r in requests]
    if not rendered:
        return 0, 0
    first = rendered[0][0]
    common = min((common_prefix_len(first, tokens) for tokens, _ in rendered[1:]), default=len(first))
    return common, min(head for _, head in rendered)
