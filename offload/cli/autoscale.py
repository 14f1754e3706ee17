"""`offload autoscale ...` and `offload providers ...`: inspect and steer the autoscaler from a shell.

Commands talk to Redis directly (like the queue commands), so they work with or without a running server.
Creating or updating a provider needs OFFLOAD_VAULT_MASTER_KEY in this shell's environment: the credentials
are encrypted here, before they reach Redis.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import datetime
from typing import Annotated, Any

import orjson
import typer
from rich.table import Table

from offload.cli.confirm import confirmed
from offload.cli.errors import errors, fail
from offload.cli.logs import configure as configure_logging
from offload.cli.options import ConfigOpt, DryRunOpt, JsonOpt, LogLevel, LogLevelOpt, UrlOpt, YesOpt
from offload.cli.output import out, print_json
from offload.cli.session import run_redis, settings
from offload.connection import connect
from offload.env import env_str
from offload.redis_client import RedisClient

autoscale_app = typer.Typer(no_args_is_help=True, help="GPU autoscaling: status, events, protect, run the loop.")
providers_app = typer.Typer(no_args_is_help=True, help="Machine providers (mock, local, runpod, vastai).")
autoscale_app.add_typer(providers_app, name="providers")
credentials_app = typer.Typer(
    no_args_is_help=True,
    help="Vault credentials for private git repositories "
    "(a queue's deployment.git_credential); there is no HTTP route for them.",
)
autoscale_app.add_typer(credentials_app, name="credentials")


@autoscale_app.command("status")
def status(
    json_out: JsonOpt = False,
    url: UrlOpt = None,
    history: Annotated[int, typer.Option(min=0, help="Finished instances to show too.")] = 20,
) -> None:
    """Instances (id, queue, provider, status, worker, protected, cost), spend per queue, the leader."""
    from offload.autoscale.status import snapshot

    snap = run_redis(url, lambda r: snapshot(r, history=history))
    if json_out:
        print_json(snap)
        return
    table = Table("INSTANCE ID", "QUEUE", "PROVIDER", "STATUS", "WORKER", "PROTECTED", "COST", "REASON")
    for row in snap["instances"]:
        table.add_row(
            row["id"],
            row["queue"],
            row["provider"],
            row["status"],
            row["worker_id"] or "-",
            str(row["protected"]).lower(),
            f"${row['cost']:.4f}",
            row["reason"][:60] or "",
        )
    console = out()
    console.print(table)
    for queue, q in sorted(snap["queues"].items()):
        dry = f" (dry-run ${q['dry_run_spend_today']:.2f})" if q["dry_run_spend_today"] else ""
        console.print(
            f"{queue}: {q['active']} active, {q['draining']} draining; spend today ${q['spend_today']:.2f}"
            f"{dry}, this month ${q['spend_month']:.2f}"
        )
        for line in q["why"]:
            console.print(f"  {line}", markup=False)
    leader = snap["leader"]
    console.print(f"leader: {leader['owner']} (token {leader['token']})" if leader else "leader: none")


@autoscale_app.command("events")
def events(
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50, json_out: JsonOpt = False, url: UrlOpt = None
) -> None:
    """The autoscaler's journal: rentals, readiness, drains, teardowns, failures, backoffs, alerts."""
    from offload.autoscale.instances import read_events

    rows = run_redis(url, lambda r: read_events(r, limit))
    if json_out:
        print_json(rows)
        return
    for e in rows:
        when = datetime.fromtimestamp(float(e.get("ts", 0))).strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{when}  {e.get('kind', ''):<13} {e.get('message', '')}")


def _protect(instance_id: str, value: bool, url: str | None) -> None:
    from offload.autoscale.instances import InstanceStore

    async def go(r: RedisClient) -> None:
        await InstanceStore(r).set_protect(instance_id, value)

    try:
        run_redis(url, go)
    except KeyError as exc:
        fail(str(exc))
    typer.echo(f"{instance_id} {'protected' if value else 'unprotected'}")


@autoscale_app.command("protect")
def protect(instance_id: Annotated[str, typer.Argument(help="as-… id")], url: UrlOpt = None) -> None:
    """Keep an instance through every scale-down until unprotected."""
    _protect(instance_id, True, url)


@autoscale_app.command("unprotect")
def unprotect(instance_id: Annotated[str, typer.Argument(help="as-… id")], url: UrlOpt = None) -> None:
    """Let scale-down rules apply to the instance again."""
    _protect(instance_id, False, url)


@autoscale_app.command("run")
def run(
    config: ConfigOpt = None,
    url: UrlOpt = None,
    server_url: Annotated[
        str | None, typer.Option(help="Server URL for `local` workers (else autoscaler.public_url).")
    ] = None,
    log_level: LogLevelOpt = LogLevel.INFO,
) -> None:
    """Run the autoscaler loop in the foreground (servers run it too; one leader acts at a time)."""
    from offload.autoscale.scaler import Autoscaler

    configure_logging(log_level)
    loaded = settings(config)

    async def main() -> None:
        redis = await connect(url or loaded.redis_url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await Autoscaler(redis, loaded, server_url=server_url).run(stop)
        finally:
            await redis.aclose()

    with errors():
        asyncio.run(main())


def _config(text: str | None, pairs: list[str] | None) -> dict[str, Any]:
    """--config's JSON object with every --set key=value on top (a value that parses as JSON is taken as such)."""
    data: dict[str, Any] = {}
    if text:
        try:
            loaded = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            fail(f"--config is not valid JSON: {exc}")
        if not isinstance(loaded, dict):
            fail("--config must be a JSON object")
        data.update(loaded)
    for pair in pairs or []:
        k, sep, v = pair.partition("=")
        if not sep:
            fail(f"--set expects key=value, got {pair!r}")
        try:
            data[k] = orjson.loads(v)
        except orjson.JSONDecodeError:
            data[k] = v
    return data


CfgOpt = Annotated[str | None, typer.Option("--config", help="Provider settings as a JSON object.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="key=value (JSON values allowed); repeatable.")]


@providers_app.command("create")
def providers_create(
    name: Annotated[str, typer.Argument()],
    kind: Annotated[str, typer.Option("--type", help="mock, local, runpod or vastai.")],
    config: CfgOpt = None,
    sets: SetOpt = None,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Register a provider; its secrets are encrypted with OFFLOAD_VAULT_MASTER_KEY."""
    from offload.autoscale.provider_store import ProviderStore

    data = _config(config, sets)
    rec = run_redis(url, lambda r: ProviderStore(r).create(name, kind, data))
    print_json(rec.to_dict()) if json_out else typer.echo(f"provider {name} ({kind}) created")


@providers_app.command("update")
def providers_update(
    name: Annotated[str, typer.Argument()],
    config: CfgOpt = None,
    sets: SetOpt = None,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Change settings; secrets you do not pass (or pass masked) keep their stored values."""
    from offload.autoscale.provider_store import ProviderStore

    data = _config(config, sets)
    rec = run_redis(url, lambda r: ProviderStore(r).update(name, data))
    print_json(rec.to_dict()) if json_out else typer.echo(f"provider {name} updated")


@providers_app.command("list")
def providers_list(url: UrlOpt = None, json_out: JsonOpt = False) -> None:
    """Every provider, secrets masked."""
    from offload.autoscale.provider_store import ProviderStore

    recs = run_redis(url, lambda r: ProviderStore(r).list())
    if json_out:
        print_json([r.to_dict() for r in recs])
        return
    for r in recs:
        typer.echo(f"{r.name:<20} {r.type:<8} {r.origin:<8} {orjson.dumps(r.config).decode()}")


@providers_app.command("show")
def providers_show(name: Annotated[str, typer.Argument()], url: UrlOpt = None, json_out: JsonOpt = False) -> None:
    """One provider as JSON, secrets masked (the same document with or without --json)."""
    from offload.autoscale.provider_store import ProviderStore

    print_json(run_redis(url, lambda r: ProviderStore(r).get(name)).to_dict())


@providers_app.command("adopt")
def providers_adopt(name: Annotated[str, typer.Argument()], url: UrlOpt = None, json_out: JsonOpt = False) -> None:
    """Vouch for a provider made over the HTTP API (or before offload recorded who made providers): it then
    receives the operator's secrets (the worker key, vault credentials, offload.yaml's instance.env) and the API
    can no longer change or delete it. Check where it points first (`offload providers show NAME`)."""
    from offload.autoscale.provider_store import ProviderStore

    rec = run_redis(url, lambda r: ProviderStore(r).adopt(name))
    print_json(rec.to_dict()) if json_out else typer.echo(f"provider {name} is now the operator's")


@providers_app.command("delete")
def providers_delete(
    name: Annotated[str, typer.Argument()], yes: YesOpt = False, dry_run: DryRunOpt = False, url: UrlOpt = None
) -> None:
    """Delete a provider that has no live instances, after asking."""
    from offload.autoscale.provider_store import ProviderStore

    run_redis(url, lambda r: ProviderStore(r).get(name))  # an unknown name fails here, before any question
    if not confirmed("delete", f"provider {name}", yes=yes, dry_run=dry_run):
        return
    run_redis(url, lambda r: ProviderStore(r).delete(name))
    typer.echo(f"provider {name} deleted")


@credentials_app.command("set")
def credentials_set(
    name: Annotated[str, typer.Argument(help="The name a deployment's git_credential uses.")],
    host: Annotated[
        str, typer.Option("--host", help="The git host it is for (github.com): never revealed for another.")
    ],
    from_env: Annotated[
        str | None,
        typer.Option("--from-env", help="Read the value from this environment variable instead of a prompt."),
    ] = None,
    url: UrlOpt = None,
) -> None:
    """Store a token (or `username:token`), encrypted with OFFLOAD_VAULT_MASTER_KEY. Never passed as an
    argument: it would show in the process list and the shell history."""
    from offload.autoscale.credentials import Credentials

    value = env_str(from_env, "") if from_env else typer.prompt("value", hide_input=True)
    if not value:
        fail(f"{from_env} is empty or not set" if from_env else "empty value")
    run_redis(url, lambda r: Credentials(r).set(name, value, host))
    typer.echo(f"credential {name} stored (for {host.strip().lower()} only)")


@credentials_app.command("list")
def credentials_list(url: UrlOpt = None, json_out: JsonOpt = False) -> None:
    """Names, values masked, and the git host each is bound to."""
    from offload.autoscale.credentials import Credentials

    found = run_redis(url, lambda r: Credentials(r).list())
    if json_out:
        print_json(found)
        return
    for name, row in found.items():
        typer.echo(f"{name:<24} {row['value']:<12} {row['host'] or '(no host: set it again with --host)'}")


@credentials_app.command("delete")
def credentials_delete(
    name: Annotated[str, typer.Argument()], yes: YesOpt = False, dry_run: DryRunOpt = False, url: UrlOpt = None
) -> None:
    """Forget a credential, after asking (rentals that need it then fail, naming it)."""
    from offload.autoscale.credentials import Credentials

    if name not in run_redis(url, lambda r: Credentials(r).list()):
        fail(f"no credential named {name!r}")
    if not confirmed("delete", f"credential {name}", yes=yes, dry_run=dry_run):
        return
    if not run_redis(url, lambda r: Credentials(r).delete(name)):
        fail(f"no credential named {name!r}")
    typer.echo(f"credential {name} deleted")


# `offload providers add|list|remove|...`: the same commands at the top level, with familiar aliases.
top_providers_app = typer.Typer(no_args_is_help=True, help="Machine providers (same as `offload autoscale providers`).")
for _name, _fn in (
    ("create", providers_create),
    ("add", providers_create),
    ("update", providers_update),
    ("list", providers_list),
    ("show", providers_show),
    ("adopt", providers_adopt),
    ("delete", providers_delete),
    ("remove", providers_delete),
):
    top_providers_app.command(_name)(_fn)


def register(app: typer.Typer) -> None:
    app.add_typer(autoscale_app, name="autoscale")
    app.add_typer(top_providers_app, name="providers")
