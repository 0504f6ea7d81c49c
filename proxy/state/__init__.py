"""Where the state that decides placement lives: the backends (``backends.py``: the protocol and
the registry), the session table (``sessions.py``), this process's per-session state (``local.py``),
the stores' protocols with their in-process implementations, and the Redis implementations
(``redis/``). Importing the package imports none of them."""
