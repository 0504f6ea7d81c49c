"""The configuration's checks that read other packages' models, and how a bad value is told.

``proxy.config`` calls these at load, so a wrong value stops ``prefixgate serve`` with one line naming
the setting, the value and what it may be (exit 2), before anything starts; never a traceback when
the first request or the app's start-up reaches it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ValidationError

from proxy.canonical.config import CanonicalConfig
from proxy.state.redis.topology import SCHEMES, parse
from routing.kv_sources import parse_kv_event_specs
from tokenization.config import TokenizerConfig

#: ``log_level`` values, as Python's logging names them (case-insensitive).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

Section = TypeVar("Section", bound=BaseModel)


class SettingError(ValueError):
    """A bad value found by a check across the settings, naming the top-level setting it is in (so
    the error can say where that was set)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def describe(error: Mapping[str, Any], prefix: str = "") -> str:
    """One pydantic error as one phrase: where, what is wrong, and the value given."""
    loc = ".".join(str(p) for p in (prefix, *error["loc"]) if p != "")
    message = str(error["msg"]).removeprefix("Value error, ")
    given = error.get("input")
    if error["type"] != "missing" and not isinstance(given, dict | list) and repr(given) not in message:
        message += f" (got {given!r})"
    return f"{loc}: {message}" if loc else message


def setting_of(error: Mapping[str, Any]) -> str:
    """The top-level setting a pydantic error of ``Settings`` is about ("" when none is)."""
    found = (error.get("ctx") or {}).get("error")
    if isinstance(found, SettingError):
        return found.setting
    return str(error["loc"][0]) if error["loc"] else ""


def yaml_problem(path: str | Path, exc: yaml.YAMLError) -> str:
    """Where and what a YAML error is, on one line, naming the file (not PyYAML's "<unicode string>")."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    return f"{where}: {context + ': ' if context else ''}{problem}"


def log_level(level: str) -> str:
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    return level.lower()


def redis_url(url: str | None) -> str | None:
    if url is None:
        return None
    if urlsplit(url).scheme not in SCHEMES:
        schemes = ", ".join(s + "://" for s in SCHEMES)
        raise ValueError(f"redis url must start with {schemes}, got {url!r}")
    parse(url)  # a Sentinel or Cluster URL's nodes, service and database (ValueError: which is wrong)
    return url


def kv_events(spec: str | None, ranks: Sequence[str]) -> None:
    """``auto`` or ``NAME=tcp://H:P[|tcp://H:P],...`` naming configured ranks (when any is)."""
    if spec is None or spec.strip() == "auto":
        return
    try:
        sources = parse_kv_event_specs(spec)
    except ValueError as exc:
        raise SettingError("kv_events", str(exc)) from None
    for source in sources:
        if ranks and source.rank not in ranks:
            raise SettingError(
                "kv_events",
                f"kv_events names rank {source.rank!r}, which is not configured; "
                f"configured: {', '.join(ranks)}",
            )


def sections(tokenization: dict[str, Any], canonical: dict[str, Any]) -> None:
    """The ``tokenization:`` and ``canonical:`` sections, by their own models."""
    config = _section(TokenizerConfig, tokenization, "tokenization")
    if config.kind == "hf":
        if config.path is None:
            raise SettingError(
                "tokenization",
                "tokenization.path is required with kind 'hf' (the model directory holding "
                "tokenizer.json), or choose kind tiktoken or backend",
            )
        if not (config.path / "tokenizer.json").is_file():
            raise SettingError(
                "tokenization", f"tokenization.path {str(config.path)!r} holds no tokenizer.json"
            )
    _section(CanonicalConfig, canonical, "canonical")


def _section(model: type[Section], data: dict[str, Any], name: str) -> Section:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise SettingError(name, "; ".join(describe(err, name) for err in exc.errors())) from None
