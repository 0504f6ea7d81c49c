"""The shared prefix index's namespace, agreed by every replica through Redis.

The index's keys are namespaced by the served model (``index.py``), so that replicas of two
deployments, or a fleet restarted with another model, never read each other's blocks. Which model
a replica would name depends on which rank it could ask, and when: one started before its ranks
knows none. So the name is agreed once through Redis, first writer wins (``SET NX``): every replica
that starts later, or learns its ranks later, uses the name written first. ``--index-namespace``
fixes it instead. Delete the key (``NAMESPACE_KEY``) to let the next proposal win, say after the
whole fleet moved to another model.
"""

from __future__ import annotations

from typing import Any

#: Where the agreed namespace is kept.
NAMESPACE_KEY = "prefixgate:index-namespace"


def agree(client: Any, key: str, proposal: str | None) -> str | None:
    """The namespace stored at ``key``, storing ``proposal`` first if none is (one round trip each;
    None: none stored and none proposed). ``client``: a redis client, raising on Redis errors."""
    if proposal is not None:
        client.set(key, proposal, nx=True)
    stored = client.get(key)
    if stored is None:
        return None
    return stored.decode() if isinstance(stored, bytes) else str(stored)
