"""JSON schema rewrites for constraints: objects closed to their declared properties, a schema
moved under another's $defs."""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "contains", "propertyNames")
# Sub-schemas that add to their parent's own (allOf members, conditionals, negations, dependent
# schemas): closed, each would refuse the properties the others bring. A parent that has them, or a
# $ref, takes properties from elsewhere and is left open too.
_PARTIAL_LISTS = ("allOf",)
_PARTIAL = ("not", "if", "then", "else")
_ADDS_PROPERTIES = ("allOf", "anyOf", "oneOf", "if", "then", "else", "not", "$ref", "dependentSchemas")
_OPEN_ALREADY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every plain object schema that lists its properties (all
    its own, no additionalProperties said) has additionalProperties false; definitions that allOf
    combines with others stay open, and so do objects that list none (any object) or that require
    or count more keys than they list (closed, nothing would match)."""
    return _closed(schema, True, _combined_definitions(schema))


def _closed(schema: Any, close: bool, open_defs: set[str]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            partial = key == "dependentSchemas"
            out[key] = {name: _closed(sub, not partial and not (key in ("$defs", "definitions") and name in open_defs), open_defs)
                        for name, sub in out[key].items()}
    alternatives_whole = "properties" not in out  # (anyOf / oneOf beside the parent's own properties only add to them)
    for key in _SCHEMA_LISTS + _PARTIAL_LISTS:
        if isinstance(out.get(key), list):
            whole = key == "prefixItems" or (key not in _PARTIAL_LISTS and alternatives_whole)
            out[key] = [_closed(sub, whole, open_defs) for sub in out[key]]
    for key in _SCHEMAS + _PARTIAL:
        if isinstance(out.get(key), list):  # (items as a list: the old prefixItems)
            out[key] = [_closed(sub, True, open_defs) for sub in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = _closed(out[key], key not in _PARTIAL, open_defs)
    listed, required, least = out.get("properties"), out.get("required"), out.get("minProperties")
    fits = (isinstance(listed, dict) and all(r in listed for r in (required if isinstance(required, list) else []) if isinstance(r, str))
            and not (isinstance(least, int) and least > len(listed)))
    if close and fits and not set(_OPEN_ALREADY + _ADDS_PROPERTIES) & set(out):
        out["additionalProperties"] = False
    return out


def _combined_definitions(schema: Any) -> set[str]:
    """Names of $defs / definitions some allOf refers to directly (each only a part of its object)."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
            for member in members:
                ref = member.get("$ref") if isinstance(member, dict) else None
                if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                    names.add(ref.rsplit("/", 1)[1])
            for value in node.values():
                walk(value)

    walk(schema)
    return names


def rebased(schema: Any, base: str) -> Any:
    """A copy of a schema moved to `base`: its local references ("#", "#/$defs/X") point under it
    (an anchor, "#name", is found wherever the schema sits)."""
    if isinstance(schema, list):
        return [rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")) else rebased(v, base)
            for k, v in schema.items()}
