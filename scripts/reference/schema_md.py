"""JSON Schema (pydantic's, FastAPI's) as Markdown tables: the one renderer the config and HTTP pages share."""

from __future__ import annotations

import json
from typing import Any

Schema = dict[str, Any]


def ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def anchor(name: str) -> str:
    """The heading id mkdocs' toc gives `## Name` (lower case, no spaces or punctuation)."""
    return "".join(c for c in name.lower() if c.isalnum() or c in "-_")


def type_text(s: Schema) -> str:
    """A field's type in words; a model links to its own table (pipes are avoided: they split table cells)."""
    if "$ref" in s:
        name = ref_name(s["$ref"])
        return f"[{name}](#{anchor(name)})"
    for union in ("anyOf", "oneOf"):
        if union in s:
            parts = [type_text(p) for p in s[union] if p.get("type") != "null"]
            nullable = any(p.get("type") == "null" for p in s[union])
            text = " or ".join(parts)
            return f"{text} (optional)" if nullable else text
    if "enum" in s:
        return "one of " + ", ".join(f"`{v}`" for v in s["enum"])
    if "const" in s:
        return f"`{s['const']}`"
    kind = s.get("type", "any")
    if kind == "array":
        return f"list of {type_text(s.get('items', {}))}"
    if kind == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"map of name to {type_text(s['additionalProperties'])}"
    if s.get("format") == "password":
        return "secret string"
    return str(kind)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def default_text(s: Schema) -> str:
    if "default" not in s:  # a default_factory: pydantic leaves it out of the schema
        return "empty" if s.get("type") in ("array", "object") else "computed"
    value = s["default"]
    if isinstance(value, dict) and len(json.dumps(value)) > 40:
        return "see the model"
    return f"`{json.dumps(value)}`"


def field_table(model: Schema) -> list[str]:
    """One row per property: name, type, default (or required), description."""
    props: dict[str, Schema] = model.get("properties", {})
    if not props:
        return ["(no fields)", ""]
    required = set(model.get("required", []))
    head = "| field | type | default | description |"
    rows = [head, "|---|---|---|---|"]
    for name, prop in props.items():
        default = "required" if name in required else default_text(prop)
        desc = cell(prop.get("description", ""))
        rows.append(f"| `{name}` | {cell(type_text(prop))} | {default} | {desc} |")
    return [*rows, ""]


def walk_refs(root: Schema, defs: dict[str, Schema]) -> list[str]:
    """The models `root` reaches, breadth first, each once: the order their tables appear in."""
    seen: list[str] = []
    queue: list[Any] = [root]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref_name(ref) not in seen and ref_name(ref) in defs:
                seen.append(ref_name(ref))
                queue.append(defs[ref_name(ref)])
            queue.extend(v for k, v in node.items() if k != "$defs")
        elif isinstance(node, list):
            queue.extend(node)
    return seen
