"""JSON schema rewrites for constraints: objects closed to their declared properties, a schema
moved under another's $defs."""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "contains", "propertyNames", "not", "if", "then", "else")


def closed_objects(schema: Any, close: bool = True) -> Any:
    """A copy of a JSON schema in which every object schema without additionalProperties (or
    patternProperties / unevaluatedProperties) has additionalProperties false; allOf members are
    left open at their own level (closed, each would refuse the others' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in _SCHEMAS:
        if isinstance(out.get(key), list):  # (items as a list: the old prefixItems)
            out[key] = [closed_objects(sub) for sub in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) or "properties" in out
    if close and is_object and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def rebased(schema: Any, base: str) -> Any:
    """A copy of a schema moved to `base`: its local references ("#", "#/$defs/X") point under it."""
    if isinstance(schema, list):
        return [rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, base) for k, v in schema.items()}
