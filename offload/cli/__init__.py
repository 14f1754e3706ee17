"""The `offload` command line (`offload = "offload.cli:main"`).

Nothing is built at import time: `main` loads `offload.cli.app`, which mounts every command group, while
`python -m offload.testing.sim` imports `offload.cli.sim` alone and so starts the simulator without the rest. The root
Typer app is `offload.cli.app.app` (no alias here: the submodule `offload.cli.app` would shadow it).
"""

from __future__ import annotations


def main() -> None:
    """Console-script entry point."""
    from offload.cli.app import main as run

    run()
