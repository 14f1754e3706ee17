"""Every read command of `offload` takes --json and prints one JSON document: found by walking the command tree,
run against a real Valkey with real data in it.

A *read command* reports state and changes nothing. Precisely: a command whose own name is one of READ_NAMES
(`status`, `list`, `show`, `events`, `check` in any group; the top-level `queues`, `jobs`, `result`, `wait`).
Every other command must be classified in NOT_READ, so a new command fails here until someone decides which it
is, and a new read command fails until it takes --json and has arguments in ARGS to run with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import typer
from typer.testing import CliRunner

from offload.cli.app import app
from offload.connection import connect
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.storage import LocalStorageSettings, create_storage

READ_NAMES = {"status", "list", "show", "events", "check", "queues", "jobs", "result", "wait", "history"}
NOT_READ = {  # command -> why it is not a read command
    **{
        c: "changes jobs or queues"
        for c in (
            "enqueue",
            "pause",
            "resume",
            "cancel",
            "purge",
            "ingest",
            "dead requeue",
            "dead purge",
            "held release",
        )
    },
    **{c: "runs until stopped" for c in ("worker", "server", "autoscale run", "sim serve", "demo")},
    **{c: "starts or stops processes" for c in ("up", "down", "embedded start", "embedded stop")},
    **{c: "changes keys" for c in ("keys create", "keys revoke")},
    **{c: "changes instances" for c in ("autoscale protect", "autoscale unprotect")},
    **{
        f"{g}{c}": "changes providers"
        for g in ("autoscale providers ", "providers ")
        for c in ("create", "update", "delete", "adopt")
    },
    **{c: "an alias of a write" for c in ("providers add", "providers remove")},
    **{c: "changes credentials" for c in ("autoscale credentials set", "autoscale credentials delete")},
}
# Arguments to run each read command with; JOB / DONE / CONFIG / PROVIDER are filled in by the test, and
# --url is added to every command that takes it. `check(doc, world)` says the document carries the data set up.
ARGS: dict[str, tuple[list[str], Callable[[Any, dict[str, str]], bool]]] = {
    "status": (["JOB"], lambda d, w: (d["id"], d["state"]) == (w["JOB"], "queued")),
    "jobs": (["gpu", "--state", "queued"], lambda d, w: len(d["jobs"]) == 1),
    "queues": ([], lambda d, w: [q["queue"] for q in d] == ["gpu"]),
    "result": (
        ["DONE", "--config", "CONFIG"],
        lambda d, w: d["job"] == w["DONE"] and d["presigned_url"].startswith("file://"),
    ),
    "wait": (["DONE", "--config", "CONFIG"], lambda d, w: (d["job"], d["output"]) == (w["DONE"], {"ok": True})),
    "dead list": (["gpu"], lambda d, w: d["jobs"][0]["error"] == "bad input"),
    "held list": (["gpu"], lambda d, w: d["jobs"][0]["state"] == "held"),
    "keys list": ([], lambda d, w: d[0]["scope"] == "viewer" and "token" not in d[0]),
    "autoscale status": ([], lambda d, w: "instances" in d and "leader" in d),
    "autoscale events": ([], lambda d, w: isinstance(d, list)),
    "autoscale providers list": ([], lambda d, w: d[0]["name"] == w["PROVIDER"]),
    "autoscale providers show": (["PROVIDER"], lambda d, w: d["type"] == "mock"),
    "providers list": ([], lambda d, w: d[0]["name"] == w["PROVIDER"]),
    "providers show": (["PROVIDER"], lambda d, w: d["type"] == "mock"),
    "autoscale credentials list": ([], lambda d, w: d == {"git-ci": {"value": "****7890", "host": "github.com"}}),
    "embedded status": ([], lambda d, w: d["running"] is False),
    "history": (["gpu"], lambda d, w: len(d["points"]) == 60 and sum(p["enqueued"] for p in d["points"]) >= 3),
    "config check": (["--config", "CONFIG"], lambda d, w: d["ok"] is True and d["queues"]["gpu"]["backend"] == "sim"),
}


def commands(root: typer.Typer) -> Iterator[tuple[str, Any]]:
    """(path, click command) for every leaf of the tree (Typer vendors click, so this is duck-typed)."""

    def walk(cmd: Any, path: list[str]) -> Iterator[tuple[str, Any]]:
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    yield from walk(typer.main.get_command(root), [])


def options(cmd: Any) -> set[str]:
    return {opt for param in cmd.params for opt in getattr(param, "opts", [])}


def classify(root: typer.Typer) -> tuple[list[str], list[str], list[str]]:
    """(read commands, read commands without --json, commands neither read nor in NOT_READ)."""
    read, no_json, unknown = [], [], []
    for path, cmd in commands(root):
        if path.rsplit(" ", 1)[-1] in READ_NAMES:
            read.append(path)
            if "--json" not in options(cmd):
                no_json.append(path)
        elif path not in NOT_READ:
            unknown.append(path)
    return read, no_json, unknown


def test_every_command_is_classified_and_every_read_command_takes_json() -> None:
    read, no_json, unknown = classify(app)
    assert unknown == [], f"classify these commands in READ_NAMES or NOT_READ: {unknown}"
    assert no_json == [], f"read commands without --json: {no_json}"
    assert sorted(read) == sorted(ARGS), "every read command needs arguments in ARGS (and nothing stale there)"
    assert set(NOT_READ) <= {path for path, _ in commands(app)}, "NOT_READ names a command that is gone"


def test_the_walk_catches_a_new_read_command_without_json() -> None:
    extra = typer.Typer()
    widgets = typer.Typer()
    extra.add_typer(widgets, name="widgets")

    @widgets.command("list")
    def widgets_list() -> None:
        """A new read command someone forgot to give --json."""

    @widgets.command("polish")
    def widgets_polish() -> None:
        """A new command nobody classified."""

    _, no_json, unknown = classify(extra)
    assert (no_json, unknown) == (["widgets list"], ["widgets polish"])


@pytest.fixture
def world(valkey_url: str, tmp_path: Path, tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """One job in each of queued, dead, held and succeeded; a viewer key; a mock provider; a config file."""
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", "test-master-key-0123456789")
    config = tmp_path / "offload.yaml"
    config.write_text(
        f"redis_url: {valkey_url}\nstorage: {{kind: local, path: {tmp_path / 'results'}}}\n"
        "backends: {sim: {kind: http-job, base_url: 'http://127.0.0.1:9', api_key: k}}\n"
        "queues: {gpu: {backend: sim}}\n"
    )

    async def setup() -> dict[str, str]:
        from offload.access.api_keys import KeyStore
        from offload.autoscale.credentials import Credentials
        from offload.autoscale.provider_store import ProviderStore

        redis = await connect(valkey_url)
        try:
            store = QueueStore(redis)
            for n in range(3):
                await store.enqueue("gpu", JobSpec(input={"n": n}))
            (dead,) = await store.claim("gpu", "w1", 1)
            await store.fail(dead.id, dead.token, "bad input", retryable=False)
            (held,) = await store.claim("gpu", "w1", 1)
            await store.hold(held.id, held.token, "daily cap reached")
            (done,) = await store.claim("gpu", "w1", 1)
            results = create_storage(LocalStorageSettings(path=str(tmp_path / "results")))
            stored = await results.put_json(done.output_key, {"ok": True})  # `result` refuses a missing output
            await results.aclose()
            await store.complete(done.id, done.token, stored)
            job = await store.enqueue("gpu", JobSpec(input={"n": 3}))
            await KeyStore(redis).create("viewer", [], "dashboards")
            await ProviderStore(redis).create("try-it", "mock", {})
            await Credentials(redis).set("git-ci", "ghp_token_1234567890", "github.com")
        finally:
            await redis.aclose()
        return {"JOB": job, "DONE": done.id, "CONFIG": str(config), "PROVIDER": "try-it"}

    return asyncio.run(setup())


def test_every_read_command_prints_one_json_document(valkey_url: str, world: dict[str, str]) -> None:
    runner = CliRunner()
    found = dict(commands(app))
    for path, (args, check) in ARGS.items():
        argv = [*path.split(), *(world.get(a, a) for a in args), "--json"]
        if "--url" in options(found[path]):
            argv += ["--url", valkey_url]
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (argv, result.stdout, result.stderr, result.exception)
        assert result.stdout.count("\n") == 1, (argv, result.stdout)
        doc = orjson.loads(result.stdout)
        assert check(doc, world), (argv, doc)
