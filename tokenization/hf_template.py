"""Chat templates rendered the way transformers renders them, without importing transformers.

transformers compiles a model's template in an immutable jinja2 sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag, a ``tojson`` filter that
keeps key order and does not escape non-ASCII, and the globals ``raise_exception`` and
``strftime_now``. Templates written for it rely on exactly that environment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenization.base import UnsupportedRequest


class TemplateError(UnsupportedRequest):
    """The chat template raised (``raise_exception``, or a type error on the request's values) or could
    not be loaded. An ``UnsupportedRequest``: the rank, which answers 400, is the judge of such input."""


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for masks; it renders its body."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tags = {"generation"}  # per instance: jinja2 declares it a (mutable) set

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in transformers' environment (cached per source text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def load_chat_template(model_dir: Path, override: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """The model's chat template(s) (a string, or a dict name -> template) and its special tokens map.

    Looks in ``override``, then ``chat_template.jinja``, then ``tokenizer_config.json``'s
    ``chat_template`` (a string or a list of ``{name, template}``), as transformers does.
    """
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = (
        json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    )
    special: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            special[key] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    template: Any
    if override is not None:
        template = override.read_text(encoding="utf-8")
    elif (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template if isinstance(t, Mapping)}
    if not template:
        raise TemplateError(f"{model_dir}: no chat template (chat_template.jinja or tokenizer_config.json)")
    return template, special


def select_template(template: Any, has_tools: bool) -> str:
    """transformers' choice among named templates: ``tool_use`` when tools are given, else ``default``."""
    if isinstance(template, str):
        return template
    if has_tools and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise TemplateError(f"no 'default' chat template among {sorted(template)}")


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, Any],
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text, rendered as transformers' ``apply_chat_template(tokenize=False)`` does."""
    kwargs = {**special_tokens, **(template_kwargs or {})}
    for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
        kwargs.pop(reserved, None)
    try:
        return compile_template(source).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        raise TemplateError(str(exc)) from exc
