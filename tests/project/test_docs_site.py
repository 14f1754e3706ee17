"""The docs site (mkdocs.yml, docs/): it builds with --strict (a broken link, anchor or nav entry fails), its
generated reference pages are what the code generates now (`python -m scripts.reference`), and every CLI command
and option, offload.yaml field and HTTP route has an entry there, read from the code itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from pydantic import BaseModel

from offload.autoscale.settings import AutoscaleSettings
from offload.cli.app import app
from offload.config import Settings
from offload.server.app import create_app
from scripts.reference.__main__ import DOCS, generated, main, stale

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def _section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line) up to the next heading of the same level."""
    level = heading.split(" ", 1)[0]
    start = text.index("\n" + heading + "\n")
    end = re.search(rf"\n{level} ", text[start + len(heading) + 1 :])
    return text[start : start + len(heading) + 1 + end.start()] if end else text[start:]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    res = subprocess.run([*MKDOCS, "-d", str(tmp_path / "site")], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The real mkdocs.yml's validation, on a one-page site with a dead link and a dead anchor."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](nowhere.md) and [here](#no-such-heading)\n")
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"), nav=["index.md"], plugins=["search"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    res = subprocess.run([*MKDOCS[:-1], "-f", str(tmp_path / "mkdocs.yml")], env=ENV, capture_output=True, text=True)
    assert res.returncode != 0
    assert "nowhere.md" in res.stderr and "no-such-heading" in res.stderr


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return generated()


def test_the_generated_reference_is_current(pages: dict[str, str]) -> None:
    assert stale(pages) == [], "run: python -m scripts.reference"
    assert main(["--check"]) == 0


def test_a_stale_page_is_named(tmp_path: Path, pages: dict[str, str]) -> None:
    for rel, text in pages.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert stale(pages, tmp_path) == []
    (tmp_path / "reference/cli.md").write_text(pages["reference/cli.md"].replace("## offload enqueue\n", ""))
    (tmp_path / "reference/errors.md").unlink()
    assert stale(pages, tmp_path) == ["reference/cli.md", "reference/errors.md"]


def _commands(cmd: Any, path: list[str]) -> list[tuple[str, Any]]:
    subs = getattr(cmd, "commands", None)
    if subs is None:
        return [(" ".join(path), cmd)]
    return [c for name, sub in subs.items() if not sub.hidden for c in _commands(sub, [*path, name])]


def test_every_cli_command_and_option_has_an_entry() -> None:
    text = (DOCS / "reference/cli.md").read_text()
    commands = _commands(typer.main.get_command(app), ["offload"])
    assert len(commands) > 40
    for path, cmd in commands:
        section = _section(text, f"## {path}")
        for param in cmd.params:
            if getattr(param, "hidden", False):
                continue
            name = param.name.upper() if param.param_type_name == "argument" else param.opts[0]
            assert f"`{name}" in section, f"{path}: {name} has no entry in docs/reference/cli.md"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation names, through Optional, unions, lists, dicts and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def test_every_config_field_has_an_entry() -> None:
    text = (DOCS / "reference/config.md").read_text()
    seen: set[type[BaseModel]] = set()
    todo: list[type[BaseModel]] = [Settings, AutoscaleSettings]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        heading = "## Top level" if model is Settings else f"## {model.__name__}"
        section = _section(text, heading)
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert f"| `{key}` |" in section, f"{model.__name__}.{key} has no entry in docs/reference/config.md"
            todo.extend(_models(field.annotation))
    assert len(seen) > 10


def test_every_http_route_has_an_entry() -> None:
    text = (DOCS / "reference/http-api.md").read_text()
    routes = [
        f"### {method.upper()} {path}"
        for path, item in create_app().openapi()["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    ]
    assert len(routes) > 40
    missing = [r for r in routes if f"\n{r}\n" not in text]
    assert not missing, f"routes without an entry in docs/reference/http-api.md: {missing}"


@pytest.mark.parametrize("page", ["reference/cli.md", "reference/config.md", "reference/http-api.md"])
def test_generated_pages_say_how_they_are_made(page: str) -> None:
    assert "python -m scripts.reference" in (DOCS / page).read_text()


def test_the_readme_is_a_first_page() -> None:
    """Under 200 lines, every link it makes resolves in the tree, and its example offload.yaml loads."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert len(links) > 20
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert "pip install offload` does not work today" in text  # no release on a registry yet: say so


def test_the_readme_example_loads(tmp_path: Path) -> None:
    from offload.config import load_settings

    block = re.search(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block
    (tmp_path / "offload.yaml").write_text(block.group(1))
    settings = load_settings(tmp_path / "offload.yaml", env={"RUNPOD_API_KEY": "k"})
    assert settings.backend_for("gpu")[1].kind == "runpod" and settings.queue("gpu").daily_job_cap == 1000


def test_every_environment_variable_has_an_entry() -> None:
    """Every OFFLOAD_* name the package reads or sets is in the environment reference."""
    text = (DOCS / "reference/environment.md").read_text()
    names = {
        m
        for path in (ROOT / "offload").rglob("*.py")
        for m in re.findall(r"\bOFFLOAD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert len(names) > 30
    assert sorted(n for n in names if f"`{n}`" not in text and f"`{n}=" not in text) == []


def test_every_metric_has_an_entry() -> None:
    """Every metric family `/metrics` exports (offload/server/metrics.py, offload/autoscale/status.py)."""
    text = (DOCS / "reference/metrics.md").read_text()
    sources = [ROOT / "offload/server/metrics.py", ROOT / "offload/autoscale/status.py"]
    names = {m for path in sources for m in re.findall(r'"(offload_[a-z_]+)"', path.read_text())}
    assert len(names) > 15
    assert sorted(n for n in names if f"`{n}" not in text) == []
