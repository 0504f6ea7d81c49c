"""A rule from a single file: this module defines toy rules, registers them, enables them through the
configuration, and checks that the engine applies them, counts them under their names and validates
their settings like the built-in rules'."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.canonical import (
    RULE_ORDER,
    CanonicalConfig,
    Canonicalizer,
    InMemorySessionCanonState,
    RuleSettings,
)
from proxy.canonical.rules import REGISTRY, Registry
from proxy.canonical.rules.base import (
    Destination,
    Moved,
    RuleConfig,
    TextEdit,
    TextRule,
    TextStep,
    ToolList,
    ToolsEdit,
    ToolsRule,
    ToolsStep,
)
from proxy.canonical.rules.text import Recogniser, extract_blocks


# --- the toy rules --------------------------------------------------------------------------------------
class ToyBannerSettings(RuleConfig):
    """Opt-in: a ``<banner>`` block (this fictional agent's per-session section) moved out of the system
    prompt, to a user message after it; ``versions``: the banner formats recognised."""

    enabled: bool = False
    versions: tuple[int, ...] = (1,)


_BANNERS = {
    1: Recogniser(("<banner>",), re.compile(r"^(?P<block><banner>[^\n]*</banner>)\n?", re.MULTILINE)),
}


def _build_banner(settings: ToyBannerSettings) -> TextStep | None:
    recognisers = [_BANNERS[v] for v in settings.versions if v in _BANNERS]
    if not recognisers:
        return None

    def run(text: str) -> TextEdit:
        out, blocks = extract_blocks(text, recognisers)
        return TextEdit(out, len(blocks), tuple(Moved(b, Destination.AFTER_SYSTEM) for b in blocks))

    return TextStep(run)


TOY_BANNER = TextRule("toy_banner", ToyBannerSettings, _build_banner)


class ToyStripSettings(RuleConfig):
    """On by default: a description suffix (``suffix``) dropped from every tool."""

    suffix: str = " (beta)"


def _build_strip(settings: ToyStripSettings) -> ToolsStep:
    suffix = settings.suffix

    def step(view: ToolList) -> ToolsEdit:
        out: list[Any] = []
        n = 0
        for tool in view.tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            desc = fn.get("description") if isinstance(fn, dict) else None
            if isinstance(fn, dict) and isinstance(desc, str) and desc.endswith(suffix):
                tool = {**tool, "function": {**fn, "description": desc.removesuffix(suffix)}}
                n += 1
            out.append(tool)
        return ToolsEdit(ToolList(tuple(out), view.names), n) if n else ToolsEdit(view)

    return step


TOY_STRIP = ToolsRule("toy_strip", ToyStripSettings, _build_strip)


@pytest.fixture
def toys() -> Iterator[None]:
    with REGISTRY.registered(TOY_BANNER, before="whitespace"), REGISTRY.registered(TOY_STRIP):
        yield


# --- the tests ------------------------------------------------------------------------------------------
def tool(name: str, description: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {}}}


SYSTEM = "You help.\n<banner>session 7f3a, /srv/app</banner>\nBe brief.  \n"


def request() -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "tools": [tool("a", "Reads (beta)"), tool("b", "Writes")],
    }


def canon(config: dict[str, Any]) -> Canonicalizer:
    return Canonicalizer(CanonicalConfig.model_validate(config), strict=True)


def test_registered_rules_are_in_the_settings_with_their_defaults(toys: None) -> None:
    names = [rule.name for rule, _ in RuleSettings().items()]
    at = RULE_ORDER.index("whitespace")
    assert names == [*RULE_ORDER[:at], "toy_banner", *RULE_ORDER[at:], "toy_strip"]
    rules = CanonicalConfig().rules
    assert rules.of(TOY_BANNER) == ToyBannerSettings() and not rules.of(TOY_BANNER).enabled
    assert rules.get("toy_strip") == ToyStripSettings()


def test_engine_applies_the_toy_rules_and_counts_them_under_their_names(toys: None) -> None:
    body = request()
    result = canon({"rules": {"toy_banner": {"enabled": True}}}).apply(body, api="chat")
    assert result.body["messages"] == [
        {"role": "system", "content": "You help.\nBe brief.\n"},
        {"role": "user", "content": "<banner>session 7f3a, /srv/app</banner>"},
        {"role": "user", "content": "hi"},
    ]
    assert [t["function"]["description"] for t in result.body["tools"]] == ["Reads", "Writes"]
    assert result.rewrites == {"toy_banner": 1, "whitespace": 1, "toy_strip": 1}
    again = canon({"rules": {"toy_banner": {"enabled": True}}}).apply(result.body, api="chat")
    assert again.body == result.body and not again.changed  # idempotent


def test_toy_rules_follow_their_settings_and_overrides(toys: None) -> None:
    body = request()
    off = canon({"rules": {"toy_strip": {"enabled": False}, "whitespace": {"enabled": False}}})
    assert off.apply(body, api="chat").body is body  # the banner rule is opt-in
    config = {
        "rules": {"toy_strip": {"suffix": " (alpha)"}},
        "models": {"qwen*": {"rules": {"toy_banner": {"enabled": True}}}},
        "clients": {"old-bot": {"rules": {"toy_banner": {"versions": [2]}}}},
    }
    c = canon(config)
    assert c.apply(body, api="chat", model="other").rewrites == {"whitespace": 1}
    assert c.apply(body, api="chat", model="qwen3").rewrites == {"toy_banner": 1, "whitespace": 1}
    assert c.apply(body, api="chat", model="qwen3", client_label="old-bot").rewrites == {"whitespace": 1}


def test_toy_settings_validate_like_the_builtin_ones(toys: None) -> None:
    with pytest.raises(ValidationError) as bad_key:
        CanonicalConfig.model_validate({"rules": {"toy_banner": {"enabled": True, "bogus": 1}}})
    assert [e["loc"] for e in bad_key.value.errors()] == [("rules", "toy_banner", "bogus")]
    with pytest.raises(ValidationError) as bad_value:
        CanonicalConfig.model_validate({"rules": {"toy_strip": {"suffix": 3}}})
    assert [e["loc"] for e in bad_value.value.errors()] == [("rules", "toy_strip", "suffix")]
    with pytest.raises(ValidationError, match="bogus"):
        CanonicalConfig.model_validate({"models": {"m": {"rules": {"toy_strip": {"bogus": True}}}}})
    assert ToyStripSettings.model_config["frozen"] and ToyStripSettings.model_config["extra"] == "forbid"


def test_unregistered_rule_is_unknown_and_configs_made_before_keep_it() -> None:
    with REGISTRY.registered(TOY_STRIP):
        c = canon({"rules": {"toy_strip": {"suffix": " (beta)"}}})
    assert "toy_strip" not in RuleSettings().model_dump()
    with pytest.raises(ValidationError, match="toy_strip"):
        CanonicalConfig.model_validate({"rules": {"toy_strip": {}}})
    assert c.apply(request(), api="chat", session=InMemorySessionCanonState()).rewrites["toy_strip"] == 1


class ToyMarkedSettings(RuleConfig):
    """A ``[session ...]`` tag dropped from system text; the step declares its tag as its marker."""


def _build_marked(texts_run: list[str]) -> Any:
    def build(settings: ToyMarkedSettings) -> TextStep:
        def run(text: str) -> TextEdit:
            texts_run.append(text)
            out, n = re.subn(r"\[session [^\]\n]*\]\n?", "", text)
            return TextEdit(out, n)

        return TextStep(run, markers=("[session ",))

    return build


def marked_canon(texts_run: list[str]) -> Canonicalizer:
    rule = TextRule("toy_marked", ToyMarkedSettings, _build_marked(texts_run))
    with REGISTRY.registered(rule, before="whitespace"):
        return canon({})


def test_a_step_whose_markers_are_absent_from_a_text_is_not_run() -> None:
    texts_run: list[str] = []
    body = request()  # its system text has no "[session " in it
    result = marked_canon(texts_run).apply(body, api="chat")
    assert texts_run == []
    assert "toy_marked" not in result.rewrites and result.rewrites["whitespace"] == 1


def test_a_step_runs_on_a_text_holding_one_of_its_markers() -> None:
    texts_run: list[str] = []
    body = request()
    body["messages"][0]["content"] = "You help.\n[session 7f3a]\nBe brief.\n"
    result = marked_canon(texts_run).apply(body, api="chat")
    assert texts_run == ["You help.\n[session 7f3a]\nBe brief.\n"]  # once: then no marker is left
    assert result.body["messages"][0]["content"] == "You help.\nBe brief.\n"
    assert result.rewrites["toy_marked"] == 1


def test_every_rule_set_is_compiled_when_the_canonicalizer_is_made() -> None:
    built: list[tuple[str, ...]] = []

    def build(settings: ToyStripSettings) -> ToolsStep:
        built.append((settings.suffix,))
        return _build_strip(settings)

    config = {
        "models": {"qwen*": {"rules": {"toy_counted": {"suffix": " (alpha)"}}}},
        "clients": {"old-bot": {"enabled": False}},
    }
    with REGISTRY.registered(ToolsRule("toy_counted", ToyStripSettings, build)):
        c = canon(config)
    # the base rules and the qwen override's (the client's turns canonicalization off)
    assert sorted(built) == [(" (alpha)",), (" (beta)",)]
    assert c.apply(request(), api="chat", model="qwen3").rewrites == {"whitespace": 1}
    assert c.apply(request(), api="chat", model="other").rewrites == {"whitespace": 1, "toy_counted": 1}
    assert c.apply(request(), api="chat", model="qwen3", client_label="old-bot").rewrites == {}
    assert len(built) == 2  # a request only runs steps


def test_registry_rejects_duplicate_and_unusable_names() -> None:
    registry = Registry([TOY_STRIP])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(TOY_STRIP)
    for name in ("model_dump", "_private", "not a name"):
        with pytest.raises(ValueError, match="configuration key"):
            registry.register(ToolsRule(name, ToyStripSettings, _build_strip))
    registry.register(TOY_BANNER, before="toy_strip")
    assert registry.names() == ("toy_banner", "toy_strip")
