"""Who may call prefixgate, and what the ranks are told about it.

- Client API keys (``--api-key``, ``--api-keys-file``): when any is configured, every endpoint but
  the probes ``/health`` and ``/ready`` needs ``Authorization: Bearer <key>``; otherwise everything
  is open (issue 2).
  Keys are compared in constant time; only the key's *label* is kept (request state, logs, metrics).
- The admin token (``--admin-token``) guards ``/admin/*``, ``/dashboard`` and ``/metrics``; it is
  separate from the client keys. Unset, those paths are open.
- Upstream credentials: the ranks get ``Authorization: Bearer <--upstream-api-key>``. The client's
  own ``Authorization`` reaches them only with ``--forward-client-auth``, or when neither client
  keys nor an upstream key are configured (issue 2's pass-through).

``AuthMiddleware`` does all three before the app sees the request, so the pipeline never holds a
client key it must not forward. It leaves ``client`` (the ``ClientKey``: label and limits, never
the key), ``client_label`` and ``is_admin`` in the request's state for later stages.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import yaml
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.config import ConfigError, Settings
from proxy.config_checks import yaml_problem
from proxy.errors import ProxyError, error_response

log = logging.getLogger("prefixgate.auth")

#: Paths that need the admin token (when one is configured) instead of a client key.
DASHBOARD_PATH = "/dashboard"
ADMIN_PATHS = ("/metrics", DASHBOARD_PATH)
ADMIN_PREFIX = "/admin/"
#: Paths open to anyone: load balancers and orchestrators probe them without credentials.
OPEN_PATHS = frozenset({"/health", "/ready"})
AUTHORIZATION = b"authorization"


#: The page for a browser opening the dashboard without the right credential: called with what it
#: needs ("admin token" or "API key") and whether one was presented (and refused); answers 401.
LoginPage = Callable[[str, bool], Response]


@dataclass(frozen=True, slots=True)
class ClientKey:
    """A client API key as prefixgate keeps it: its SHA-256 digest, never the key itself."""

    label: str
    digest: bytes
    max_sessions: int | None = None
    #: Admission's queue serves higher priorities first (default 0; negative is lower).
    priority: int = 0
    #: Within a priority, the key's share of the room that frees, against the other keys' weights.
    weight: float = 1.0
    #: The highest priority a request of this key may ask for (``x-prefixgate-priority``); its own
    #: ``priority`` when the keys file grants no more.
    max_priority: int | None = None

    def granted(self, asked: int) -> int:
        """The priority a request asking for ``asked`` gets: at most what the key was granted."""
        return min(asked, self.priority if self.max_priority is None else self.max_priority)


def digest(secret: str | bytes) -> bytes:
    """SHA-256 of a key: equal-length inputs for ``hmac.compare_digest``, and no key kept in memory."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def _key_entry(entry: Any, where: str) -> ClientKey:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: each key must be a mapping with 'key' and 'label'")
    unknown = set(entry) - {"key", "label", "max_sessions", "priority", "weight", "max_priority"}
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    key, label, cap = entry.get("key"), entry.get("label"), entry.get("max_sessions")
    priority, weight = entry.get("priority", 0), entry.get("weight", 1)
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{where}: 'key' must be a non-empty string")
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"{where}: 'label' must be a non-empty string")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
        raise ConfigError(f"{where}: 'max_sessions' must be a positive integer")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(f"{where}: 'priority' must be an integer (higher is served first)")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < float("inf"):
        raise ConfigError(f"{where}: 'weight' must be a positive number")
    top = entry.get("max_priority")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < priority):
        raise ConfigError(f"{where}: 'max_priority' must be an integer at least the key's 'priority'")
    return ClientKey(label.strip(), digest(key.strip()), cap, priority, float(weight), top)


def read_keys_file(path: str | Path) -> list[ClientKey]:
    """Keys from a YAML or JSON file: a list of ``{key, label, max_sessions?, priority?, weight?,
    max_priority?}``, or
    ``{keys: [...]}``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read API keys file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise ConfigError(f"API keys file is neither YAML nor JSON: {yaml_problem(path, exc)}") from exc
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise ConfigError(f"API keys file {path} must hold a list of keys (or a mapping 'keys:' to one)")
    return [_key_entry(entry, f"{path}: key #{i + 1}") for i, entry in enumerate(data)]


class KeyRing:
    """The configured client keys. Empty: authentication is off."""

    def __init__(self, keys: Iterable[ClientKey] = ()) -> None:
        self.keys: tuple[ClientKey, ...] = tuple(keys)
        seen: dict[bytes, str] = {}
        for key in self.keys:
            if key.digest in seen:
                raise ConfigError(f"API key of {key.label!r} is the same as the key of {seen[key.digest]!r}")
            seen[key.digest] = key.label
        self._by_label = {k.label: k for k in self.keys}

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        keys = [ClientKey(f"key-{i}", digest(k.get_secret_value())) for i, k in enumerate(settings.api_keys)]
        if settings.api_keys_file:
            keys.extend(read_keys_file(settings.api_keys_file))
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, presented: bytes) -> ClientKey | None:
        """The key equal to ``presented``. Every configured key is compared, so the time taken does
        not depend on which key (if any) matched nor on how many leading bytes were right."""
        wanted = digest(presented)
        found: ClientKey | None = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, wanted):
                found = key
        return found

    def get(self, label: str) -> ClientKey | None:
        """The key labelled ``label`` (for its ``max_sessions``)."""
        return self._by_label.get(label)


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer`` header, if any."""
    for name, value in headers:
        if name == AUTHORIZATION:
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def query_token(scope: Scope) -> bytes | None:
    """``?token=...`` of the request, if any (accepted for the dashboard page only)."""
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
        if name == "token" and value:
            return value.encode()
    return None


def _equal(token: bytes, expected_digest: bytes) -> bool:
    return hmac.compare_digest(digest(token), expected_digest)


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX[:-1]


def unauthorized(message: str) -> ProxyError:
    return ProxyError(
        401,
        message,
        type_="invalid_request_error",
        code="invalid_api_key",
        headers={"www-authenticate": 'Bearer realm="prefixgate"'},
    )


class AuthMiddleware:
    """ASGI middleware: client keys, the admin token and the ``Authorization`` sent upstream."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        admin_token: str | None = None,
        forward_client_auth: bool = False,
        upstream_api_key: str | None = None,
        metrics: Any = None,
        login_page: LoginPage | None = None,
    ) -> None:
        self.app = app
        self.keys = keys
        self.admin_digest = digest(admin_token) if admin_token else None
        self.metrics = metrics
        self.login_page = login_page
        # issue 2: with no credentials configured at all, the client's header goes through untouched
        self.strip_client_auth = not forward_client_auth and bool(keys or upstream_api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        state = scope.setdefault("state", {})
        state["client"] = None
        state["client_label"] = None
        # with nothing configured everyone is admin (issue 2: all open); else the admin token decides
        state["is_admin"] = self.admin_digest is None and not self.keys
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if path not in OPEN_PATHS:
            token = bearer_token(headers)
            if token is None and path == DASHBOARD_PATH:
                token = query_token(scope)  # a browser cannot send a header when a page is opened
            admin_path = is_admin_path(path)
            admin = self.admin_digest
            if admin_path and admin is not None and token is not None and _equal(token, admin):
                state["is_admin"] = True
            elif admin_path and admin is not None and not (self.keys and path.startswith(ADMIN_PREFIX)):
                await self._reject(scope, receive, send, "admin", "this endpoint needs the admin token")
                return
            elif self.keys:
                # also /admin/* for a client key: the admin API shows a client its own sessions only
                key = self.keys.match(token) if token is not None else None
                if key is None:
                    if token is None:
                        await self._reject(
                            scope,
                            receive,
                            send,
                            "missing",
                            "missing API key: send 'Authorization: Bearer <key>'",
                        )
                    else:
                        await self._reject(scope, receive, send, "invalid", "invalid API key")
                    return
                state["client"] = key
                state["client_label"] = key.label
                metrics = self.metrics
                if metrics is not None:
                    metrics.series(metrics.client_requests, key.label).inc()
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("client %s: %s %s", key.label, scope["method"], path)
        if self.strip_client_auth:
            scope["headers"] = [h for h in headers if h[0] != AUTHORIZATION]
        await self.app(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_rejections.labels(reason).inc()
        client = scope.get("client")
        log.info(
            "401 on %s %s from %s: %s", scope["method"], scope["path"], client[0] if client else "?", reason
        )
        if scope["path"] == DASHBOARD_PATH and self.login_page is not None:
            # a browser opening the page gets a form for the token, not a JSON error body
            presented = bearer_token(scope["headers"]) is not None or query_token(scope) is not None
            needs = "admin token" if self.admin_digest is not None else "API key"
            page = self.login_page(needs, presented)
            page.headers["www-authenticate"] = 'Bearer realm="prefixgate"'
            await page(scope, receive, send)
            return
        await error_response(unauthorized(message))(scope, receive, send)


def upstream_auth_headers(settings: Settings) -> dict[str, str]:
    """Headers every request to a rank carries: the upstream key, when configured."""
    if settings.upstream_api_key is not None:
        return {"Authorization": f"Bearer {settings.upstream_api_key.get_secret_value()}"}
    return {}


def install(
    settings: Settings, metrics: Any = None, login_page: LoginPage | None = None
) -> tuple[KeyRing, Callable[[ASGIApp], AuthMiddleware]]:
    """The key ring for ``settings``, and a maker of the ``AuthMiddleware`` around an app.
    ``login_page``: what a request for the dashboard without the right credential gets."""
    keys = KeyRing.from_settings(settings)
    options: dict[str, Any] = {
        "keys": keys,
        "admin_token": settings.admin_token.get_secret_value() if settings.admin_token else None,
        "forward_client_auth": settings.forward_client_auth,
        "upstream_api_key": (
            settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
        ),
        "metrics": metrics,
        "login_page": login_page,
    }
    if keys:
        log.info("client API keys: %d (%s)", len(keys), ", ".join(k.label for k in keys.keys))
        if settings.admin_token is None:
            log.warning("client keys are configured but no admin token: /metrics and /admin/* are open")
    return keys, lambda inner: AuthMiddleware(inner, **options)
