"""prefixgate's configuration: a YAML file, ``PREFIXGATE_*`` environment variables and CLI flags.

Precedence: flags override environment, which overrides the file, which overrides the defaults.
Every scalar setting is declared once in ``OPTIONS`` below; the CLI, the environment reader and the
reference in docs/configuration.md (``prefixgate config-reference``) are all generated from that
table, so they cannot disagree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy import config_checks as check
from proxy.config_checks import describe, setting_of, yaml_problem
from proxy.state.redis.topology import REDIS_URL_FORMS
from routing.policies import DEFAULT_POLICY, POLICIES, policy_names

#: Claude Code traces (../shared/traces/claude-code): the gap between a session's requests has a
#: median of 13 s and a p90 of 185 s; 93 % of gaps are under 300 s. Until the traffic has shown
#: enough think gaps of its own (``routing.samples.MIN_SAMPLES``), a session quiet for
#: longer has most likely ended.
DEFAULT_IDLE_TTL_S = 300.0
#: Until the traffic has shown enough request durations, a session waits for a seat this long before
#: one rotates to it (then the learned bound: a few long requests, ``proxy/admission/learned.py``).
DEFAULT_WAIT_S = 30.0
#: Share of a rank's KV pool seated sessions' projected peaks may fill: the whole pool. Sessions that
#: outgrow their projection (none has ended yet, small pools) are parked, the quiet first, until
#: their rank holds them again; without that, 0.8's margin was what kept their blocks
#: (docs/investigations.md, "A budget of the whole pool", "Seats held").
DEFAULT_TARGET_FRACTION = 1.0

ENV_PREFIX = "PREFIXGATE_"
KiB = 1024
MiB = 1024 * 1024

__all__ = ["OPTIONS", "ConfigError", "Option", "Settings", "load_settings"]


class ConfigError(ValueError):
    """A configuration that cannot be used, with a message meant for the operator."""


class BackendConfig(BaseModel):
    """One vLLM rank."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the rank's name in logs, metrics, the dashboard and x-prefixgate-backend")
    url: str = Field(description="http(s)://host:port of its OpenAI-compatible server")
    pool_tokens: int | None = Field(
        default=None, gt=0, description="KV pool size in tokens; learned from vllm:cache_config_info if unset"
    )
    block_size: int | None = Field(default=None, gt=0, description="KV block size; learned if unset")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"backend url must be http(s)://host:port, got {url!r}")
        return url.rstrip("/")


class Settings(BaseModel):
    """Everything ``prefixgate serve`` needs. See ``OPTIONS`` for the meaning of each scalar."""

    model_config = ConfigDict(extra="forbid")

    backends: list[BackendConfig] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: str = DEFAULT_POLICY
    balance_factor: float = Field(default=1.25, ge=1.0)
    state: str | None = None
    redis_url: str | None = None
    index_ttl: float = Field(default=3600.0, gt=0)
    index_namespace: str | None = Field(default=None, min_length=1)
    redis_timeout: float = Field(default=0.25, gt=0)
    kv_events: str | None = None
    max_body_bytes: int = Field(default=32 * MiB, gt=0)
    health_interval: float = Field(default=2.0, gt=0)
    health_timeout: float = Field(default=2.0, gt=0)
    rank_facts_interval: float = Field(default=60.0, gt=0)
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(default=300.0, gt=0)
    retries: int = Field(default=1, ge=0)
    models_cache_ttl: float = Field(default=5.0, ge=0)
    log_level: str = "info"
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    workers: int = Field(default=1, ge=1)
    # security and bounds (proxy/auth.py, proxy/limits.py)
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_file: str | None = None
    admin_token: SecretStr | None = None
    upstream_api_key: SecretStr | None = None
    forward_client_auth: bool = False
    log_bodies: bool = False
    max_header_bytes: int = Field(default=64 * KiB, gt=0)
    max_messages: int = Field(default=10_000, gt=0)
    max_tools: int = Field(default=1_000, gt=0)
    max_json_depth: int = Field(default=64, gt=0)
    shutdown_timeout: float = Field(default=30.0, ge=0)
    no_canonicalize: bool = False
    debug_headers: bool = False
    # sessions and admission control (proxy/sessions.py, proxy/admission.py)
    no_admission: bool = False
    admission_queue: int = Field(default=1024, ge=0)
    target_fraction: float = Field(default=DEFAULT_TARGET_FRACTION, gt=0, le=2.0)
    # None: learned from the traffic (think gaps, request durations); a value overrides
    session_idle_ttl: float | None = Field(default=None, gt=0)
    admission_wait: float | None = Field(default=None, ge=0)
    max_sessions_per_rank: int = Field(default=0, ge=0)
    session_memory_mb: float = Field(default=512.0, gt=0)
    # connections: to the ranks (proxy/stages/forward.py) and from clients (proxy/server.py)
    upstream_keepalive: float = Field(default=4.0, gt=0)
    first_byte_timeout: float = Field(default=60.0, gt=0)
    client_keepalive: float = Field(default=75.0, gt=0)
    header_timeout: float = Field(default=10.0, gt=0)
    body_timeout: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=0, ge=0)
    trusted_proxies: str | None = None
    # Sections owned by later pipeline stages; validated by their own models.
    tokenization: dict[str, Any] = Field(default_factory=dict)
    canonical: dict[str, Any] = Field(default_factory=dict)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy not in policy_names():
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(policy_names())}")
        return policy

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        return check.log_level(level)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        return check.redis_url(url)

    @model_validator(mode="after")
    def _across(self) -> Settings:
        """What needs other settings or other packages' models: ``kv_events`` against the ranks,
        the ``tokenization:`` and ``canonical:`` sections (at load, not when a request needs them)."""
        check.kv_events(self.kv_events, [b.name for b in self.backends])
        check.sections(self.tokenization, self.canonical)
        return self

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, backends: list[BackendConfig]) -> list[BackendConfig]:
        names = [b.name for b in backends]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"backend names must be unique, duplicated: {', '.join(duplicates)}")
        return backends


@dataclass(frozen=True, slots=True)
class Option:
    """A scalar setting: its field in ``Settings``, its flag, its type and its help text."""

    field: str
    type: type
    help: str
    #: A learned setting's value until the traffic teaches it (``Settings`` leaves it None: unset,
    #: it is learned), shown as its default.
    starts_at: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "address to listen on"),
    Option("port", int, "port to listen on, 0 for one the system picks (the log names it)"),
    Option("policy", str, f"routing policy: {', '.join(POLICIES[:-1])} or {POLICIES[-1]}"),
    Option(
        "balance_factor", float, "a rank may take a request while its load is within this factor of the mean"
    ),
    Option(
        "state",
        str,
        "where the session table, prefix index and response map live: memory or redis "
        "(default: redis with --redis-url, else memory)",
    ),
    Option(
        "redis_url",
        str,
        f"{REDIS_URL_FORMS}: state shared by replicas (sessions, prefix index, response ids, "
        "admission's claims)",
    ),
    Option("index_ttl", float, "seconds an unused prefix-index entry lives in Redis"),
    Option("index_namespace", str, "the shared prefix index's namespace (unset: agreed through Redis)"),
    Option(
        "redis_timeout", float, "seconds a Redis call may take before routing falls back to the local mirror"
    ),
    Option(
        "kv_events",
        str,
        "'auto' (each rank's /kv_event_sources) or NAME=tcp://H:P[|tcp://H:P],...: exact mirror",
    ),
    Option("max_body_bytes", int, "largest request body accepted, in bytes (larger: 413)"),
    Option("health_interval", float, "seconds between health checks of each backend"),
    Option("health_timeout", float, "seconds a health check may take before the backend counts as down"),
    Option("rank_facts_interval", float, "seconds between readings of each rank's model, pool and KV source"),
    Option("connect_timeout", float, "seconds to connect to a backend before trying another"),
    Option(
        "read_timeout",
        float,
        "seconds a backend may stay silent (before or during a response) before it fails",
    ),
    Option(
        "retries", int, "extra attempts on another backend when one fails before any byte reached the client"
    ),
    Option("models_cache_ttl", float, "seconds the merged /v1/models answer is cached"),
    Option("log_level", str, "critical, error, warning, info or debug"),
    Option(
        "event_loop",
        str,
        "asyncio, or uvloop (less CPU per request, but accepts one connection per loop iteration: "
        "a burst of new connections waits)",
    ),
    Option(
        "workers",
        int,
        "processes serving the port, sharing state through Redis (--redis-url, else an embedded "
        "redis-server started and stopped with prefixgate)",
    ),
    Option("no_canonicalize", bool, "forward system prompts and tools as sent (no canonicalization rules)"),
    Option("debug_headers", bool, "add x-prefixgate-canonical-rewrites (rules applied) to responses"),
    Option("no_admission", bool, "admit every new session (no per-rank KV budget, no queue, no 429)"),
    Option(
        "admission_queue",
        int,
        "most sessions waiting for a seat on this replica; one more is answered 429 with Retry-After "
        "(0: no limit)",
    ),
    Option(
        "target_fraction",
        float,
        "share of a rank's KV pool (GPU, plus the CPU tier of a rank that offloads) its active sessions"
        " may fill, each counted at its projected peak (its budget); up to 2: above 1 seats more than"
        " those peaks fit, which one rank of 8 seats turned into throughput (docs/investigations.md)",
    ),
    Option(
        "session_idle_ttl",
        float,
        "override: seconds after its last request a session stops counting against its rank's budget "
        "(unset: learned from the sessions' think gaps, starting at the default)",
        starts_at=DEFAULT_IDLE_TTL_S,
    ),
    Option(
        "admission_wait",
        float,
        "override: seconds a session waits for a seat before quiet residents are parked for it (the "
        "rotation bound; unset: learned from requests' durations, from the default)",
        starts_at=DEFAULT_WAIT_S,
    ),
    Option("max_sessions_per_rank", int, "most active sessions on one rank (0: no limit)"),
    Option(
        "session_memory_mb",
        float,
        "memory for what this process keeps per session between turns (previous turn's tokens and "
        "block hashes, the explainer's previous body, turn log), least recently used session out first",
    ),
    Option(
        "api_keys_file",
        str,
        "YAML or JSON list of client keys {key, label, max_sessions}; with --api-key: requests need one",
    ),
    Option("admin_token", str, "token (Bearer) required on /admin/*, /dashboard and /metrics"),
    Option("upstream_api_key", str, "key sent to the ranks as 'Authorization: Bearer ...'"),
    Option("forward_client_auth", bool, "forward the client's Authorization header to the ranks"),
    Option("log_bodies", bool, "log request and response bodies (prompts and completions)"),
    Option("max_header_bytes", int, "largest total size of the request headers, in bytes (larger: 413)"),
    Option("max_messages", int, "most messages in a chat request (more: 400)"),
    Option("max_tools", int, "most tools in a request (more: 400)"),
    Option("max_json_depth", int, "deepest nesting of arrays and objects in a request body (deeper: 400)"),
    Option("shutdown_timeout", float, "seconds in-flight requests may take to finish after SIGTERM"),
    Option(
        "upstream_keepalive",
        float,
        "seconds an idle connection to a backend is kept for reuse; keep it below the backends' own "
        "keep-alive (vLLM's uvicorn: 5 s)",
    ),
    Option(
        "first_byte_timeout",
        float,
        "seconds a backend may take to start a streamed answer before the next one is tried "
        "(a whole answer has --read-timeout)",
    ),
    Option(
        "client_keepalive",
        float,
        "seconds an idle client connection stays open (sent as Keep-Alive: timeout=); above clients' "
        "own pool expiry (httpx and the openai SDK: 5 s)",
    ),
    Option("header_timeout", float, "seconds a client may take to send a request's headers (then 408)"),
    Option("body_timeout", float, "seconds a client may stay silent while sending a body (then 408)"),
    Option(
        "max_connections",
        int,
        "most client connections open at once; past it the longest-idle one is closed, or the new one "
        "refused with a 503 (0: what the open-files limit holds, with a connection to a backend each)",
    ),
    Option("trusted_proxies", str, "reverse proxies (comma-separated addresses) trusted for X-Forwarded-For"),
)


def parse_backend_spec(spec: str, index: int) -> dict[str, Any]:
    """``URL`` or ``NAME=URL`` (from ``--backend`` or ``PREFIXGATE_BACKENDS``) to a backend entry."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        name, url = f"rank-{index}", spec
    return {"name": name.strip(), "url": url.strip()}


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file is not valid YAML: {yaml_problem(path, exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    listen = data.pop("listen", None)
    if isinstance(listen, Mapping):  # `listen: {host, port}` reads better in a file
        data.setdefault("host", listen.get("host", "127.0.0.1"))
        data.setdefault("port", listen.get("port", 8000))
    return data


def read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw = environ.get(option.env)
        if raw is not None and raw != "":
            values[option.field] = raw
    api_keys = environ.get(ENV_PREFIX + "API_KEYS")
    if api_keys:
        values["api_keys"] = [k.strip() for k in api_keys.split(",") if k.strip()]
    backends = environ.get(ENV_PREFIX + "BACKENDS")
    if backends:
        specs = [s for s in backends.split(",") if s.strip()]
        values["backends"] = [parse_backend_spec(s, i) for i, s in enumerate(specs)]
    return values


def load_settings(
    config_file: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    backend_specs: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    api_keys: Sequence[str] | None = None,
) -> Settings:
    """Merge file, environment and flags (in rising precedence) into validated ``Settings``.

    A bad value raises ``ConfigError`` naming the setting, the value, what it may be and where it
    was set (the file, the environment variable or the flag)."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if config_file is not None:
        merged.update(read_config_file(config_file))
        origin.update(dict.fromkeys(merged, f"in {config_file}"))
    from_env = read_environment(os.environ if environ is None else environ)
    merged.update(from_env)
    origin.update({k: f"from {ENV_PREFIX}{'BACKENDS' if k == 'backends' else k.upper()}" for k in from_env})
    for key, value in (flags or {}).items():
        if value is not None:
            merged[key] = value
            origin[key] = f"from --{key.replace('_', '-')}"
    if backend_specs:
        merged["backends"] = [parse_backend_spec(s, i) for i, s in enumerate(backend_specs)]
        origin["backends"] = "from --backend"
    if api_keys:
        merged["api_keys"] = list(api_keys)
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = origin.get(setting_of(err))
            problems.append(describe(err) + (f" ({where})" if where else ""))
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from exc
