"""docs/reference/http-api.md and openapi.json: every route of `offload server`, from the FastAPI app's OpenAPI."""

from __future__ import annotations

import json
from typing import Any

from offload.server.app import create_app
from scripts.reference.schema_md import Schema, cell, field_table, type_text

METHODS = ("get", "post", "put", "patch", "delete")

INTRO = """# HTTP API

Every route of `offload server`, generated from the FastAPI app's OpenAPI description by
`python -m scripts.reference`; the description itself: [openapi.json](openapi.json) (a running server also serves
it at `/openapi.json`, browsable at `/docs`). How to run the server, keys and scopes, error bodies, GPU workers:
[Run the server and HTTP API](../how-to/server.md). Authenticate with `Authorization: Bearer <key>` or
`X-API-Key: <key>`; errors are JSON, `{"error": kind, "detail": ...}`.
"""


def _schema_ref(content: dict[str, Any]) -> str:
    body = content.get("application/json", {}).get("schema")
    return type_text(body) if body else ", ".join(f"`{kind}`" for kind in content)


def operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    lines = [f"### {method.upper()} {path}", ""]
    if op.get("summary"):
        lines += [op["summary"] + ("." if not op["summary"].endswith(".") else ""), ""]
    if op.get("description"):
        lines += [op["description"].strip(), ""]
    lines += ["Authentication: " + ("an API key" if op.get("security") else "none") + ".", ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            desc = cell(p.get("description", ""))
            req = "yes" if p.get("required") else "no"
            lines.append(f"| `{p['name']}` | {p['in']} | {cell(type_text(p.get('schema', {})))} | {req} | {desc} |")
        lines.append("")
    if "requestBody" in op:
        lines += [f"Body: {_schema_ref(op['requestBody'].get('content', {}))}.", ""]
    lines += ["| status | meaning | body |", "|---|---|---|"]
    for status, resp in op.get("responses", {}).items():
        body = _schema_ref(resp.get("content", {})) if resp.get("content") else ""
        lines.append(f"| {status} | {cell(resp.get('description', ''))} | {cell(body)} |")
    return [*lines, ""]


def page(api: dict[str, Any]) -> str:
    by_tag: dict[str, list[str]] = {}
    for path, item in api["paths"].items():
        for method in METHODS:
            if method in item:
                tag = (item[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).extend(operation(path, method, item[method]))
    lines = [INTRO]
    for tag in sorted(by_tag):
        lines += [f"## {tag.capitalize()}", "", *by_tag[tag]]
    schemas: dict[str, Schema] = api.get("components", {}).get("schemas", {})
    lines += ["## Schemas", "", "The bodies the routes above take and answer.", ""]
    for name in sorted(schemas):
        lines += [f"### {name}", "", *field_table(schemas[name])]
    return "\n".join(lines).rstrip("\n") + "\n"


def pages() -> dict[str, str]:
    api = create_app().openapi()
    return {
        "reference/http-api.md": page(api),
        "reference/openapi.json": json.dumps(api, indent=2, sort_keys=True) + "\n",
    }
