"""What only the operator may set: anything that runs a command on the control-plane host, and anything that
decides where the operator's secrets go.

The `local` provider starts processes on the server's own machine (its `python`, `workdir`, `handler`...), and
for such a provider a queue's `instance.handler` and `instance.env` are code too (a handler `os:system`, a
`PYTHONPATH` or `LD_PRELOAD`). An admin API key must not be a shell on the host that holds the vault key and
the Redis password, so these can only be set by someone who already has that host: offload.yaml, or the CLI
with direct Redis access (`offload providers create ...`). Commands for rented machines (a RunPod image, a
Vast.ai `onstart`) run on the rented machine, not here, and stay settable over the API.

The operator's secrets (the server's worker key, vault credentials, offload.yaml's `instance.env`) go only to
providers the operator made (`offload providers create` on the server's host: origin `operator`), and vault
credentials and offload.yaml's `instance.env` only to blocks written in offload.yaml: an API-set block chooses
the machine's image and commands, which see its environment. So an operator-made provider cannot be changed or
deleted over the API (nor, then, re-created under its name elsewhere), and an API-set block cannot name a vault
credential. A rental an admin key configured carries only what its requests carried (`secrets_problem`).

This module is the one place that decides. The API calls `check_provider_over_api` and
`check_block_over_api` (403 naming why); the scaler calls `host_commands` and `secrets_problem` before renting,
so a block set while its provider did not exist yet (or was made over the API later) cannot slip through.
Settings added to autoscale blocks that carry commands belong in `HOST_COMMAND_FIELDS`, those that name an
operator's secret in `OPERATOR_SECRET_FIELDS`.
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
# dotted paths in a queue's autoscale block that name a secret of the operator's (kept in the vault)
OPERATOR_SECRET_FIELDS = ("deployment.git_credential",)
WHERE = "set it in offload.yaml or with the `offload` CLI on the server's host (direct Redis access)"
OPERATOR, API = "operator", "api"  # a provider's origin (provider_store.py)


class OperatorOnly(RequestError):
    """A setting that would run commands on the control-plane host, refused over the HTTP API (403)."""


def runs_on_host(provider_type: str | None) -> bool:
    return provider_type in HOST_PROVIDER_TYPES


def check_provider_over_api(provider_type: str, origin: str = API, name: str = "") -> None:
    """Creating, changing or deleting a provider over the API: refused for providers that run on this host and
    for providers the operator made (they receive the operator's secrets)."""
    if runs_on_host(provider_type):
        raise OperatorOnly(
            f"a {provider_type!r} provider runs commands on the server's own host, so it cannot be "
            f"created or changed over the HTTP API: {WHERE}"
        )
    if origin == OPERATOR:
        raise OperatorOnly(
            f"provider {name!r} was made by the operator and receives the operator's secrets, so it cannot be "
            "changed, deleted or replaced over the HTTP API: use `offload providers` on the server's host"
        )


def host_commands(block: Mapping[str, Any]) -> list[str]:
    """The command-carrying fields a (validated, dumped) autoscale block sets."""
    return _set(block, HOST_COMMAND_FIELDS)


def _set(block: Mapping[str, Any], paths: tuple[str, ...]) -> list[str]:
    found = []
    for path in paths:
        value: Any = block
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value:
            found.append(path)
    return found


def check_block_over_api(queue: str, block: Mapping[str, Any], provider_type: str | None) -> None:
    """A queue's autoscale block set over the API: no vault credential; no host commands when its provider runs
    on this host."""
    if fields := _set(block, OPERATOR_SECRET_FIELDS):
        raise OperatorOnly(
            f"queues.{queue}.autoscale.{fields[0]}: a vault credential is the operator's and goes only to "
            f"blocks written in offload.yaml (a block set over the API chooses the machine's image and commands, "
            f"which would see it): name it in offload.yaml"
        )
    if runs_on_host(provider_type) and (fields := host_commands(block)):
        raise OperatorOnly(
            f"queues.{queue}.autoscale.{fields[0]}: runs on the server's own host with provider "
            f"type {provider_type!r}, so it cannot be set over the HTTP API: {WHERE}"
        )


def secrets_problem(
    queue: str, block: Mapping[str, Any], source: str, provider: str, origin: str, own_worker_key: bool
) -> str | None:
    """Why a rental of `queue`'s block (from `source`: offload.yaml or api) from `provider` (made by `origin`)
    would carry an operator's secret where the operator did not send it (None: it would not)."""
    if source != "offload.yaml" and (fields := _set(block, OPERATOR_SECRET_FIELDS)):
        return f"{fields[0]} of a block set over the HTTP API: vault credentials go only to offload.yaml's blocks"
    if origin == OPERATOR:
        return None
    made = (
        f"provider {provider!r} was made over the HTTP API (or before offload recorded who made providers): "
        "`offload providers adopt` it on the server's host once you have checked where it points, or"
    )
    if fields := _set(block, OPERATOR_SECRET_FIELDS):
        return f"{made} {fields[0]} (a vault credential) cannot go to it"
    env = (block.get("instance") or {}).get("env") if isinstance(block.get("instance"), Mapping) else None
    if source == "offload.yaml" and env:
        return f"{made} offload.yaml's instance.env for queue {queue} cannot go to it"
    if not own_worker_key:
        return f"{made} give it its own worker_key: the server's worker key goes only to the operator's providers"
    return None
