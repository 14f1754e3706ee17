"""Deployment from git: the queue's `deployment` block puts the user's code on the machine. End to end with the
`local` provider (a real server, its own autoscaler, a real `offload worker` started by the deployment script in
a per-instance work dir): a repository made here, served from a branch other than the default, whose jobs must
succeed with that branch's code. Plus the script itself (no credential in it or in argv) and how RunPod and
Vast.ai receive it (their start command, checked at the simulator)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from support.admin_redis import AdminRedis, redis_admin
from support.autoscale_helpers import VAULT_KEY, Clock, make_scaler, queue_block, sim_call, worker_token
from support.eventually import eventually
from support.server_helpers import server
from support.servers import ValkeyServer, free_port

from bench import web
from offload.access.api_keys import KeyStore
from offload.autoscale.credentials import Credentials
from offload.autoscale.deploy import Deployment, script
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers.local import LocalConfig, LocalProvider
from offload.autoscale.providers.runpod import RunPodConfig, RunPodProvider
from offload.autoscale.providers.vastai import VastConfig, VastProvider
from offload.autoscale.settings import validate_autoscale
from offload.autoscale.vault import Vault
from offload.config import load_settings
from offload.connection import connect
from offload.errors import ConfigError
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim.config import SimConfig
from offload.testing.sim.server import running_sim

HANDLER = """import os, pathlib

def run(input):
    return {{"branch": "{branch}", "n": input["n"], "setup_ran": pathlib.Path(".setup-ran").exists(),
             "cwd": os.getcwd()}}
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), *args],
        check=True,
        capture_output=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com",
        },
    )


def make_repo(root: Path) -> Path:
    """A repository whose default branch `main` and branch `gpu-v2` answer differently (code under app/)."""
    repo = root / "models"
    (repo / "app").mkdir(parents=True)
    git(repo, "init", "--quiet", "--initial-branch", "main")
    (repo / "app" / "handlers.py").write_text(HANDLER.format(branch="main"))
    git(repo, "add", ".")
    git(repo, "commit", "--quiet", "-m", "main")
    git(repo, "checkout", "--quiet", "-b", "gpu-v2")
    (repo / "app" / "handlers.py").write_text(HANDLER.format(branch="gpu-v2"))
    git(repo, "commit", "--quiet", "-am", "v2")
    git(repo, "checkout", "--quiet", "main")
    return repo


@pytest.fixture
async def r(valkey: ValkeyServer) -> AsyncIterator[AdminRedis]:
    client = redis_admin(await connect(valkey.url))
    await redis_admin(client).flushdb()
    yield client
    await redis_admin(client).flushdb()
    await client.aclose()


@pytest.mark.xdist_group("autoscale-e2e")
async def test_local_provider_deploys_a_branch_from_git_and_its_jobs_succeed(
    r: AdminRedis, valkey: ValkeyServer, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path)
    queue = "deploy-" + secrets.token_hex(3)
    _, worker_token = await KeyStore(r).create("worker", [queue], "deployed workers")
    deploy_dir = tmp_path / "instances"
    await ProviderStore(r).create(
        "here",
        "local",
        {  # the operator's CLI path (no vault: local has no secret)
            "python": sys.executable,
            "deploy_dir": str(deploy_dir),
            "log_dir": str(tmp_path / "logs"),
            "stop_timeout": 5,
        },
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = tmp_path / "offload.yaml"  # the guide's layout: deployment next to autoscale
    cfg.write_text(
        orjson.dumps(
            {
                "storage": {"kind": "local", "path": str(tmp_path / "results")},
                "autoscaler": {
                    "public_url": url,
                    "worker_key": worker_token,
                    "tick": 0.2,
                    "drain_settle": 1,
                    "recent_task": 1,
                },
                "queues": {
                    queue: {
                        "deployment": {
                            "git_url": f"file://{repo}",
                            "branch": "gpu-v2",
                            "code_path": "app",
                            "setup_cmd": "touch .setup-ran",
                            "handler": "handlers:run",
                        },
                        "autoscale": {
                            "enabled": True,
                            "provider": "here",
                            "max_workers": 1,
                            "poll_interval": "1s",
                            "boot_timeout": "60s",
                            "scale_down": [{"trigger": "idle", "timeout": "2s"}],
                        },
                    }
                },
            }
        ).decode()
    )
    settings = load_settings(cfg, env={})
    admin = "admin-" + secrets.token_hex(16)
    try:
        with server(valkey.url, settings=settings, port=port, admin_key=admin, worker_lease_ms=3000, max_wait_s=1):
            store = QueueStore(r)
            ids = await store.enqueue_many(queue, [JobSpec(input={"n": i}) for i in range(3)])

            async def done() -> bool:
                return (await store.stats(queue)).counts["succeeded"] == len(ids)

            try:
                await eventually(done, 90, "the deployed worker to finish the jobs")
            except AssertionError:
                for log in (tmp_path / "logs").glob("*.log"):
                    print(log.read_text()[-3000:])
                raise
            outputs = [orjson.loads((tmp_path / "results" / (await store.get(i)).output_key).read_bytes()) for i in ids]
            assert [o["branch"] for o in outputs] == ["gpu-v2"] * 3  # that branch's code, not main's
            assert sorted(o["n"] for o in outputs) == [0, 1, 2] and all(o["setup_ran"] for o in outputs)
            workdir = Path(outputs[0]["cwd"])
            assert workdir.parent.parent.parent == deploy_dir and workdir.name == "app"  # <dir>/<label>/repo/app

            async def torn_down() -> bool:
                async with web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as api:
                    rows = (await api.get("/v1/autoscale/status")).json()["instances"]
                return bool(rows) and all(row["status"] == "terminated" for row in rows)

            await eventually(torn_down, 30, "the idle instance to be drained and destroyed")
            assert not await asyncio.to_thread(workdir.exists)  # the per-instance work dir goes with the machine
    finally:
        leftover = LocalProvider("here", LocalConfig(stop_timeout=1), r)
        for machine in await leftover.list():
            await leftover.destroy(machine.provider_id)


def test_the_deployment_block_is_validated_and_set_in_one_place(tmp_path: Path) -> None:
    base = {"enabled": True, "provider": "p", "max_workers": 1}
    for deployment, message in [
        ({"git_url": "https://x/y.git"}, "deployment: set exactly one of handler or startup_cmd"),
        ({"git_url": "https://u:tok@x/y.git", "handler": "a:b"}, "deployment.git_url: git_url must not carry"),
        ({"git_url": "ftp://x/y", "handler": "a:b"}, "deployment.git_url: git_url must be a"),
        ({"git_url": "https://x/y.git", "branch": "--upload-pack=evil", "handler": "a:b"}, "deployment.branch"),
        ({"git_url": "https://x/y.git", "code_path": "../etc", "handler": "a:b"}, "deployment.code_path"),
        ({"git_url": "https://x/y.git", "handler": "rm -rf /"}, "deployment.handler"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate_autoscale({**base, "deployment": deployment}, "q")
        assert str(err.value).startswith(f"q.{message}"), str(err.value)
    with pytest.raises(ConfigError, match=r"instance\.handler: set the handler in deployment\.handler only"):
        validate_autoscale(
            {**base, "instance": {"handler": "a:b"}, "deployment": {"git_url": "https://x/y.git", "handler": "a:b"}},
            "q",
        )
    cfg = tmp_path / "offload.yaml"
    cfg.write_text(
        "queues:\n  gpu:\n    deployment: {git_url: 'https://x/y.git', handler: 'a:b'}\n"
        "    autoscale: {enabled: true, provider: p, max_workers: 1,\n"
        "                deployment: {git_url: 'https://x/z.git', handler: 'a:b'}}\n"
    )
    with pytest.raises(ConfigError, match=r"^queues\.gpu\.deployment: also set in queues\.gpu\.autoscale"):
        load_settings(cfg, env={})


async def test_a_private_repository_token_comes_from_the_vault_never_in_the_script(
    fast_valkey_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token is revealed only into the machine's environment; git reads it through a credential helper given
    for the clone only, so it is in no argv, no script, no .git/config, no event and no instance record."""
    r = await connect(fast_valkey_url)
    token = "ghp_" + secrets.token_hex(16)
    await Credentials(r, Vault(VAULT_KEY)).set("gh", f"deploy-bot:{token}", "git.example.com")
    assert token not in str(await r.get("offload:{as}:cred:gh"))
    clock = Clock()
    block = queue_block(
        deployment={
            "git_url": "https://git.example.com/me/private.git",
            "branch": "main",
            "handler": "app:run",
            "git_credential": "gh",
        }
    )
    s, mock = make_scaler(r, clock, block)
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    await QueueStore(r).enqueue("gpu", JobSpec(input=1))
    await s.tick()
    (machine,) = await mock.list()
    (inst,) = await s.instances.live()
    text = script(Deployment.model_validate(block["deployment"]))
    assert token not in text and "OFFLOAD_GIT_TOKEN" in text
    events = " ".join(str(e) for _, e in await r.xrange("offload:{as}:events"))
    assert token not in events and token not in str(inst.to_dict())
    # the helper itself, run the way git runs it: it answers with the environment's credential
    helper = text.split("credential.helper=", 2)[2].split("'", 1)[0]
    out = await asyncio.to_thread(
        subprocess.run,
        ["sh", "-c", helper.removeprefix("!") + " get"],
        capture_output=True,
        text=True,
        env={"OFFLOAD_GIT_TOKEN": token, "OFFLOAD_GIT_USERNAME": "deploy-bot"},
        check=True,
    )
    assert out.stdout.splitlines() == ["username=deploy-bot", f"password={token}"]
    assert machine.provider_id
    await s.aclose()
    await r.aclose()


async def test_runpod_and_vast_receive_the_deployment_as_their_start_command(fast_valkey_url: str) -> None:
    r = await connect(fast_valkey_url)
    clock = Clock()
    deployment = {
        "git_url": "https://github.com/example/models.git",
        "branch": "main",
        "setup_cmd": "pip install -r requirements.txt",
        "startup_cmd": "python main.py",
    }
    with running_sim(SimConfig.model_validate({"api_key": "k", "machines": {"boot_seconds": 0}}), clock=clock) as url:
        for name in ("rp", "v"):
            block = queue_block(provider=name, deployment=deployment, max_workers=1)
            s, _ = make_scaler(
                r,
                clock,
                block,
                queue=f"q-{name}",
                server={"public_url": "https://cp.example.com", "worker_key": await worker_token(r, f"q-{name}")},
            )
            s.override = {
                "rp": RunPodProvider("rp", RunPodConfig(api_key="k", base_url=url, gpu_type_id="NVIDIA RTX A5000")),
                "v": VastProvider("v", VastConfig(api_key="k", base_url=url, gpu_name="RTX 4090")),
            }
            await QueueStore(r).enqueue(f"q-{name}", JobSpec(input=1))
            await s.tick()
            for p in s.override.values():
                await p.aclose()
            await s.aclose()
            clock.advance(120)
        machines = {m["provider"]: m for m in sim_call("GET", f"{url}/_sim/machines")["machines"]}
    assert set(machines) == {"runpod", "vastai"}
    for m in machines.values():
        cmd = m["start_cmd"]
        assert cmd[:2] == ["sh", "-c"]
        assert "--single-branch --branch main -- https://github.com/example/models.git" in cmd[2]
        assert "pip install -r requirements.txt" in cmd[2] and "exec sh -c 'python main.py'" in cmd[2]
    await r.aclose()


def test_cli_credentials_never_take_the_secret_as_an_argument(
    fast_valkey_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from offload.cli.app import app

    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", VAULT_KEY)
    monkeypatch.setenv("GH_TOKEN", "ghp_" + "x" * 36 + "WXYZ")
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "autoscale",
            "credentials",
            "set",
            "gh",
            "--host",
            "github.com",
            "--from-env",
            "GH_TOKEN",
            "--url",
            fast_valkey_url,
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        ["autoscale", "credentials", "set", "bad name", "--host", "github.com", "--url", fast_valkey_url],
        input="tok\n",
    )
    assert res.exit_code == 1 and "invalid credential name" in res.output
    res = runner.invoke(app, ["autoscale", "credentials", "list", "--url", fast_valkey_url])
    assert "gh" in res.output and "****WXYZ" in res.output and "ghp_" not in res.output
    res = runner.invoke(app, ["autoscale", "credentials", "delete", "gh", "--yes", "--url", fast_valkey_url])
    assert res.exit_code == 0
    res = runner.invoke(app, ["autoscale", "credentials", "delete", "gh", "--yes", "--url", fast_valkey_url])
    assert res.exit_code == 1 and "no credential named 'gh'" in res.output


async def test_the_api_refuses_commands_that_would_run_on_this_host(
    r: AdminRedis, valkey: ValkeyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue block that would run a deployment (or a handler) through a `local` provider is the operator's to
    set (offload.yaml): the HTTP API answers 403 naming why. Every validation problem is listed at its field."""
    monkeypatch.setenv("OFFLOAD_AUTOSCALER", "off")
    await ProviderStore(r).create("here", "local", {})
    await ProviderStore(r).create("try-it", "mock", {})
    admin = "admin-" + secrets.token_hex(16)
    deployment = {"git_url": "https://github.com/example/models.git", "handler": "app:run"}
    with server(valkey.url, {"kind": "local", "path": str(tmp_path)}, admin_key=admin) as (url, _):
        async with web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as api:
            base = {"enabled": True, "max_workers": 1, "deployment": deployment}
            res = await api.put("/v1/autoscale/queues/gpu", json={**base, "provider": "here"})
            assert res.status_code == 403
            assert "runs on the server's own host" in res.text and "offload.yaml" in res.text
            res = await api.put(
                "/v1/autoscale/queues/gpu",
                json={"enabled": True, "provider": "here", "max_workers": 1, "instance": {"handler": "os:system"}},
            )
            assert res.status_code == 403 and "instance.handler" in res.text
            assert (await api.put("/v1/autoscale/queues/gpu", json={**base, "provider": "try-it"})).status_code == 200
            res = await api.put(
                "/v1/autoscale/queues/gpu",
                json={
                    "enabled": True,
                    "provider": "try-it",
                    "max_workers": 0,
                    "poll_interval": "soon",
                    "scale_up": [{"trigger": "queue_depth"}],
                },
            )
            assert res.status_code == 422
            paths = {d["path"] for d in res.json()["detail"]}
            assert paths >= {
                "queues.gpu.autoscale.max_workers",
                "queues.gpu.autoscale.poll_interval",
                "queues.gpu.autoscale.scale_up.0.threshold",
            }, paths
            got = (await api.get("/v1/autoscale/queues/gpu")).json()
            assert got["autoscale"]["provider"] == "try-it"  # the refused and invalid blocks were not stored
