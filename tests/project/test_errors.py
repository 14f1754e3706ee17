"""One exception tree: every exception class offload defines derives from OffloadError, and the tree drawn in
offload/errors.py names every one of them, so the drawing cannot drift from the code."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import offload
from offload import errors
from offload.errors import (
    BackendError,
    ConfigError,
    FencingError,
    ObjectStoreError,
    OffloadError,
    ProviderError,
    RequestError,
    StaleLease,
    StoreError,
    WorkerError,
)

# Exception classes that may stand outside the tree, with the reason. Empty: keep it so.
ALLOWED: dict[str, str] = {}


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined (not merely imported) in a module of the offload package."""
    found: dict[str, type[BaseException]] = {}
    root = Path(offload.__file__).parent
    for file in sorted(root.rglob("*.py")):  # not pkgutil: offload.worker and offload.autoscale are namespace packages
        parts = file.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # importing it would start the CLI
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_the_walk_sees_the_whole_package() -> None:
    """The walk must reach the leaves that live beside their code, or the next test proves nothing."""
    found = exception_classes()
    for where in (
        "offload.backends.base.Throttled",
        "offload.autoscale.instances.Fenced",
        "offload.worker.polling.PollTimeout",
        "offload.gpu_worker.loop.PermanentError",
        "offload.testing.sim.engine.ErrorReply",
        "offload.storage.base.StorageError",
        "offload.server.errors.BodyTooLarge",
    ):
        assert where in found
    assert len(found) >= 40


def test_every_exception_class_derives_from_offload_error() -> None:
    found = exception_classes()
    outside = sorted(
        where for where, cls in found.items() if not issubclass(cls, OffloadError) and where not in ALLOWED
    )
    assert outside == []


def test_the_drawn_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    drawn = set(re.findall(r"\b([A-Z][A-Za-z]+)\b", doc))
    missing = sorted(
        cls.__name__ for cls in exception_classes().values() if cls.__name__ not in drawn and cls.__name__[0] != "_"
    )
    assert missing == []


@pytest.mark.parametrize(
    ("leaf", "branch"),
    [
        ("offload.errors.ConnectionFailed", StoreError),
        ("offload.errors.JobNotFound", StoreError),
        ("offload.errors.JobNotFound", KeyError),
        ("offload.errors.InvalidQueueName", ValueError),
        ("offload.storage.base.StorageConfigError", ConfigError),
        ("offload.autoscale.vault.VaultError", ConfigError),
        ("offload.autoscale.instances.Fenced", FencingError),
        ("offload.autoscale.instances.StaleState", FencingError),
        ("offload.errors.StaleLease", FencingError),
        ("offload.backends.base.Transient", BackendError),
        ("offload.autoscale.providers.base.OutOfCapacity", ProviderError),
        ("offload.storage.base.ObjectNotFound", ObjectStoreError),
        ("offload.storage.base.ObjectNotFound", KeyError),
        ("offload.storage.base.StorageError", ObjectStoreError),
        ("offload.gpu_worker.server_api.ServerUnavailable", ConnectionError),
        ("offload.gpu_worker.server_api.ServerRejected", WorkerError),
        ("offload.worker.polling.PollTimeout", WorkerError),
        ("offload.server.errors.BodyTooLarge", RequestError),
    ],
)
def test_each_leaf_hangs_on_its_branch(leaf: str, branch: type[BaseException]) -> None:
    assert issubclass(exception_classes()[leaf], branch)


def test_branch_roots_stay_importable_where_they_lived() -> None:
    from offload.autoscale.providers.base import ProviderError as provider_root
    from offload.backends.base import BackendError as backend_root

    assert (backend_root, provider_root) == (BackendError, ProviderError)


def test_one_stale_lease_and_two_distinct_rejections() -> None:
    """`Stale` (the server's 409 to a GPU worker) was a second StaleLease; the two `Rejected` were unrelated."""
    found = exception_classes()
    names = [where.rsplit(".", 1)[1] for where in found]
    assert "Stale" not in names and "Rejected" not in names
    assert names.count("StaleLease") == 1
    assert found["offload.errors.StaleLease"] is StaleLease


@pytest.mark.parametrize(
    ("yaml_text", "env", "message"),
    [
        ("queues: {gpu: {concurrency: lots}}", {}, "queues.gpu.concurrency: Input should be a valid integer"),
        ("storage: {kind: s3, bucket: b, max_threads: 0}", {}, "storage.max_threads: Input should be greater than"),
        ("storage: {kind: s3}", {}, "storage.bucket: Field required"),
        ("backends: {b: {kind: runpod, endpiont_id: x}}", {}, "backends.b.endpiont_id: unknown setting"),
        ("backends: {b: {kind: fal, app: a, timeout: -1}}", {}, "backends.b.timeout: Input should be greater than 0"),
        ("", {"GPU_API_BASE": "https://gpu", "POLL_INTERVAL": "soon"}, "queues.gpu-jobs.poll_interval: Input should"),
        ("", {"GPU_API_BASE": "gpu.example.com"}, "backends.gpu.base_url: must be an http:// or https:// URL"),
    ],
)
@pytest.mark.parametrize("command", [["worker"], ["config", "check"]])
def test_a_bad_setting_ends_the_real_cli_in_one_line_naming_it(
    tmp_path: Path, yaml_text: str, env: dict[str, str], message: str, command: list[str]
) -> None:
    """Through `python -m offload`, as an operator meets it: exit 1, one `error:` line naming the field, no
    traceback, for a bad offload.yaml value and a bad tutorial env value (tests/clients/test_cli.py holds the OFFLOAD_*
    numbers such as OFFLOAD_MAX_PAYLOAD to the same)."""
    import os
    import subprocess
    import sys

    config = tmp_path / "offload.yaml"
    config.write_text(yaml_text)
    proc = subprocess.run(
        [sys.executable, "-m", "offload", *command, "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "OFFLOAD_HOME": str(tmp_path / ".offload"), "OFFLOAD_CONFIG": "", **env},
        cwd=tmp_path,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr.startswith(f"error: {message}") and proc.stderr.count("\n") == 1, proc.stderr
