"""The double-pay window closed by a webhook: a dispatch worker (a real `offload worker` process) SIGKILLed
inside the submit call, after the provider accepted the submission but before its answer arrived. The next
worker finds the submit intent open and waits the grace for that submission's webhook instead of submitting
again; the webhook adopts the remote id and the job completes with exactly one submission at the provider
(the simulator's submission log). On main, the second worker submits again: two remote jobs, paid twice."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.eventually import eventually
from support.server_helpers import server
from support.servers import free_port
from support.webhook_world import QUEUES, config_for, configure_sim, deliveries, sim_jobs
from test_worker_crash import OFFLOAD, base_env, spawn, stop

from bench import web
from offload.config import Settings
from offload.connection import connect
from offload.models import JobState
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore
from offload.testing.sim import running_sim


def submissions(sim_url: str) -> list[dict[str, object]]:
    return list(web.get(f"{sim_url}/_sim/submissions").json()["submissions"])


@pytest.mark.parametrize("provider", ["replicate", "runpod"])
async def test_worker_killed_inside_submit_is_adopted_by_its_webhook_not_paid_twice(
    provider: str, valkey_url: str, tmp_path: Path
) -> None:
    # The grace outlasts the remote job (12 s from its submission) whenever B claims: with the default 10 s, a B
    # that claims soon after A's lease runs out (a fast machine) sees its grace end as the webhook comes.
    async with killed_inside_submit(provider, valkey_url, tmp_path, grace_s=20.0) as (sim_url, store, job_id, b_log):
        job = await store.get(job_id)
        assert len(submissions(sim_url)) == 1, submissions(sim_url)
        assert len(sim_jobs(sim_url, job_id)) == 1
        assert job.possible_duplicates == 0 and job.result is not None
        assert await store.redis.hget(f"offload:{{{QUEUES[provider]}}}:job:{job_id}", "adopted") == "1"
        assert [d["statuses"] for d in deliveries(sim_url)] == [[200]]
        if provider == "runpod":  # RunPod calls only on completion: B waited out the grace for it
            assert "adopted from its webhook" in b_log.read_text()
        else:  # Replicate's `start` named the remote id before A's lease even ran out: B just resumed it
            assert [d["statuses"] for d in deliveries(sim_url, "start")] == [[200]]
            assert "adopted from its webhook" not in b_log.read_text()


async def test_a_start_webhook_adopts_a_killed_submission_that_runs_far_longer_than_the_grace(
    valkey_url: str, tmp_path: Path
) -> None:
    """Against a Replicate that ignores the Idempotency-Key, the remote job runs 8 s and the grace is 1 s: on
    completion alone, B would give up waiting and pay again. The `start` event (delivered twice, as a provider
    may) names the remote id at once: one submission, no possible duplicate, and B never resends."""
    async with killed_inside_submit(
        "replicate", valkey_url, tmp_path, latency=8.0, duplicate_rate=1.0, grace_s=1.0, poll_s=30.0
    ) as (sim_url, store, job_id, b_log):
        job = await store.get(job_id)
        assert len(submissions(sim_url)) == 1, submissions(sim_url)
        assert job.possible_duplicates == 0 and job.result is not None and job.attempts == 1
        (start,) = deliveries(sim_url, "start")
        assert start["copies"] == 2 and start["statuses"] == [200, 200]
        assert await store.redis.hget(f"offload:{{{QUEUES['replicate']}}}:job:{job_id}", "adopted") == "1"
        assert "sending it again" not in b_log.read_text()


async def test_without_its_webhook_the_job_is_submitted_again_after_the_grace(valkey_url: str, tmp_path: Path) -> None:
    """The webhook of the killed worker's submission never comes (dropped): after the grace the job is sent
    again (counted as a possible duplicate), and completes by the fallback poll: never stranded."""
    async with killed_inside_submit("replicate", valkey_url, tmp_path, drop=True, grace_s=2.0, poll_s=1.0) as (
        sim_url,
        store,
        job_id,
        b_log,
    ):
        job = await store.get(job_id)
        sent = submissions(sim_url)
        assert len(sent) == 2 and job.possible_duplicates == 1, sent
        assert "adopted from its webhook" not in b_log.read_text()
        assert all(d["dropped"] for d in deliveries(sim_url, None))  # its start and its completion


@contextlib.asynccontextmanager
async def killed_inside_submit(
    provider: str,
    valkey_url: str,
    tmp_path: Path,
    *,
    drop: bool = False,
    latency: float = 12.0,
    duplicate_rate: float = 0.0,
    **settings: Any,
) -> AsyncIterator[tuple[str, QueueStore, str, Path]]:
    """Worker A is SIGKILLed while the provider holds its submit call open (the remote job already exists);
    worker B, already running, takes the job over once A's lease ran out. Yields once the job succeeded:
    (simulator URL, store, job id, B's log)."""
    port = free_port()
    with running_sim() as base:
        sim_url = str(base)
        # the provider takes 60 s to answer a submit (the window the kill lands in) and runs a job `latency` s
        # (12: the second worker is up and claims the job, A's lease runs out after 1.5 s, before the job ends)
        configure_sim(
            sim_url,
            latency=latency,
            behaviour={"submit_latency": 60.0},
            drop_rate=1.0 if drop else 0.0,
            duplicate_rate=duplicate_rate,
        )
        data = config_for(valkey_url, sim_url, f"http://127.0.0.1:{port}", tmp_path / "results", **settings)
        path = tmp_path / "offload.yaml"
        path.write_text(yaml.safe_dump(data))
        client = await connect(valkey_url)
        store = QueueStore(client)
        env = {**base_env(), "OFFLOAD_LEASE_MS": "1500"}
        queue = QUEUES[provider]
        cmd = [OFFLOAD, "worker", "--queue", queue, "--config", str(path), "--grace", "1", "--log-level", "info"]
        b_log = tmp_path / "b.log"
        with server(valkey_url, settings=Settings.model_validate(data), port=port):
            job_id = await store.enqueue(queue, JobSpec(input={"id": "crash-1", "prompt": "p"}))
            a = spawn(cmd, env, tmp_path, tmp_path / "a.log")
            b = None
            try:

                async def arrived() -> bool:
                    return bool(submissions(sim_url))

                await eventually(arrived, 20, "the submission to reach the provider")
                if drop:  # from now on the provider answers at once and runs jobs of 1 s (A's call stays held)
                    config = {"seed": 7, "default": {"latency": 1.0}, "honour_idempotency_key": False}
                    async with web.async_client() as http:
                        (await http.post(f"{sim_url}/_sim/config", json=config)).raise_for_status()
                b = spawn(cmd, env, tmp_path, b_log)

                async def b_ready() -> bool:
                    return "serving queue" in b_log.read_text()

                await eventually(b_ready, 20, "the second worker to start")
                (entry,) = submissions(sim_url)
                assert entry["responded"] is None  # the answer is still on its way: A dies inside the call
                stop(a, signal.SIGKILL)
                assert a.returncode == -signal.SIGKILL

                async def succeeded() -> bool:
                    return (await store.get(job_id)).state == JobState.SUCCEEDED

                try:
                    await eventually(succeeded, 30, "the job to succeed")
                except AssertionError:
                    raise AssertionError(b_log.read_text()[-3000:]) from None
                yield sim_url, store, job_id, b_log
            finally:
                stop(a)
                if b is not None:
                    stop(b)
                await client.aclose()
