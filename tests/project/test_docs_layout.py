"""The docs' layout page and architecture match the tree: every module of `offload/` is named in
docs/explanation/layout.md (in its package's paragraph), and every repository path docs/explanation/architecture.md
names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout() -> str:
    page = (ROOT / "docs" / "explanation" / "layout.md").read_text()
    start = page.index("```\noffload/queue/")
    return page[start : page.index("```", start + 3)]


def _paragraphs(layout: str) -> dict[str, str]:
    """Package dir ('offload/worker/') -> the text of its lines (a header line and its indented continuation)."""
    out: dict[str, str] = {}
    current = ""
    for line in layout.splitlines():
        if line and not line.startswith(" "):
            current = line.split()[0]
        out[current] = out.get(current, "") + "\n" + line
    return out


def test_every_module_is_named_in_the_layout_page() -> None:
    layout = _layout()
    paragraphs = _paragraphs(layout)
    missing = []
    for path in sorted((ROOT / "offload").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        parts = rel.parts
        if len(parts) == 2:  # offload/x.py: named by its path
            if str(rel) not in layout:
                missing.append(str(rel))
            continue
        package = f"{parts[0]}/{parts[1]}/"
        text = paragraphs.get(package, "")
        if not re.search(rf"\b{re.escape(path.stem)}\b", text):
            missing.append(str(rel))
    assert not missing, f"modules docs/explanation/layout.md does not name: {missing}"


def test_every_path_named_in_the_architecture_exists() -> None:
    text = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:offload|tests|bench|deploy|docs)/[\w/.*-]+?)(?:::\w+)?`", text))
    assert len(named) > 20, "the architecture names few paths: is the pattern right?"
    missing = []
    for rel in sorted(named):
        if "*" in rel:
            if not list(ROOT.glob(rel)):
                missing.append(rel)
        elif not (ROOT / rel).exists():
            missing.append(rel)
    assert not missing, f"paths docs/explanation/architecture.md names that are not in the tree: {missing}"
