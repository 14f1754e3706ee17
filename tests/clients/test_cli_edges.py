"""The CLI's rough edges a new user hit: listing every state, unknown queues, confirmations, `config
check` listing every problem, `result` without storage, a failed `up`, `--version` and completion, the demo's
closing lines, exact big integers, tables off and on a terminal. Real Valkey, real processes where the point is
what a shell sees (a terminal, exit codes)."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from support.admin_redis import redis_admin
from support.procs import die_with_parent
from test_cli import as_json, cli, counts, failed, kill_jobs, ok, runner, with_store

from offload.cli.app import app
from offload.local.demo import command, hints, preview
from offload.local.embedded import running_url, stop_embedded
from offload.queue import keyspace
from offload.queue.store import QueueStore
from offload.storage import LocalStorageSettings, create_storage

OFFLOAD = str(Path(sys.executable).parent / "offload")


def on_terminal(args: list[str], answer: bytes = b"", columns: int = 200, timeout: float = 60) -> tuple[int, str]:
    """Run `offload ARGS` with stdin and stdout on a pseudo-terminal (a person at a shell), type `answer`; the
    exit code and everything shown."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    proc = subprocess.Popen(
        [OFFLOAD, *args], stdin=follower, stdout=follower, stderr=follower, env=env, preexec_fn=die_with_parent
    )
    os.close(follower)
    if answer:
        os.write(leader, answer)
    shown = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side closed: the process is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return proc.wait(timeout=timeout), shown.decode(errors="replace").replace("\r\n", "\n")


def purge_count(url: str, queue: str, state: str) -> int:
    return int(counts(url, queue)[state])


# -- 1. `offload jobs Q`: every state, newest first, paged; `--state submitted` ------------------------------


def test_jobs_without_state_lists_every_state_newest_first_in_pages(valkey_url: str) -> None:
    for i in range(6):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "99", "--delay", "600")
    kill_jobs(valkey_url, "gpu", 2)  # two dead, four queued, one delayed
    everything = as_json(valkey_url, "jobs", "gpu", "--limit", "1000")["jobs"]
    assert sorted(j["state"] for j in everything) == ["dead", "dead", "delayed", *["queued"] * 4]
    newest_first = sorted(everything, key=lambda j: (j["created_at"], j["id"]), reverse=True)
    assert [j["id"] for j in everything] == [j["id"] for j in newest_first]

    pages, cursor = [], 0
    while True:  # three at a time, following next_cursor, gives the same list once
        page = as_json(valkey_url, "jobs", "gpu", "--limit", "3", "--cursor", str(cursor))
        pages += [j["id"] for j in page["jobs"]]
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    assert pages == [j["id"] for j in everything]


def test_jobs_state_submitted_lists_jobs_sent_to_a_provider(valkey_url: str) -> None:
    for i in range(3):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))

    async def submit_one(store: QueueStore) -> str:
        claimed = await store.claim("gpu", "w1", 2)  # two active, one of them submitted
        await store.checkpoint(claimed[0].id, claimed[0].token, "sim", "remote-1")
        return claimed[0].id

    sent = with_store(valkey_url, submit_one)
    listed = as_json(valkey_url, "jobs", "gpu", "--state", "submitted")["jobs"]
    assert [(j["id"], j["state"], j["remote_id"]) for j in listed] == [(sent, "submitted", "remote-1")]
    assert sent in cli(valkey_url, "jobs", "gpu", "--state", "submitted").stdout


# -- 6. an unknown queue is an error, with the closest known name ----------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["dead", "list", "Q"], ["held", "list", "Q"], ["jobs", "Q"], ["dead", "requeue", "Q", "--all"], ["resume", "Q"]],
    ids=" ".join,
)
def test_an_unknown_queue_is_one_line_naming_it_and_the_closest(valkey_url: str, args: list[str]) -> None:
    ok(valkey_url, "enqueue", "-q", "render", "-i", "1")

    def run(queue: str) -> str:
        return failed(cli(valkey_url, *(queue if a == "Q" else a for a in args)))

    assert run("rendr") == "error: unknown queue 'rendr'; did you mean 'render'?\n"
    assert run("zzz") == "error: unknown queue 'zzz'\n"


def test_pause_still_names_a_queue_before_its_first_job(valkey_url: str) -> None:
    assert ok(valkey_url, "pause", "later") == "paused later\n"
    assert as_json(valkey_url, "jobs", "later") == {"jobs": [], "next_cursor": None}


# -- 4. bulk deletes ask first ------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["purge", "gpu", "--state", "dead"], ["dead", "purge", "gpu"]], ids=" ".join)
def test_purge_without_yes_off_a_terminal_refuses_and_deletes_nothing(valkey_url: str, args: list[str]) -> None:
    for i in range(3):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    kill_jobs(valkey_url, "gpu", 3)
    message = failed(cli(valkey_url, *args, input="y\n"))  # piped input is no person answering
    assert message == (
        "error: refusing to purge 3 dead job(s) of queue gpu unconfirmed: add --yes to go ahead (or --dry-run to see "
        "what would go)\n"
    )
    assert ok(valkey_url, *args, "--dry-run") == "would purge 3 dead job(s) of queue gpu\n"
    assert purge_count(valkey_url, "gpu", "dead") == 3
    assert ok(valkey_url, *args, "--yes") == "purged 3\n"
    assert purge_count(valkey_url, "gpu", "dead") == 0
    assert ok(valkey_url, *args) == "purged 0\n"  # nothing to delete: nothing to confirm


def test_purge_at_a_terminal_asks_and_takes_no_for_an_answer(valkey_url: str) -> None:
    for i in range(4):
        ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i))
    code, shown = on_terminal(["purge", "gpu", "--state", "queued", "--url", valkey_url], answer=b"n\n")
    assert code == 1 and "Purge 4 queued job(s) of queue gpu?" in shown and "error: not confirmed" in shown
    assert purge_count(valkey_url, "gpu", "queued") == 4
    code, shown = on_terminal(["purge", "gpu", "--state", "queued", "--url", valkey_url], answer=b"y\n")
    assert code == 0 and "purged 4" in shown, shown
    assert purge_count(valkey_url, "gpu", "queued") == 0


def test_dry_run_refuses_a_state_that_cannot_be_purged(valkey_url: str) -> None:
    ok(valkey_url, "enqueue", "-q", "gpu", "-i", "1")
    assert "cannot purge state 'active'" in failed(cli(valkey_url, "purge", "gpu", "--state", "active", "--dry-run"))


# -- 3. `config check` lists every problem ------------------------------------------------------------------


def test_config_check_lists_every_problem_with_did_you_mean(tmp_path: Path) -> None:
    config = tmp_path / "offload.yaml"
    config.write_text(
        "storage: {kind: s3, buckt: b, endpoint_url: '${EDGES_UNSET_VAR}'}\n"
        "backends:\n  sim: {kind: http-job, base_ur: 'http://127.0.0.1:9', api_key: k}\n"
        "queues:\n  gpu: {backend: sim, concurency: 3, max_attempts: 0}\n"
        "servr: {}\n"
    )
    result = runner.invoke(app, ["config", "check", "-c", str(config)], env={"EDGES_UNSET_VAR": None})
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: storage.endpoint_url: environment variable EDGES_UNSET_VAR is not set",
        "error: storage.buckt: unknown setting; did you mean 'bucket'?",
        "error: backends.sim.base_ur: unknown setting; did you mean 'base_url'?",
        "error: queues.gpu.concurency: unknown setting; did you mean 'concurrency'?",
        "error: servr: unknown setting; did you mean 'server'?",
        "error: queues.gpu.max_attempts: Input should be greater than or equal to 1",
    ]
    doc = orjson.loads(runner.invoke(app, ["config", "check", "-c", str(config), "--json"]).stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 6


def test_config_check_lists_problems_across_blocks_once_the_blocks_are_valid(tmp_path: Path) -> None:
    config = tmp_path / "offload.yaml"
    config.write_text(
        "backends: {sim: {kind: http-job, base_url: 'http://127.0.0.1:9', api_key: k}}\n"
        "queues:\n  a: {backend: simm}\n  b: {backend: other}\n"
    )
    result = runner.invoke(app, ["config", "check", "-c", str(config)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: queues.a.backend: no backend named 'simm' is configured; did you mean 'sim'?",
        "error: queues.b.backend: no backend named 'other' is configured",
    ]


# -- 2. `result`: a directory made when missing; no storage is an error, not a URL to nothing --------------------


def finish_one(url: str, tmp_path: Path, store_output: bool) -> str:
    job_id = ok(url, "enqueue", "-q", "gpu", "-i", '{"n": 1}').strip()

    async def go(store: QueueStore) -> None:
        (job,) = await store.claim("gpu", "w1", 1)
        location = f"file://{tmp_path}/nowhere/{job.output_key}"
        if store_output:
            results = create_storage(LocalStorageSettings(path=str(tmp_path / "results")))
            location = await results.put_json(job.output_key, {"text": "done"})
            await results.aclose()
        await store.complete(job.id, job.token, location)

    with_store(url, go)
    return job_id


def test_result_without_storage_configured_is_one_line_and_no_url(
    valkey_url: str, tmp_path: Path, tmp_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./offload.yaml, no stack: nothing configures storage
    job_id = finish_one(valkey_url, tmp_path, store_output=False)
    result = runner.invoke(app, ["result", job_id], env={"OFFLOAD_REDIS_URL": valkey_url})
    message = failed(result)
    assert f"the output of job {job_id}" in message and "no storage is configured" in message
    assert "file://" not in result.stdout


def test_result_download_into_a_missing_directory_creates_it(valkey_url: str, tmp_path: Path) -> None:
    job_id = finish_one(valkey_url, tmp_path, store_output=True)
    config = tmp_path / "offload.yaml"
    config.write_text(f"redis_url: {valkey_url}\nstorage: {{kind: local, path: {tmp_path / 'results'}}}\n")
    into = tmp_path / "new" / "nested"
    result = runner.invoke(app, ["result", job_id, "--download", f"{into}/", "--config", str(config)])
    assert result.exit_code == 0, result.stderr
    assert into.is_dir() and orjson.loads((into / "output.json").read_bytes()) == {"text": "done"}


# -- 5. a failed `up` leaves nothing running -------------------------------------------------------------------


def processes_under(home: Path) -> list[str]:
    """Command lines of live processes that name `home` (Valkey's and the S3 server's data are under it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(home) in line and str(os.getpid()) != entry.name:
                found.append(line)
    return found


def test_a_failed_up_stops_everything_it_started(tmp_path: Path) -> None:
    home = tmp_path / ".offload"
    env = {**os.environ, "OFFLOAD_HOME": str(home)}
    try:  # the simulator refuses the latency: Valkey and the S3 server were already running by then
        proc = subprocess.run(
            [OFFLOAD, "up", "--latency", "bogus"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
        )
        assert proc.returncode == 1 and proc.stderr.startswith("error: the GPU API simulator did not start")
        assert running_url(home) is None and not (home / "stack.json").exists()
        assert processes_under(home) == []
    finally:
        stop_embedded(home)


def test_a_failed_up_keeps_a_valkey_that_ran_before(tmp_path: Path) -> None:
    home = tmp_path / ".offload"
    env = {**os.environ, "OFFLOAD_HOME": str(home)}
    try:
        assert subprocess.run([OFFLOAD, "embedded", "start"], env=env, timeout=60, capture_output=True).returncode == 0
        before = running_url(home)
        proc = subprocess.run([OFFLOAD, "up", "--latency", "bogus"], capture_output=True, env=env, timeout=120)
        assert proc.returncode == 1 and before is not None and running_url(home) == before
        assert [line for line in processes_under(home) if "valkey" not in line] == []
    finally:
        stop_embedded(home)


# -- 7. --version and shell completion ---------------------------------------------------------------------------


def test_version_is_the_installed_one() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"offload {version('offload')}\n"


def test_shell_completion_is_offered_and_completes_commands() -> None:
    script = subprocess.run([OFFLOAD, "--show-completion", "bash"], capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_OFFLOAD_COMPLETE" in script.stdout
    env = {**os.environ, "_OFFLOAD_COMPLETE": "complete_bash", "COMP_WORDS": "offload dead p", "COMP_CWORD": "2"}
    done = subprocess.run([OFFLOAD], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.split() == ["purge"]


# -- 8. the demo's closing lines ----------------------------------------------------------------------------------


def test_demo_output_preview_is_one_line_of_valid_json() -> None:
    body = {"text": "line one\nline two " + "x" * 500, "tokens": list(range(50)), "n": 12345678901234567}
    shown = orjson.dumps(preview(body)).decode()
    assert "\n" not in shown and len(shown) < 200
    back = orjson.loads(shown)  # never cut through a token: it parses
    assert back["text"].startswith("line one\nline two") and back["text"].endswith("…")
    assert back["tokens"] == [0, 1, 2, 3, 4, "… 45 more"] and back["n"] == body["n"]


def test_demo_hints_run_without_the_venv_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # this install's `offload` is not on it
    monkeypatch.chdir(bin_dir.parent.parent)  # the checkout, as after `make demo`
    relative = str((bin_dir / "offload").absolute().relative_to(Path.cwd()))
    assert command() == relative
    lines = hints("demo:1").strip().splitlines()
    assert lines[0] == f"read one:     {relative} result demo:1 --download out/"
    assert f"source {Path(relative).parent / 'activate'}" in lines[-1]
    shown = subprocess.run([lines[1].split()[2], "--version"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.startswith("offload ")  # the printed command runs as printed
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert command() == "offload" and "activate" not in hints("demo:1")


# -- 9. big integers, and tables off and on a terminal ----------------------------------------------------------------

BIG = 123456789012345678901234567890  # beyond 64 bits: orjson alone reads it as 1.2345678901234568e+29


def test_big_integers_show_as_integers(valkey_url: str) -> None:
    raw = b'{"id": "t1", "input": {"seed": 123456789012345678901234567890, "x": 1.5}}'

    async def push(store: QueueStore) -> None:
        await redis_admin(store.redis).rpush("tut:list", raw)

    with_store(valkey_url, push)
    ok(valkey_url, "ingest", "--from-list", "tut:list", "-q", "tut")
    record = json.loads(ok(valkey_url, "status", "tut:t1", "--json"))  # the standard library reads it exactly
    assert record["input"] == {"seed": BIG, "x": 1.5} and isinstance(record["input"]["seed"], int)
    assert f'"seed":{BIG}' in ok(valkey_url, "status", "tut:t1")
    assert json.loads(ok(valkey_url, "jobs", "tut", "--json"))["jobs"][0]["input"]["seed"] == BIG
    # enqueue cannot store it exactly: it says so instead of storing a float
    message = failed(cli(valkey_url, "enqueue", "-q", "tut", "-i", f'{{"seed": {BIG}}}'))
    assert "exceeds 64-bit range" in message and as_json(valkey_url, "jobs", "tut")["jobs"][0]["id"] == "tut:t1"


def test_tables_off_a_terminal_are_never_cut(valkey_url: str) -> None:
    name = "a-queue-name-long-enough-to-push-the-table-past-eighty-columns"
    ok(valkey_url, "enqueue", "-q", name, "-i", "1")
    for shown in (ok(valkey_url, "queues"), ok(valkey_url, "jobs", name)):
        assert name in shown and "…" not in shown
    assert max(len(line) for line in ok(valkey_url, "queues").splitlines()) > 120
    assert "oldest" in ok(valkey_url, "queues")


def test_a_narrow_terminal_shows_one_block_per_row_instead_of_cutting(valkey_url: str) -> None:
    name = "a-queue-name-long-enough-to-push-the-table-past-eighty-columns"
    ok(valkey_url, "enqueue", "-q", name, "-i", "1")
    code, shown = on_terminal(["queues", "--url", valkey_url], columns=80)
    assert code == 0
    lines = [line.strip() for line in shown.replace("\x1b[1m", "").splitlines()]
    assert f"queue  {name}" in lines and "queued  1" in lines and any(line.startswith("oldest") for line in lines)
    code, wide = on_terminal(["queues", "--url", valkey_url], columns=200)
    # one row per queue, whole: its name and its oldest job's age (before the spend columns) on one line
    assert code == 0 and any(name in line and re.search(r" \d+(\.\d+)?s ", line) for line in wide.splitlines())


def test_a_job_trimmed_while_listing_every_state_is_skipped(valkey_url: str) -> None:
    ids = [ok(valkey_url, "enqueue", "-q", "gpu", "-i", str(i)).strip() for i in range(3)]

    async def drop(store: QueueStore) -> None:  # the record goes, its set entry stays: a trim between two reads
        await store.redis.delete(keyspace.job("gpu", ids[0]))

    with_store(valkey_url, drop)
    assert sorted(j["id"] for j in as_json(valkey_url, "jobs", "gpu")["jobs"]) == sorted(ids[1:])


def test_revoking_a_key_asks_and_names_it(valkey_url: str) -> None:
    created = orjson.loads(ok(valkey_url, "keys", "create", "--scope", "viewer", "--json"))
    assert failed(cli(valkey_url, "keys", "revoke", created["id"])) == (
        f"error: refusing to revoke key {created['id']} unconfirmed: add --yes to go ahead (or --dry-run to see what "
        "would go)\n"
    )
    assert ok(valkey_url, "keys", "revoke", created["id"], "--dry-run") == f"would revoke key {created['id']}\n"
    assert [k["id"] for k in as_json(valkey_url, "keys", "list")] == [created["id"]]  # still there
    assert "no key with id 'nokey'" in failed(cli(valkey_url, "keys", "revoke", "nokey", "--dry-run"))
    assert ok(valkey_url, "keys", "revoke", created["id"], "--yes") == f"revoked {created['id']}\n"
    assert as_json(valkey_url, "keys", "list") == []


def test_a_key_or_pause_the_replicas_lack_is_refused_with_durability(valkey_url: str) -> None:
    """OFFLOAD_DURABILITY_REPLICAS=1 on a Valkey without replicas: the key is made on the primary but not handed
    out, and a revoke is refused (one line naming durability)."""
    durable = {"OFFLOAD_DURABILITY_REPLICAS": "1", "OFFLOAD_DURABILITY_TIMEOUT_MS": "50"}
    refused = failed(cli(valkey_url, "keys", "create", "--scope", "viewer", "--json", env=durable))
    assert "durability" in refused and "on 0 of 1 replicas" in refused and "ofk_" not in refused, refused
    created = orjson.loads(ok(valkey_url, "keys", "create", "--scope", "viewer", "--json"))
    refused = failed(cli(valkey_url, "keys", "revoke", created["id"], "--yes", env=durable))
    assert "on 0 of 1 replicas" in refused, refused
    # not acknowledged is all it means: the primary ran it, and with no failover the key is gone
    assert created["id"] not in [k["id"] for k in as_json(valkey_url, "keys", "list")]
    for verb in ("pause", "resume"):  # the store's commands take the same setting
        assert "on 0 of 1 replicas" in failed(cli(valkey_url, verb, "durable-q", env=durable))


def test_deleting_a_credential_or_provider_asks_first(valkey_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOAD_VAULT_MASTER_KEY", "test-master-key-0123456789")
    monkeypatch.setenv("EDGES_TOKEN", "ghp_abcdefghijklmnopqrstuvwxyz")
    ok(valkey_url, "autoscale", "credentials", "set", "gh", "--host", "github.com", "--from-env", "EDGES_TOKEN")
    ok(valkey_url, "providers", "add", "rp", "--type", "mock")
    for args in (["autoscale", "credentials", "delete", "gh"], ["providers", "delete", "rp"]):
        assert "refusing to delete" in failed(cli(valkey_url, *args))
        assert ok(valkey_url, *args, "--dry-run").startswith("would delete ")
    assert "gh" in as_json(valkey_url, "autoscale", "credentials", "list")
    assert [p["name"] for p in as_json(valkey_url, "providers", "list")] == ["rp"]
    ok(valkey_url, "autoscale", "credentials", "delete", "gh", "--yes")
    ok(valkey_url, "providers", "delete", "rp", "--yes")
    assert as_json(valkey_url, "autoscale", "credentials", "list") == {}
    assert as_json(valkey_url, "providers", "list") == []
