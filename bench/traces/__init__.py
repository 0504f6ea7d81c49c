"""Public agent traces as chat sessions: Claude Code (JSON per conversation) and Mooncake (JSONL).

A trace gives, per request, one id per block of input tokens (equal ids: identical block and
identical prefix up to it). A proxy sees text, so each id maps to a fixed chunk of text of exactly
one trace block of cl100k tokens (``BlockText``: the same id always gives the same text), and each
session's requests become OpenAI chat bodies where a request that extends the previous one re-sends
the previous messages unchanged and appends its new blocks as new messages.
"""

from bench.traces.blocks import BlockText
from bench.traces.chat import ChatBuilder
from bench.traces.claude_code import claude_code_paths, load_claude_code, load_claude_code_trace
from bench.traces.mooncake import infer_mooncake_sessions, load_mooncake, read_mooncake
from bench.traces.reuse import UnitCacheBound, reuse_breakdown, trace_block_reuse
from bench.traces.sessions import TraceRequest, TraceSession
from bench.traces.sources import CLAUDE_CODE_DIR, MOONCAKE_DIR, TracesMissing

__all__ = [
    "CLAUDE_CODE_DIR",
    "MOONCAKE_DIR",
    "BlockText",
    "ChatBuilder",
    "TraceRequest",
    "TraceSession",
    "TracesMissing",
    "UnitCacheBound",
    "claude_code_paths",
    "infer_mooncake_sessions",
    "load_claude_code",
    "load_claude_code_trace",
    "load_mooncake",
    "read_mooncake",
    "reuse_breakdown",
    "trace_block_reuse",
]
