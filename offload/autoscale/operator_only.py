"""What only the operator may set: anything that runs a command on the control-plane host.

The `local` provider starts processes on the server's own machine (its `python`, `workdir`, `handler`...), and
for such a provider a queue's `instance.handler` and `instance.env` are code too (a handler `os:system`, a
`PYTHONPATH` or `LD_PRELOAD`). An admin API key must not be a shell on the host that holds the vault key and
the Redis password, so these can only be set by someone who already has that host: offload.yaml, or the CLI
with direct Redis access (`offload providers create ...`). Commands for rented machines (a RunPod image, a
Vast.ai `onstart`) run on the rented machine, not here, and stay settable over the API.

This module is the one place that decides. The API calls `check_provider_over_api` and
`check_block_over_api` (403 naming why); the scaler calls `host_commands` before renting for a queue whose
block came from the API, so a block set while its provider did not exist yet cannot slip through later.
Settings added to autoscale blocks that carry commands belong in `HOST_COMMAND_FIELDS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from offload.errors import RequestError

HOST_PROVIDER_TYPES = frozenset({"local"})  # provider types whose machines are processes on this host
# dotted paths in a queue's autoscale block; a deployment clones and runs a repository's code wherever it goes
HOST_COMMAND_FIELDS = (
    "instance.handler",
    "instance.env",
    "deployment.git_url",
    "deployment.setup_cmd",
    "deployment.handler",
    "deployment.startup_cmd",
)
WHERE = "set it in offload.yaml or with the `offload` CLI on the server's host (direct Redis access)"


class OperatorOnly(RequestError):
    """A setting that would run commands on the control-plane host, refused over the HTTP API (403)."""


def runs_on_host(provider_type: str | None) -> bool:
    return provider_type in HOST_PROVIDER_TYPES


def check_provider_over_api(provider_type: str) -> None:
    """Creating or changing a provider over the API: refused for providers that run on this host."""
    if runs_on_host(provider_type):
        raise OperatorOnly(
            f"a {provider_type!r} provider runs commands on the server's own host, so it cannot be "
            f"created or changed over the HTTP API: {WHERE}"
        )


def host_commands(block: Mapping[str, Any]) -> list[str]:
    """The command-carrying fields a (validated, dumped) autoscale block sets."""
    found = []
    for path in HOST_COMMAND_FIELDS:
        value: Any = block
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value:
            found.append(path)
    return found


def check_block_over_api(queue: str, block: Mapping[str, Any], provider_type: str | None) -> None:
    """A queue's autoscale block set over the API: no host commands when its provider runs on this host."""
    if runs_on_host(provider_type) and (fields := host_commands(block)):
        raise OperatorOnly(
            f"queues.{queue}.autoscale.{fields[0]}: runs on the server's own host with provider "
            f"type {provider_type!r}, so it cannot be set over the HTTP API: {WHERE}"
        )
