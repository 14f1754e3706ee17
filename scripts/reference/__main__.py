"""`python -m scripts.reference [--check]`: write the generated reference pages under docs/, or (--check) exit 1
naming each page that differs from what the code generates now."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.reference import cli_ref, config_ref, errors_ref, http_ref

DOCS = Path(__file__).resolve().parents[2] / "docs"


def generated() -> dict[str, str]:
    """Page path under docs/ -> its text, for every generated page."""
    out: dict[str, str] = {}
    for module in (cli_ref, config_ref, http_ref, errors_ref):
        out.update(module.pages())
    return out


def stale(pages: dict[str, str], docs: Path = DOCS) -> list[str]:
    """The pages under `docs` that are missing or differ from `pages`."""
    return [rel for rel, text in pages.items() if not (docs / rel).exists() or (docs / rel).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when a generated page is stale; write nothing")
    args = parser.parse_args(argv)
    pages = generated()
    changed = stale(pages)
    if args.check:
        for rel in changed:
            print(f"error: docs/{rel} is stale: run python -m scripts.reference", file=sys.stderr)
        return 1 if changed else 0
    for rel in changed:
        (DOCS / rel).parent.mkdir(parents=True, exist_ok=True)
        (DOCS / rel).write_text(pages[rel])
        print(f"wrote docs/{rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
