"""`python -m offload` runs the CLI, for environments where the console script is not on PATH."""

from offload.cli import main

main()
