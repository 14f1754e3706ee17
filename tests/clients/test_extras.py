"""Optional dependencies as extras: `pip install offload` enqueues, and a missing extra is one line naming it.

The processes here run with an import hook that makes the extras' modules (FastAPI, Starlette, uvicorn, boto3,
aiohttp, prometheus_client, rclone) unimportable, as in a venv that installed only the core, and talk to a real
Valkey.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions, requires, version
from pathlib import Path

import pytest

import offload
from offload.errors import MissingExtra

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HEAVY = ("fastapi", "starlette", "uvicorn", "boto3", "aiohttp", "prometheus_client")
BLOCKED = (*HEAVY, "botocore", "s3transfer")
HOOK = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {BLOCKED!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Block())
""")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def without_extras(
    code: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where the extras' modules cannot be imported."""
    return subprocess.run(
        [sys.executable, "-c", HOOK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "OFFLOAD_CONFIG": "", **(env or {})},
        cwd=cwd,
        timeout=120,
    )


def cli_without_extras(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return without_extras(
        f"import sys; sys.argv = ['offload', *{list(args)!r}]\nfrom offload.cli import main\nmain()", env, cwd
    )


def test_the_core_dependencies_leave_the_heavy_ones_to_extras() -> None:
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    extras = {name: {_name(r) for r in reqs} for name, reqs in PYPROJECT["optional-dependencies"].items()}
    assert not core & {_name(m) for m in HEAVY}
    assert {"worker", "s3", "server", "all", "dev"} <= set(extras)
    assert "aiohttp" in extras["worker"] and "boto3" in extras["s3"]
    assert {"fastapi", "uvicorn", "starlette", "prometheus-client"} <= extras["server"]
    assert any(r.startswith("offload[") and "all" in r for r in PYPROJECT["optional-dependencies"]["dev"])


def test_every_module_the_error_names_comes_with_its_extra() -> None:
    """MissingExtra.EXTRA_OF must tell the truth: the extra it names installs the module (directly or through a
    package that requires it, as boto3 brings botocore)."""
    reqs = PYPROJECT["optional-dependencies"]
    for module, extra in MissingExtra.EXTRA_OF.items():
        listed = {_name(r) for r in reqs[extra]}
        brought = listed | {_name(r) for dist in listed for r in (requires(dist) or []) if "extra ==" not in r}
        dists = {d.lower().replace("_", "-") for d in packages_distributions().get(module, [])}
        assert dists & brought, (module, extra, dists)


def test_the_version_comes_from_pyproject() -> None:
    assert offload.__version__ == PYPROJECT["version"] == version("offload")
    assert "__version__ =" not in (ROOT / "offload" / "__init__.py").read_text().replace(
        "__version__ = version(", ""
    ).replace('__version__ = "0+unknown"', "")


def test_a_producer_enqueues_with_the_core_alone(valkey_url: str) -> None:
    proc = without_extras(
        f"""
        import asyncio, json, sys
        import offload
        from offload import AsyncClient, Client

        with Client({valkey_url!r}) as client:
            one = client.enqueue("extras", {{"prompt": "sync"}}, idempotency_key="x-1")
            again = client.enqueue("extras", {{"prompt": "sync"}}, idempotency_key="x-1")
            state = client.get(one).state.value

        async def main():
            async with AsyncClient({valkey_url!r}) as client:
                ids = await client.enqueue_many("extras", [{{"n": 1}}, {{"n": 2}}])
                stats = await client.stats("extras")
                return ids, stats.counts["queued"]

        ids, queued = asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
        print(json.dumps({{"one": one, "again": again, "state": state, "ids": ids, "queued": queued,
                           "loaded": loaded}}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["one"] == out["again"] and out["state"] == "queued"
    assert len(out["ids"]) == 2 and out["queued"] == 3
    assert out["loaded"] == []


def test_the_cli_job_commands_and_config_check_need_no_extra(valkey_url: str, tmp_path: Path) -> None:
    """The tutorial's env file names an S3 bucket and an HTTP job API: reading and checking that configuration
    needs neither boto3 nor aiohttp, only building the store or the backend does."""
    env = {
        "OFFLOAD_REDIS_URL": valkey_url,
        "QUEUE_KEY": "gpu:jobs",
        "GPU_API_BASE": "https://gpu.example.com/v1",
        "RESULT_BUCKET": "results",
        "S3_ENDPOINT": "https://s3.example.com",
        "AWS_ACCESS_KEY_ID": "ak",
        "AWS_SECRET_ACCESS_KEY": "sk-never-printed",
        "OFFLOAD_HOME": str(tmp_path / ".offload"),
    }
    enqueued = cli_without_extras("enqueue", "--queue", "gpu-jobs", "--input", '{"p": 1}', env=env, cwd=tmp_path)
    assert enqueued.returncode == 0, enqueued.stderr
    job_id = enqueued.stdout.strip()
    status = cli_without_extras("status", job_id, "--json", env=env, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "queued"
    checked = cli_without_extras("config", "check", "--json", env=env, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "sk-never-printed" not in checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["worker", "--queue", "gpu-jobs"], "worker"),
        (["server", "--port", "0"], "server"),
        (["sim", "serve", "--port", "0"], "server"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(valkey_url: str, tmp_path: Path, args: list[str], extra: str) -> None:
    env = {
        "OFFLOAD_REDIS_URL": valkey_url,
        "QUEUE_KEY": "gpu:jobs",
        "GPU_API_BASE": "https://gpu.example.com/v1",
        "OFFLOAD_HOME": str(tmp_path / ".offload"),
    }
    proc = cli_without_extras(*args, env=env, cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and f"pip install 'offload[{extra}]'" in proc.stderr


def test_the_simulator_module_names_its_extra_too() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HOOK + "import runpy, sys\nsys.argv = ['x', 'serve', '--port', '0']\n"
         "runpy.run_module('offload.testing.sim', run_name='__main__')"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("pip install 'offload[server]'")


def test_building_s3_storage_or_a_backend_without_its_extra_names_the_extra() -> None:
    proc = without_extras(
        """
        from offload.backends import create_backend
        from offload.errors import MissingExtra
        from offload.storage import create_storage

        for build in (
            lambda: create_storage({"kind": "s3", "bucket": "b"}),
            lambda: create_backend("gpu", {"kind": "http-job", "base_url": "http://gpu"}),
        ):
            try:
                build()
            except MissingExtra as exc:
                print(exc.extra)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["s3", "worker"]
