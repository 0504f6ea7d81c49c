"""Rule 2, ``schema_key_order``: canonical key order of tool envelopes and JSON-schema keywords.

Chat templates render tools with ``tojson``, which keeps key order, so two serializations of the same
tool (Codex's ``parameters``-first wire shape, a re-serialized zod schema) are different tokens.
Keywords get one fixed order: a preferred order for the common ones, then the rest by name. The
*names* inside ``properties`` (and other name -> schema maps) keep the order the client sent, as do
``required`` and every data value (``enum``, ``default``, ``examples``...): which order of parameter
names a session sees is ``param_order``'s decision (``proxy.canonical.rules.param_order``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import orjson

from proxy.canonical.rules.base import RuleConfig, ToolList, ToolsEdit, ToolsRule, ToolsStep

NAME = "schema_key_order"


def _rank_table(keys: tuple[str, ...]) -> dict[str, int]:
    return {key: rank for rank, key in enumerate(keys)}


_TOOL_RANK = _rank_table(("type", "function", "name", "description"))
_FUNCTION_RANK = _rank_table(("name", "description", "parameters", "strict"))
_SCHEMA_RANK = _rank_table(
    (
        "$schema",
        "$id",
        "$ref",
        "title",
        "description",
        "type",
        "enum",
        "const",
        "format",
        "default",
        "properties",
        "required",
        "additionalProperties",
        "items",
    )
)
_UNRANKED = 1 << 30

# Keywords whose value is a map of user-chosen names to subschemas: names keep their order.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords whose value is one subschema.
SCHEMA_ONE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
        "contains",
        "not",
        "if",
        "then",
        "else",
        "propertyNames",
        "unevaluatedItems",
        "unevaluatedProperties",
        "items",
    }
)
# Keywords whose value is a list of subschemas (``items`` may be one too, in draft 4-7).
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})


def _ordered_keys(obj: Mapping[str, Any], rank: dict[str, int]) -> list[str]:
    return sorted(obj, key=lambda k: (rank.get(k, _UNRANKED), k))


def canonical_schema(schema: Any) -> Any:
    """``schema`` with its keywords in canonical order, recursively through subschemas."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key in _ordered_keys(schema, _SCHEMA_RANK):
        value = schema[key]
        if key in SCHEMA_MAPS and isinstance(value, dict):
            value = {name: canonical_schema(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            value = [canonical_schema(sub) for sub in value]
        elif key in SCHEMA_ONE:
            value = canonical_schema(value)
        out[key] = value
    return out


def canonical_tool(tool: Any) -> Any:
    """``tool`` (OpenAI tool envelope) with envelope, function and schema keys in canonical order.

    Anything that is not a dict is returned as is; unknown envelope keys are kept, sorted last.
    """
    if not isinstance(tool, dict):
        return tool
    out: dict[str, Any] = {}
    for key in _ordered_keys(tool, _TOOL_RANK):
        value = tool[key]
        if key == "function" and isinstance(value, dict):
            fn: dict[str, Any] = {}
            for fkey in _ordered_keys(value, _FUNCTION_RANK):
                fvalue = value[fkey]
                fn[fkey] = canonical_schema(fvalue) if fkey == "parameters" else fvalue
            value = fn
        out[key] = value
    return out


def canonical_keys(tools: Sequence[Any]) -> tuple[bytes, ...]:
    """The canonical serialization of each tool: equal bytes, same definition."""
    return tuple(orjson.dumps(canonical_tool(t)) for t in tools)


class SchemaKeyOrderSettings(RuleConfig):
    """Rule 2: canonical key order of tool envelopes and schema keywords."""


def _step(view: ToolList) -> ToolsEdit:
    canon = tuple(canonical_tool(t) for t in view.tools)
    keys = tuple(orjson.dumps(c) for c in canon)
    n = sum(1 for key, raw in zip(keys, view.tools, strict=True) if key != orjson.dumps(raw))
    if not n:
        return ToolsEdit(replace(view, keys=keys))
    return ToolsEdit(ToolList(canon, view.names, keys), n)


def _build(settings: SchemaKeyOrderSettings) -> ToolsStep:
    return _step


RULE = ToolsRule(NAME, SchemaKeyOrderSettings, _build)
