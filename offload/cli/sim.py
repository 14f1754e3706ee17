"""`offload sim serve` (and `python -m offload.testing.sim serve`): run the simulator from a shell.

`sim_app` is a Typer group of its own, mounted by the main CLI as `offload sim` and run alone by
`python -m offload.testing.sim`: this module imports only the simulator and the CLI's error handling, never the other
command groups (`offload.cli` builds nothing at import time), so the simulator starts without the queue, server
or autoscaler code. Shortcut flags override the config file's `default` behaviour, which is what a rehearsal
usually wants ("everything 2 s, 10 % failures"); per-family settings need the file. Problems end in one
`error: ...` line and exit code 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError

from offload.cli.errors import describe, fail
from offload.testing.sim.config import SimConfig, parse_latency

sim_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Simulated GPU/model APIs (tutorial jobs, RunPod, Replicate, fal, OpenAI) for tests and rehearsals.",
)

Rate = Annotated[float | None, typer.Option(min=0.0, max=1.0, show_default=False)]


@sim_app.callback()
def _group() -> None:
    """Keep `sim` a command group even with one command, so `offload sim serve` is stable."""


def build_config(
    config_file: Path | None,
    *,
    seed: int | None = None,
    api_key: str | None = None,
    fal_prefix: str | None = None,
    public_url: str | None = None,
    honour_idempotency_key: bool | None = None,
    **behaviour: Any,
) -> SimConfig:
    """The file (or defaults) with the flags on top; raises ValueError / ValidationError with the field."""
    config = SimConfig.load(config_file) if config_file else SimConfig()
    top = {
        k: v
        for k, v in {
            "seed": seed,
            "api_key": api_key,
            "fal_prefix": fal_prefix,
            "public_url": public_url,
            "honour_idempotency_key": honour_idempotency_key,
        }.items()
        if v is not None
    }
    if top:
        config = SimConfig.model_validate({**config.model_dump(exclude_unset=True), **top})
    for key in ("latency", "queue_delay", "submit_latency"):
        if isinstance(behaviour.get(key), str):
            behaviour[key] = parse_latency(behaviour[key])
    return config.with_default(**{k: v for k, v in behaviour.items() if v is not None})


AlsoPort = Annotated[
    list[int] | None,
    typer.Option(
        min=1,
        max=65535,
        show_default=False,
        help="Also listen here (repeatable); the submission log records each submit's port.",
    ),
]
ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", exists=True, dir_okay=False, show_default=False, help="YAML or JSON SimConfig file."),
]
Latency = Annotated[
    str | None, typer.Option(show_default=False, help="Job running time: 2, 1-3 or lognormal:2:0.5[:cap].")
]
QueueDelay = Annotated[str | None, typer.Option(show_default=False, help="Time in queue, same forms.")]
SubmitLatency = Annotated[
    str | None,
    typer.Option(show_default=False, help="How long a submit takes to answer once its job exists, same forms."),
]
ErrorRate = Annotated[
    float | None, typer.Option(min=0.0, max=1.0, show_default=False, help="Share of requests answered with a 5xx.")
]
Rate429 = Annotated[
    float | None,
    typer.Option("--rate-429", min=0.0, max=1.0, show_default=False, help="Share of requests answered 429."),
]
RetryAfter = Annotated[
    bool | None,
    typer.Option("--retry-after/--no-retry-after", show_default=False, help="Send Retry-After on 429s."),
]
ResultTtl = Annotated[
    float | None, typer.Option(min=0.0, show_default=False, help="Seconds after a job ends until it 404s.")
]
Seed = Annotated[int | None, typer.Option(show_default=False, help="Random seed (reproducible runs).")]
HonourKey = Annotated[
    bool | None,
    typer.Option(
        "--honour-idempotency-key/--ignore-idempotency-key",
        show_default=False,
        help="Answer a repeated Idempotency-Key with the first submission (default) or treat it as new.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(envvar="OFFLOAD_SIM_API_KEY", show_default=False, help="Accept only this key (default: any)."),
]
FalPrefix = Annotated[str | None, typer.Option(show_default=False, help="Mount fal under this path.")]
PublicUrl = Annotated[str | None, typer.Option(show_default=False, help="Base of URLs in responses (behind a proxy).")]


@sim_app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free port).")] = 8089,
    also_port: AlsoPort = None,
    config: ConfigFile = None,
    latency: Latency = None,
    queue_delay: QueueDelay = None,
    submit_latency: SubmitLatency = None,
    fail_rate: Rate = None,
    error_rate: ErrorRate = None,
    rate_429: Rate429 = None,
    retry_after: RetryAfter = None,
    malformed_rate: Rate = None,
    lost_response_rate: Rate = None,
    result_ttl: ResultTtl = None,
    seed: Seed = None,
    honour_idempotency_key: HonourKey = None,
    api_key: ApiKey = None,
    fal_prefix: FalPrefix = None,
    public_url: PublicUrl = None,
    ssl_certfile: Annotated[str | None, typer.Option(show_default=False, help="Serve https (fal SDK).")] = None,
    ssl_keyfile: Annotated[str | None, typer.Option(show_default=False)] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request (slow at high rates).")] = False,
) -> None:
    """Serve every simulated API on one port until interrupted."""
    sim_config = _config_or_fail(
        config,
        seed=seed,
        api_key=api_key,
        fal_prefix=fal_prefix,
        public_url=public_url,
        honour_idempotency_key=honour_idempotency_key,
        latency=latency,
        queue_delay=queue_delay,
        submit_latency=submit_latency,
        fail_rate=fail_rate,
        error_rate=error_rate,
        rate_429=rate_429,
        retry_after_header=retry_after,
        malformed_rate=malformed_rate,
        lost_response_rate=lost_response_rate,
        result_ttl=result_ttl,
    )
    _run(
        sim_config,
        host,
        [port, *(also_port or ())],
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        log_level=log_level,
        access_log=access_log,
    )


def _run(
    sim_config: SimConfig,
    host: str,
    ports: list[int],
    *,
    ssl_certfile: str | None,
    ssl_keyfile: str | None,
    log_level: str,
    access_log: bool,
) -> None:
    """Serve on the first port and the others beside it, once the simulator's server code imports."""
    try:
        from offload.testing.sim.server import serve as run_server
    except ModuleNotFoundError as exc:  # the `server` extra is not installed
        fail(describe(exc))
    port, *also = ports
    scheme = "https" if ssl_certfile else "http"
    extra = "".join(f", :{p}" for p in also)
    typer.echo(
        f"offload sim: serving on {scheme}://{host}:{port}{extra} (control: /_sim/stats, /_sim/config, "
        "/_sim/submissions)",
        err=True,
    )
    run_server(
        host,
        port,
        sim_config,
        log_level=log_level,
        access_log=access_log,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        also_ports=also,
    )


def _config_or_fail(config_file: Path | None, **flags: Any) -> SimConfig:
    """`build_config`, or one `error: invalid simulator config: ...` line naming the field."""
    try:
        return build_config(config_file, **flags)
    except (OSError, ValueError, yaml.YAMLError) as exc:  # pydantic's ValidationError is a ValueError
        detail = (
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            if isinstance(exc, ValidationError)
            else str(exc)
        )
        fail(f"invalid simulator config: {detail}")


def register(app: typer.Typer) -> None:
    app.add_typer(sim_app, name="sim")
