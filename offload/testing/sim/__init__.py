"""offload's provider simulator: a real HTTP server speaking the tutorial job API, RunPod serverless, Replicate,
fal's queue, OpenAI chat completions and the batch APIs of OpenAI and Anthropic, with configurable latency,
failures, 429s, garbage, outages and expiry.

It stands alone (nothing from the rest of offload is imported), so a user can rehearse a pipeline before paying
a provider, and tests can prove what a client did through `GET /_sim/stats`.

    from offload.testing.sim import SimConfig, running_sim
    with running_sim(SimConfig(seed=1)) as base_url:
        ...  # point a client at base_url

From a shell: `offload sim serve --port 8089 --latency 1-3 --fail-rate 0.1 --rate-429 0.05` (or
`python -m offload.testing.sim serve ...`, `--config sim.yaml` for per-family settings). Point the SDKs at it with
`RUNPOD_ENDPOINT_BASE_URL=http://HOST:PORT/v2`, `replicate.Client(base_url="http://HOST:PORT")`,
`openai.OpenAI(base_url="http://HOST:PORT/v1")`, `anthropic.Anthropic(base_url="http://HOST:PORT")`, and for fal
(https only) serve with `--ssl-certfile/--ssl-keyfile` and set `FAL_QUEUE_RUN_HOST=HOST:PORT`. The tutorial's
`GPU_API_BASE` is `http://HOST:PORT`.

The HTTP parts (starlette, uvicorn: the `server` extra) load on first use of `create_app`, `running_sim` and the
rest, so `offload.testing.sim.config` (and the CLI that parses its options) imports without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload.testing.sim.config import Behaviour, Latency, OutageWindow, SimConfig

if TYPE_CHECKING:
    from offload.testing.sim.app import SimApp, create_app
    from offload.testing.sim.server import RunningSim, running_sim, serve

_LAZY = {
    "SimApp": "offload.testing.sim.app",
    "create_app": "offload.testing.sim.app",
    "RunningSim": "offload.testing.sim.server",
    "running_sim": "offload.testing.sim.server",
    "serve": "offload.testing.sim.server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        from offload.errors import MissingExtra

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:
            raise (MissingExtra.of(exc, "the simulator") or exc) from None
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Behaviour",
    "Latency",
    "OutageWindow",
    "RunningSim",
    "SimApp",
    "SimConfig",
    "create_app",
    "running_sim",
    "serve",
]
