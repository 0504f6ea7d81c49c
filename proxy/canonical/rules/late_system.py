"""``late_system`` (on by default): system messages sent mid-conversation stay where the agent put them.

vLLM's Anthropic Messages entrypoint appends the text of every ``system``-role message, wherever it
stands in ``messages``, to the system prompt (``tokenization.chat_conversion``). An agent that sends
per-session or per-turn context as such messages then rewrites the head of its own prompt: the
system prompt differs between sessions, grows on every turn, and the tools and the whole history
rendered after it are prefilled again each time. Claude Code 2.1.332 does this: right after the
first user message, a system message with its ``# Environment`` list (``Primary working directory:``,
git repository, platform, shell, OS version), the model's name, the deferred tools, the agent types,
the skills, ``<total_tokens>N tokens left</total_tokens>`` and ``Today's date is ...``; after every
tool round another one, ``<total_tokens>N tokens left</total_tokens>`` with a new N.

The rule recognises the structure, not one agent's text: in a request whose system prompt comes from
a top-level field that such a rank extends with late system messages (``hoisting_fields``: the
Anthropic ``system`` field, marked on the canonicalization view's leading message), every
``system``-role message after the first message of another role is sent as a ``user`` message at
the same place, its content and other keys byte for byte. What the model sees then: the system
prompt is exactly what the agent sent in ``system``; each such message is a user turn at its place
in the conversation (as the Anthropic API itself renders it: in place, not at the end of the system
prompt), so the environment list and the token budget read as context in the conversation rather
than as system instructions. ``enabled: false`` leaves them to the rank's hoisting.
"""

from __future__ import annotations

from typing import Any

from proxy.canonical.rules.base import MessagesEdit, MessagesRule, MessagesStep, RuleConfig

NAME = "late_system"

#: The key marking the canonicalization view's message that stands for an API's top-level field, and
#: naming it (``proxy.apis.base.SLOT``; not imported: the API layer depends on this package).
SLOT_KEY = "_prefixgate_slot"


class LateSystemSettings(RuleConfig):
    """System messages after the conversation's start sent as user messages in place, for requests
    whose system prompt comes from one of ``hoisting_fields`` (the APIs whose rank appends such
    messages to the system prompt)."""

    hoisting_fields: tuple[str, ...] = ("system",)


def _is_system(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "system"


def in_place(messages: list[Any], fields: tuple[str, ...]) -> tuple[list[Any] | None, int]:
    """``messages`` with their late system messages made user messages (None: none there), and how
    many; only when the leading message stands for one of ``fields``."""
    if not messages or not isinstance(messages[0], dict) or messages[0].get(SLOT_KEY) not in fields:
        return None, 0
    start = next((i for i, m in enumerate(messages) if not _is_system(m)), len(messages))
    late = [i for i in range(start, len(messages)) if _is_system(messages[i])]
    if not late:
        return None, 0
    out = list(messages)
    for i in late:
        out[i] = {**messages[i], "role": "user"}
    return out, len(late)


def _build(settings: LateSystemSettings) -> MessagesStep | None:
    fields = settings.hoisting_fields
    if not fields:
        return None

    def step(messages: list[Any]) -> MessagesEdit:
        out, count = in_place(messages, fields)
        return MessagesEdit(out, count)

    return step


RULE = MessagesRule(NAME, LateSystemSettings, _build)
