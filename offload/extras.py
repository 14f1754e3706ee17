"""`require`: fail early, in one line, when an optional dependency of `pip install offload[...]` is missing.

`pip install offload` is what a producer needs (enqueue, status, wait, the CLI's job commands), and a GPU worker
(`offload worker --handler`). The rest comes with extras: `worker` (the dispatch worker's HTTP stack), `s3` (S3
result storage), `server` (the HTTP API, dashboard, metrics, autoscaler and the provider simulator), `all` (all of
them and the local stack's S3 server); `dev` installs everything plus the test tools. Code that needs an extra
calls `require` before importing it; the CLI turns any other missing optional module into the same one-line hint
(`MissingExtra.of`, whose table says which extra installs which module).
"""

from __future__ import annotations

import importlib

from offload.errors import MissingExtra


def require(extra: str, module: str, feature: str) -> None:
    """Raise MissingExtra (one line: what to `pip install`) unless `module` can be imported."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own imports is not: not a missing extra
        raise MissingExtra(extra, module, feature) from None
