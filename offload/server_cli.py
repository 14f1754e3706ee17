"""Commands of the control-plane server: `offload server`, `offload keys ...`, and the wiring behind
`offload worker --handler` (the GPU worker that talks to the server over HTTP)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import orjson
import typer

from offload.cli_errors import _errors, _fail
from offload.connection import connect
from offload.pipeline_cli import ConfigOpt, _settings
from offload.server.keys import ADMIN_ENV, KeyStore, check_admin_key

T = TypeVar("T")

keys_app = typer.Typer(no_args_is_help=True, help="API keys for the HTTP server: create, list, revoke.")
UrlOpt = Annotated[str | None, typer.Option(
    "--url", show_default=False,
    help="Redis/Valkey URL. Default: the config's redis_url, OFFLOAD_REDIS_URL, REDIS_URL, else embedded.",
)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]


def server(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8080,
    config: ConfigOpt = None,
    url: UrlOpt = None,
    max_batch: Annotated[int, typer.Option(min=1, max=100_000, help="Jobs per batch enqueue.")] = 1000,
    max_body: Annotated[int, typer.Option(min=1024, help="Largest request body, bytes.")] = 16 << 20,
    worker_lease: Annotated[float, typer.Option(
        min=0.5, help="Seconds a GPU worker's leases last without a heartbeat.")] = 30.0,
    max_connections: Annotated[int, typer.Option(
        min=1, help="Concurrent connections and requests; past it new requests get 503.")] = 2048,
    header_timeout: Annotated[float, typer.Option(
        min=0.1, help="Seconds a client has to send a request's headers before its connection is closed.")] = 10.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log each request (method, path, status).")] = True,
) -> None:
    """Serve the HTTP API, SSE events and /metrics. Keys: `offload keys create`, or OFFLOAD_ADMIN_KEY."""
    from offload.server.runner import serve
    from offload.server.state import ServerOptions

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with _errors():
        if admin := os.environ.get(ADMIN_ENV):
            check_admin_key(admin)  # refuse before listening, naming the variable
    settings = _settings(config)
    options = ServerOptions(redis_url=url or settings.redis_url, settings=settings, max_batch=max_batch,
                            max_body=max_body, worker_lease_ms=int(worker_lease * 1000),
                            max_connections=max_connections, header_timeout_s=header_timeout)
    with _errors():
        serve(options, host, port, log_level=log_level, access_log=access_log)


async def _with_keys(url: str | None, fn: Callable[[KeyStore], Awaitable[T]]) -> T:
    redis = await connect(url)
    try:
        return await fn(KeyStore(redis))
    finally:
        await redis.aclose()


def _redis_url(url: str | None, config: Path | None) -> str | None:
    if url:
        return url
    return _settings(config).redis_url


@keys_app.command("create")
def keys_create(
    scope: Annotated[str, typer.Option(help="admin, producer, worker or viewer.", show_default=False)],
    queues: Annotated[list[str] | None, typer.Option(
        "--queues", "-q", help="Queues the key may use (repeat, or comma-separate; '*' for all).")] = None,
    name: Annotated[str, typer.Option(help="A label to recognise the key by.")] = "",
    json_out: JsonOpt = False, url: UrlOpt = None, config: ConfigOpt = None,
) -> None:
    """Create a key and print its token once: only a hash is stored, so it cannot be shown again."""
    wanted = [q.strip() for item in queues or [] for q in item.split(",") if q.strip()]
    with _errors():
        key, token = asyncio.run(_with_keys(_redis_url(url, config), lambda ks: ks.create(scope, wanted, name)))
        if json_out:
            typer.echo(orjson.dumps({**key.to_dict(), "token": token}).decode())
        else:
            typer.echo(token)
            typer.echo(f"key {key.id}: {key.scope} on {', '.join(key.to_dict()['queues'])} "
                       "(store the token now: it is not shown again)", err=True)


@keys_app.command("list")
def keys_list(json_out: JsonOpt = False, url: UrlOpt = None, config: ConfigOpt = None) -> None:
    """Every key: id, scope, queues, name, created (never a token)."""
    with _errors():
        keys = asyncio.run(_with_keys(_redis_url(url, config), lambda ks: ks.list()))
        docs = [k.to_dict() for k in keys]
        if json_out:
            typer.echo(orjson.dumps(docs).decode())
            return
        for d in docs:
            typer.echo(f"{d['id']}  {d['scope']:<8}  {','.join(d['queues']):<30}  {d['name']}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="The key's id (from keys list).")],
                url: UrlOpt = None, config: ConfigOpt = None) -> None:
    """Revoke a key: the next request with it gets 401."""
    with _errors():
        found = asyncio.run(_with_keys(_redis_url(url, config), lambda ks: ks.revoke(key_id)))
    if not found:
        _fail(f"no key with id {key_id!r}")
    typer.echo(f"revoked {key_id}")


def run_handler_worker(queue: str, handler: str, server_url: str | None, token: str | None, load: str | None,
                       concurrency: int, grace: float) -> None:
    """`offload worker --handler`: needs only the server URL and a worker key, never Redis or storage."""
    from offload.queue.keys import validate_queue
    from offload.worker.remote import RemoteOptions, run_remote_worker

    if not server_url:
        _fail("--handler needs --server URL (or OFFLOAD_SERVER)")
    if not token:
        _fail("--handler needs a worker key: OFFLOAD_TOKEN (or --token)")
    with _errors():
        validate_queue(queue)
        options = RemoteOptions(server=server_url, token=token, queue=queue, concurrency=concurrency, grace_s=grace)
        try:
            asyncio.run(run_remote_worker(options, handler, load))
        except (ImportError, AttributeError, ValueError) as exc:
            _fail(f"cannot load the handler: {exc}")


def register(app: typer.Typer) -> None:
    app.command()(server)
    app.add_typer(keys_app, name="keys")
