"""docs/reference/config.md and offload.schema.json: offload.yaml from the settings models' JSON schema."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel

from offload.autoscale.settings import AutoscaleSettings
from offload.config import Settings
from scripts.reference.schema_md import Schema, field_table, walk_refs

INTRO = """# offload.yaml

Every field of `offload.yaml`, generated from the settings models (`offload/config.py`,
`offload/backends/settings.py`, `offload/storage/settings.py`, `offload/autoscale/settings.py`,
`offload/autoscale/alerts.py`) by `python -m scripts.reference`. What the settings do, with an example file:
[Configure offload.yaml and each provider](../how-to/configuration.md); which file is read:
[Command line](../how-to/command-line.md). `${VAR}` and `${VAR:-default}` take a value from the environment;
`offload config check` validates a file and names the offending field.

The same schema as JSON, for an editor's YAML language server:
[offload.schema.json](offload.schema.json) (`# yaml-language-server: $schema=...` at the top of the file).
"""


def _classes(annotation: Any) -> list[type]:
    """The models (pydantic or dataclass) an annotation names, through Optional, unions, lists and dicts."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        return [c for arg in typing.get_args(annotation) for c in _classes(arg)]
    return []


def _models() -> dict[str, type]:
    """Class name -> class, for every settings model offload.yaml reaches."""
    found: dict[str, type] = {}
    todo: list[type] = [Settings, AutoscaleSettings]
    while todo:
        cls = todo.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        hints = typing.get_type_hints(cls)
        todo.extend(c for hint in hints.values() for c in _classes(hint))
    return found


def _comments(cls: type) -> dict[str, str]:
    """Field -> the code comment that explains it: the one on its line, else the comment lines right above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        field = re.match(r"    (\w+): [^=]*(?:=.*)?$", line)
        if field:
            trailing = line.split("  # ", 1)[1] if "  # " in line else ""
            text = trailing or " ".join(above)
            if text:
                out[field.group(1)] = text
        above = []
    return out


def _describe(defs: dict[str, Schema]) -> None:
    """Give each field without a description the comment its model's code has for it."""
    for name, cls in _models().items():
        props = defs.get(name, {}).get("properties", {})
        comments: dict[str, str] = {}
        for base in reversed(cls.__mro__):  # a base's comments first, the class's own win
            if base.__module__.startswith("offload.") and base.__name__ not in ("Strict",):
                comments.update(_comments(base))
                if base is not cls and base.__name__.startswith("_") and base.__doc__ and name in defs:
                    shared = " ".join(base.__doc__.split())  # a private base's docstring covers its fields
                    defs[name]["description"] = f"{defs[name].get('description', '')}\n\n{shared}".strip()
        for field, text in comments.items():
            if field in props and not props[field].get("description"):
                props[field]["description"] = text


def schema() -> Schema:
    """Settings' JSON schema, with a queue's `autoscale` block (validated separately) typed in."""
    root: Schema = Settings.model_json_schema()
    auto = AutoscaleSettings.model_json_schema()
    defs: dict[str, Any] = root["$defs"]
    defs.update(auto.pop("$defs", {}))
    defs["AutoscaleSettings"] = auto
    defs["QueueSettings"]["properties"]["autoscale"] = {
        "anyOf": [{"$ref": "#/$defs/AutoscaleSettings"}, {"type": "null"}],
        "default": None,
        "description": "the queue's autoscaling policy (see Autoscale GPU machines)",
    }
    _describe(defs)
    top = {"$defs": {"Settings": {k: v for k, v in root.items() if k != "$defs"}}}
    _describe(top["$defs"])
    root["properties"] = top["$defs"]["Settings"]["properties"]
    root["title"] = "offload.yaml"
    return root


def page(root: Schema) -> str:
    defs: dict[str, Schema] = root["$defs"]
    lines = [INTRO, "## Top level", "", *field_table(root)]
    for name in walk_refs(root, defs):
        model = defs[name]
        if "properties" not in model:  # a model also written as a bare value (InputMapSettings): its fields
            model = next((branch for branch in model.get("anyOf", []) if "properties" in branch), model)
        lines += [f"## {name}", ""]
        if model.get("description"):
            lines += [" ".join(model["description"].split()), ""]
        lines += field_table(model)
    return "\n".join(lines).rstrip("\n") + "\n"


def pages() -> dict[str, str]:
    root = schema()
    return {
        "reference/config.md": page(root),
        "reference/offload.schema.json": json.dumps(root, indent=2, sort_keys=True) + "\n",
    }
