"""Whose is a session key or a stored answer's id: names are namespaced by the client's API key.

A session key and a response id are chosen by clients, so two clients may pick the same one, by
accident or to read and write into another's session (its record, its breaks, its budget, its
stored answers). With client keys configured, every such name prefixgate keeps is the client's name
prefixed by its key's label (``alice/s-1``); a client sees and addresses only its own names, the
admin sees them with their client. Without client keys there is one tenant and names are kept as
sent.

Session keys are also made safe to carry anywhere (``safe_key``): in a response header, a log line,
a Prometheus label, a terminal. Characters outside printable ASCII (and ``%`` itself, so the mapping
stays one to one) are percent-encoded, and a key longer than ``MAX_KEY_CHARS`` keeps its start and a
digest of the whole.
"""

from __future__ import annotations

from urllib.parse import quote

import xxhash

#: Longest session key kept as sent (encoded); longer keys keep their start and a digest.
MAX_KEY_CHARS = 256
#: Characters of an over-long key kept before its digest.
KEPT_PREFIX_CHARS = 64
#: Printable ASCII but the space and the percent sign (which begins an escape).
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%")
SEPARATOR = "/"


def safe_key(raw: str) -> str:
    """``raw`` as printable ASCII of at most ``MAX_KEY_CHARS``, distinct keys staying distinct."""
    plain = raw.isascii() and raw.isprintable() and " " not in raw and "%" not in raw
    key = raw if plain else quote(raw, safe=_SAFE, errors="surrogatepass")
    if len(key) <= MAX_KEY_CHARS:
        return key
    return key[:KEPT_PREFIX_CHARS] + "~" + xxhash.xxh3_128_hexdigest(raw.encode("utf-8", "surrogatepass"))


def tenant_key(owner: str | None, name: str) -> str:
    """The name prefixgate keeps for ``owner``'s ``name`` (``owner``: the client key's label)."""
    if owner is None:
        return name
    return quote(owner, safe="") + SEPARATOR + name


def client_view(key: str, owner: str | None) -> str:
    """The name as its client sent it (safe-encoded): ``key`` without ``owner``'s namespace."""
    if owner is None:
        return key
    prefix = quote(owner, safe="") + SEPARATOR
    return key[len(prefix) :] if key.startswith(prefix) else key


def shown_to(key: str, owner: str | None) -> str:
    """How session ``key`` is named to ``owner``'s client: its own sessions as it sent them, another
    client's never by name (admission's records say whom a seat went to)."""
    if owner is None:
        return f"session {key}"
    prefix = quote(owner, safe="") + SEPARATOR
    return f"session {key[len(prefix) :]}" if key.startswith(prefix) else "a session of another client"
