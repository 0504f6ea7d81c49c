"""Every Redis implementation of the state, and what they share. Importing the package imports none
of them.

- ``backend.py``: ``RedisState``, the ``redis`` state backend: one link, every store on it;
- ``link.py``: one Redis as its stores see it: client, circuit breaker, background writes;
- ``topology.py``: ``--redis-url``: one server, Sentinel or Redis Cluster, and slot-safe keys;
- ``sessions.py`` and ``changes.py``: the session table's store and its change log;
- ``claims.py``: admission's claims on room, and the channel that says room freed;
- ``index.py``, ``index_scripts.py`` and ``index_namespace.py``: the shared prefix index, its Lua
  scripts, and the namespace the replicas agree on;
- ``responses.py``: response id -> rank;
- ``embedded.py``: the Redis server ``serve --workers`` starts without ``--redis-url``;
- ``check.py``: why Redis refused a connection (a wrong password, a TLS mismatch), said at start.

The protocols these implement, and their in-process implementations, live beside this package
(``proxy/state/``) and in ``routing/index/``, which imports nothing of it.
"""
