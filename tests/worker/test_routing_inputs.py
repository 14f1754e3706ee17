"""Issue 39, items 1 and 2, the remaining parts: a backend's input written as a template, and a backend's own health
thresholds over its queue's; end to end through the dispatch worker, the simulator and real Valkey (`a`: the
tutorial's job API, `b`: RunPod), and at config load.

- a template renders the job input's fields into the backend's input (what the simulator received is checked);
- a bad template fails `offload config check`, each problem naming its place; a job input without a field the
  template needs goes dead with the reason, unsent, and the worker goes on with the next job;
- `backends.b.health` overrides the queue's thresholds for `b` only (one error opens `b`, `a` takes five);
- the record of a routed job (`GET /v1/jobs/{id}`'s source, and `offload status --json`) says which backend ran
  it, why, and at what cost.
"""

from __future__ import annotations

import asyncio
import json
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

import pytest
import test_worker_faults as faults
import yaml
from support.server_helpers import server
from test_routing import _healthy, by_family, cool, families, routed, routed_data
from test_worker_crash import OFFLOAD, base_env
from test_worker_faults import enqueue, job_input, sim_call, stats, until, until_state, worker

from bench import web
from offload.config import Settings, problems
from offload.eventloop import within
from offload.input_maps import MissingInput, Template
from offload.queue import keyspace
from offload.queue.backend_limits import route_counters
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

BUCKET, sim, no_outputs, store = faults.BUCKET, faults.sim, faults.no_outputs, faults.store
_quick_backoff, _clean_sim = faults._quick_backoff, faults._clean_sim
__all__ = ["_healthy"]  # (the autouse fixture, shared with test_routing)

TEMPLATE = {
    "id": {"$input": "id"},
    "prompt": {"$input": "prompt"},
    "image_size": "square_hd",
    "first": {"$input": "messages.0.content"},
    "seed": {"$input": "seed", "default": 7},
}


def test_a_template_copies_fields_and_nothing_else() -> None:
    job = {"id": "x", "prompt": "p", "messages": [{"content": "c"}], "extra": "{{ 7 * 7 }}"}
    assert Template(TEMPLATE)(job) == {"id": "x", "prompt": "p", "image_size": "square_hd", "first": "c", "seed": 7}
    assert Template({"all": {"$input": "."}, "s": "{{ input.prompt }}"})(job) == {"all": job, "s": "{{ input.prompt }}"}
    with pytest.raises(MissingInput) as missing:
        Template(TEMPLATE)({"id": "x", "prompt": "p", "messages": []})
    assert str(missing.value) == "the job input has no 'messages.0.content' (the template's first needs it)"
    with pytest.raises(MissingInput):
        Template({"p": {"$input": "prompt.deeper"}})({"prompt": "a string has no fields"})


def test_a_bad_template_fails_the_config_check_naming_each_place(tmp_path: Path) -> None:
    config = tmp_path / "offload.yaml"
    data = routed_data("redis://localhost:1", {"kind": "local", "path": str(tmp_path)}, "http://sim")
    data["queues"]["q"]["inputs"] = {
        "a": {"template": {"prompt": {"$input": "no spaces"}, "x": [{"$input": "ok", "bogus": 1}]}},
        "b": {"templat": {}},
    }
    config.write_text(yaml.safe_dump(data))
    found = [str(p) for p in problems(config, env={})]
    assert (
        "queues.q.inputs.a.template: prompt.$input: must be a dotted path into the job input (prompt, image.url, or "
        ". for all of it), got 'no spaces'; x[0]: a {'$input': path} placeholder takes only 'default' beside it, got "
        "['bogus']" in found
    ), found
    assert "queues.q.inputs.b.templat: unknown setting; did you mean 'template'?" in found, found
    data["queues"]["q"]["inputs"] = {"b": {"template": {"p": 1}, "function": "x:y"}}
    config.write_text(yaml.safe_dump(data))
    assert [str(p) for p in problems(config, env={})] == [
        "queues.q.inputs.b: set either function (module:function) or template, not both"
    ]


async def test_a_template_shapes_the_input_sent_to_its_backend(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    await cool(store, "a", 30)  # so the job goes to b
    settings = routed(valkey_url, no_outputs, sim, inputs={"b": {"template": TEMPLATE}})
    [(job_id, input_id)] = await enqueue(store, "templated")
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    assert job.backend == "b"
    [remote] = (await sim_call(sim, "GET", f"/_sim/jobs?input_id={input_id}"))["jobs"]
    assert remote["input"] == {
        "id": input_id,
        "prompt": f"a haiku about {input_id}",
        "image_size": "square_hd",
        "first": "hi",
        "seed": 7,
    }
    assert job.input == job_input(input_id)  # the stored input stays the producer's


async def test_a_job_input_missing_a_templated_field_is_dead_unsent_and_the_worker_goes_on(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """The template needs `style`: a job without it is dead with the reason (not retried: the same input fails
    the same), nothing is sent, `b` is not counted unwell; the job after it, with `style`, runs."""
    await cool(store, "a", 30)
    template = {"id": {"$input": "id"}, "prompt": {"$input": "prompt"}, "style": {"$input": "style"}}
    settings = routed(valkey_url, no_outputs, sim, inputs={"b": {"template": template}})
    [bad] = await store.enqueue_many("q", [JobSpec(input=job_input("no-style"), max_attempts=3)])
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [bad], "dead", task)
        [good] = await store.enqueue_many("q", [JobSpec(input={**job_input("styled"), "style": "ink"})])
        await until_state(store, [good], "succeeded", task)
    assert job.error == (
        "fatal: the input mapping of backend b failed: MissingInput: the job input has no 'style' (the template's "
        "style needs it)"
    ), job.error
    assert job.attempts == 1 and job.remote_id is None
    assert await by_family(sim) == {"a": 0, "b": 1}
    assert await store.redis.hget(keyspace.backend_health("b"), "fails") is None


async def test_a_backends_own_health_overrides_the_queues(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """Both answer every submit 500. The queue opens a backend after 50 errors; `b`'s own block after 1, for 60 s.
    The job's first try at `b` (first in the route) opens `b` for `b`'s own 60 s; its retries go to `a`, whose
    errors count towards the queue's 50 and leave it closed."""
    failing = {"error_rate": 1.0, "error_statuses": [500], "faults_on": ["submit"]}
    await families(sim, a=failing, b=failing)
    data = routed_data(valkey_url, no_outputs, sim, health={"failures": 50, "cool_down_s": 5}, max_attempts=8)
    data["queues"]["q"]["backends"] = ["b", "a"]
    data["backends"]["b"]["health"] = {"failures": 1, "cool_down_s": 60}
    settings = Settings.model_validate(data)
    assert settings.health_for("q", "b").model_dump() == {
        "failures": 1,
        "window_s": 60.0,
        "cool_down_s": 60.0,
        "max_cool_down_s": 600.0,
    }
    assert settings.health_for("q", "a").failures == 50
    [(job_id, _)] = await enqueue(store, "health-override", max_attempts=8)
    async with worker(settings) as (task, _):

        async def a_tried() -> bool:
            return int(await store.redis.hget(keyspace.backend_health("a"), "fails") or 0) >= 1

        await until(a_tried, "the job's retry to fail at a", task)
    cool_ms = int(await store.redis.pttl(keyspace.backend_cooldown("b")))
    assert 30_000 < cool_ms <= 60_000, cool_ms  # b's own cool_down_s, not the queue's 5 s
    assert (await route_counters(store.redis, "b")).get("opened") == 1
    assert (await route_counters(store.redis, "a")).get("opened") is None
    assert await store.redis.hget(keyspace.backend_health("a"), "state") in (None, "closed")
    routed_why = (await store.get(job_id)).routed or ""
    assert routed_why.startswith("fallback: b cooling down until") and routed_why.endswith("sent to a"), routed_why


def test_a_backends_health_is_checked_at_load(tmp_path: Path) -> None:
    config = tmp_path / "offload.yaml"
    data = routed_data("redis://localhost:1", {"kind": "local", "path": str(tmp_path)}, "http://sim")
    data["backends"]["b"]["health"] = {"max_cool_down_s": 5, "failures": 0, "windw_s": 3}
    config.write_text(yaml.safe_dump(data))
    found = [str(p) for p in problems(config, env={})]
    assert "backends.b.health.failures: Input should be greater than or equal to 1" in found, found
    assert any(p.startswith("backends.b.health.windw_s: unknown setting; did you mean 'window_s'") for p in found)
    data["backends"]["b"]["health"] = {"max_cool_down_s": 5}
    config.write_text(yaml.safe_dump(data))
    assert [str(p) for p in problems(config, env={})] == [
        "backends.b.health.max_cool_down_s: must be at least cool_down_s (30.0, with queues.q.health under it), got 5.0"
    ]


async def test_the_record_says_which_backend_ran_the_job_and_at_what_cost(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore, tmp_path: Path
) -> None:
    """A routed job's record, as the API's JobView and `offload status --json` show it: its backend, why, cost."""
    await cool(store, "a", 30)
    settings = routed(valkey_url, no_outputs, sim, a={"price_per_job": 0.05}, b={"price_per_job": 0.01})
    [(job_id, _)] = await enqueue(store, "record")
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [job_id], "succeeded", task)
    with server(valkey_url, settings=settings) as (url, admin):
        async with web.async_client(base_url=url, headers={"Authorization": f"Bearer {admin}"}) as api:
            answer = await api.get(f"/v1/jobs/{job_id}", timeout=30)
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert (view["backend"], view["cost"]) == ("b", 0.01)
    assert view["routed"] == job.routed and (job.routed or "").endswith("sent to b")
    shown = await asyncio.create_subprocess_exec(
        OFFLOAD, "status", job_id, "--json", "--url", valkey_url, stdout=PIPE, stderr=PIPE, env=base_env()
    )
    out, err = await within(shown.communicate(), 60)
    assert shown.returncode == 0, err.decode()
    record = json.loads(out)
    assert (record["backend"], record["cost"], record["routed"]) == ("b", 0.01, job.routed)


async def test_a_one_backend_queue_whose_claim_opened_the_intent_closes_it_on_a_missing_field(
    valkey_url: str, no_outputs: dict[str, Any], sim: str, store: QueueStore
) -> None:
    """A synchronous API without a rate limit: the claim itself opens the submission's intent. A job whose input
    the template refuses is dead with the reason and its intent closed (nothing was sent, so nothing is left that
    a requeue would have to settle as a possible duplicate); a fixed job then runs as its first submission."""
    template = {"model": "gpt-sim", "messages": {"$input": "messages"}, "user": {"$input": "user"}}
    settings = Settings.model_validate(
        {
            "redis_url": valkey_url,
            "storage": no_outputs,
            "backends": {"gpu": {"kind": "openai", "base_url": f"{sim}/v1", "api_key": "sim-key"}},
            "queues": {"q": {"backend": "gpu", "inputs": {"gpu": {"template": template}}, "max_attempts": 3}},
        }
    )
    [bad] = await store.enqueue_many("q", [JobSpec(input=job_input("one-lane"))])
    async with worker(settings) as (task, _):
        [job] = await until_state(store, [bad], "dead", task)
        assert (job.error or "").startswith("fatal: the input mapping of backend gpu failed: MissingInput:")
        assert await store.redis.hget(keyspace.job("q", bad), "sub_open") == "0"  # the claim's intent, closed
        [good] = await store.enqueue_many("q", [JobSpec(input={**job_input("one-lane-ok"), "user": "u1"})])
        [done] = await until_state(store, [good], "succeeded", task)
    assert done.possible_duplicates == 0 and done.submission == 1
    assert (await stats(sim))["requests"].get("openai.chat", 0) == 1
