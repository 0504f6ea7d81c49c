"""A start-up check of ``--redis-url`` that names misconfigurations instead of reporting an outage.

The index, the session table and the response map treat any Redis error as an outage and fall back
to this replica's own records, which keeps requests flowing but hides a wrong password or a TLS
mismatch behind "unreachable" warnings. ``diagnose_redis`` pings once at start-up and, when that
fails, tells which of these it is; the URL in messages never carries the password.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

import redis

from proxy.state.redis.topology import fail_fast

log = logging.getLogger("prefixgate.redis")


#: The password of a URL's credentials (``scheme://[user]:PASSWORD@``), whatever follows the ``@``
#: (one host, or a Sentinel or Cluster URL's list of nodes).
_PASSWORD = re.compile(r"^([^:/]+://[^:@/]*:)[^@/]*@")


def redact(url: str) -> str:
    """``url`` without its password (user names stay: they help find the right ACL entry)."""
    return _PASSWORD.sub(r"\1***@", url, count=1)


def _ping(url: str, timeout: float) -> None:
    client = fail_fast(url, timeout)
    try:
        client.ping()
    finally:
        client.close()


def diagnose_redis(url: str, timeout: float = 2.0) -> str | None:
    """Ping Redis at ``url`` once: None when it answers, else a message saying what is wrong."""
    shown = redact(url)
    try:
        _ping(url, timeout)
        return None
    except (redis.AuthenticationError, redis.ResponseError) as exc:
        # redis-py reports a missing password as an AuthenticationError too (NOAUTH, or HELLO refused)
        auth = isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc)
        if auth and urlsplit(url).password is None:
            return f"redis at {shown} requires a password: use redis://:PASSWORD@host:port/db ({exc})"
        if auth:
            return f"redis at {shown} refused the credentials ({exc}): check the password in --redis-url"
        return f"redis at {shown} answered an error: {exc}"
    except redis.RedisError as exc:
        failure = exc
    if urlsplit(url).scheme == "rediss":
        # a TLS handshake with a plain server fails or hangs; a plain PING tells the two apart
        plain = urlunsplit(urlsplit(url)._replace(scheme="redis"))
        try:
            _ping(plain, timeout)
            speaks_plain = True
        except (redis.AuthenticationError, redis.ResponseError):
            speaks_plain = True  # it answered in plain Redis protocol, just not to an anonymous PING
        except redis.RedisError:
            speaks_plain = False
        if speaks_plain:
            return (
                f"redis at {shown}: the server speaks plain Redis, not TLS (the TLS handshake failed: "
                f"{failure}); use redis:// or point rediss:// at the server's tls-port"
            )
        return f"redis at {shown}: TLS connection failed ({type(failure).__name__}: {failure})"
    return f"redis at {shown} is unreachable ({type(failure).__name__}: {failure})"


def log_redis_problem(url: str, timeout: float = 2.0) -> str | None:
    """``diagnose_redis`` and log its finding as an error; returns the message (None: all is well)."""
    problem = diagnose_redis(url, timeout)
    if problem is not None:
        log.error("%s; until it is fixed every replica routes from its own records only", problem)
    return problem
