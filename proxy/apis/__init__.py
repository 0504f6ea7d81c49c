"""The client APIs prefixgate serves, one module each behind ``proxy.apis.base.Api``.

Every registered API gets its endpoints installed by ``proxy.app`` and runs through the one
pipeline (``proxy.pipeline``). A new API is one new module plus one line in ``APIS``.
"""

from __future__ import annotations

from proxy.apis.base import Api, Endpoint
from proxy.apis.chat import CHAT
from proxy.apis.completions import COMPLETIONS
from proxy.apis.messages import MESSAGES
from proxy.apis.responses import RESPONSES

APIS: list[Api] = [
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
]


def register(api: Api) -> Api:
    """Serve ``api`` too (from the next app created); returns it, so a module can register itself."""
    if any(a.name == api.name for a in APIS):
        raise ValueError(f"an API named {api.name!r} is registered already")
    APIS.append(api)
    return api


def unregister(name: str) -> None:
    """Stop serving the API called ``name`` (from the next app created); unknown names are ignored."""
    APIS[:] = [a for a in APIS if a.name != name]


__all__ = [
    "APIS",
    "CHAT",
    "COMPLETIONS",
    "MESSAGES",
    "RESPONSES",
    "Api",
    "Endpoint",
    "register",
    "unregister",
]
