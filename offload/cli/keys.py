"""`offload keys create|list|revoke`: the HTTP server's API keys, managed in Redis directly (no server needed)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from offload.access.api_keys import KeyStore
from offload.cli.confirm import confirmed
from offload.cli.errors import fail
from offload.cli.options import ConfigOpt, DryRunOpt, JsonOpt, UrlOpt, YesOpt
from offload.cli.output import print_json
from offload.cli.session import configured_durability, run_redis
from offload.redis_client import RedisClient

T = TypeVar("T")
keys_app = typer.Typer(no_args_is_help=True, help="API keys for the HTTP server: create, list, revoke.")


def _with_keys(url: str | None, config: Path | None, fn: Callable[[KeyStore], Awaitable[T]]) -> T:
    """With offload.yaml's (or OFFLOAD_DURABILITY_*'s) `durability`, a key made or revoked here waits for the
    replicas as the server's do: a failover must not bring a revoked key back."""
    durability = configured_durability(config)

    def go(redis: RedisClient) -> Awaitable[T]:
        return fn(KeyStore(redis, durability=durability))

    return run_redis(url, go, config=config)


@keys_app.command("create")
def keys_create(
    scope: Annotated[str, typer.Option(help="admin, producer, worker or viewer.", show_default=False)],
    queues: Annotated[
        list[str] | None,
        typer.Option("--queues", "-q", help="Queues the key may use (repeat, or comma-separate; '*' for all)."),
    ] = None,
    name: Annotated[str, typer.Option(help="A label to recognise the key by.")] = "",
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Create a key and print its token once: only a hash is stored, so it cannot be shown again."""
    wanted = [q.strip() for item in queues or [] for q in item.split(",") if q.strip()]
    key, token = _with_keys(url, config, lambda ks: ks.create(scope, wanted, name))
    if json_out:
        print_json({**key.to_dict(), "token": token})
    else:
        typer.echo(token)
        typer.echo(
            f"key {key.id}: {key.scope} on {', '.join(key.to_dict()['queues'])} "
            "(store the token now: it is not shown again)",
            err=True,
        )


@keys_app.command("list")
def keys_list(json_out: JsonOpt = False, url: UrlOpt = None, config: ConfigOpt = None) -> None:
    """Every key: id, scope, queues, name, created (never a token)."""
    docs = [k.to_dict() for k in _with_keys(url, config, lambda ks: ks.list())]
    if json_out:
        print_json(docs)
        return
    for d in docs:
        typer.echo(f"{d['id']}  {d['scope']:<8}  {','.join(d['queues']):<30}  {d['name']}")


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from keys list).")],
    yes: YesOpt = False,
    dry_run: DryRunOpt = False,
    url: UrlOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Revoke a key, after asking: the next request with it gets 401."""
    if not any(k.id == key_id for k in _with_keys(url, config, lambda ks: ks.list())):
        fail(f"no key with id {key_id!r}")
    if not confirmed("revoke", f"key {key_id}", yes=yes, dry_run=dry_run):
        return
    if not _with_keys(url, config, lambda ks: ks.revoke(key_id)):
        fail(f"no key with id {key_id!r}")  # revoked by someone else meanwhile
    typer.echo(f"revoked {key_id}")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
