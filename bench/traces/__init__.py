"""Public agent traces as chat sessions: Claude Code (JSON per conversation) and Mooncake (JSONL).

A trace gives, per request, one id per block of input tokens (equal ids: identical block and
identical prefix up to it). A proxy sees text, so each id maps to a fixed chunk of text of exactly
one trace block of cl100k tokens (``BlockText``: the same id always gives the same text), and each
session's requests become OpenAI chat bodies where a request that extends the previous one re-sends
the previous messages unchanged and appends its new blocks as new messages.

Modules:

- ``sources``: where the shared traces live (``../shared/traces``), ``TracesMissing``;
- ``blocks``: block ids and their text (``BlockKey``, ``BlockText``);
- ``sessions``: ``TraceRequest`` and ``TraceSession``, what the loaders give and the replay takes;
- ``claude_code``: the Claude Code loader (shared system/tool head, sub-agents as child sessions);
- ``mooncake``: the Mooncake loader (conversations inferred from shared prefixes);
- ``chat``: ``ChatBuilder``, a session's requests as chat bodies and as prompt units;
- ``reuse``: ``UnitCacheBound`` (the infinite-cache bound over prompt units), the traces' own reuse.
"""

from bench.traces.blocks import VOCABULARY, BlockKey, BlockText
from bench.traces.chat import ChatBuilder
from bench.traces.claude_code import claude_code_paths, load_claude_code, load_claude_code_trace
from bench.traces.mooncake import (
    MooncakeLine,
    common_head,
    infer_mooncake_sessions,
    load_mooncake,
    read_mooncake,
)
from bench.traces.reuse import UnitCacheBound, reuse_breakdown, trace_block_reuse
from bench.traces.sessions import TraceRequest, TraceSession
from bench.traces.sources import CLAUDE_CODE_DIR, MOONCAKE_DIR, SHARED_TRACES, TracesMissing

__all__ = [
    "CLAUDE_CODE_DIR",
    "MOONCAKE_DIR",
    "SHARED_TRACES",
    "VOCABULARY",
    "BlockKey",
    "BlockText",
    "ChatBuilder",
    "MooncakeLine",
    "TraceRequest",
    "TraceSession",
    "TracesMissing",
    "UnitCacheBound",
    "claude_code_paths",
    "common_head",
    "infer_mooncake_sessions",
    "load_claude_code",
    "load_claude_code_trace",
    "load_mooncake",
    "read_mooncake",
    "reuse_breakdown",
    "trace_block_reuse",
]
