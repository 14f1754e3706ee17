"""The `offload` command line (`offload = "offload.cli:main"`).

Nothing is built at import time: `main` loads `offload.cli.app`, which mounts every command group, while
`python -m offload.sim` imports `offload.cli.sim` alone and so starts the simulator without the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer


def main() -> None:
    """Console-script entry point."""
    from offload.cli.app import main as run

    run()


def __getattr__(name: str) -> typer.Typer:
    """`from offload.cli import app` keeps working, loaded on first use."""
    if name == "app":
        from offload.cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
