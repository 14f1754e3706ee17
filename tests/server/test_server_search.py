"""Search and the dead letter grouped by error, over real HTTP against a real server and Valkey: filters by error
text (plain, any case), id prefix, state, backend, idempotency key and time; a bounded scan that pages with a
cursor; groups that ignore ids and numbers; bulk requeue and purge of one group; scopes; hostile input -> 4xx."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.dashboard_helpers import dead_jobs, enqueue
from support.server_helpers import client, make_key, new_queue, server
from support.servers import ValkeyServer

from offload.queue.dead_groups import error_pattern

pytestmark = pytest.mark.xdist_group("server-search")


@pytest.fixture(scope="module")
def api(valkey: ValkeyServer) -> Iterator[tuple[str, str]]:
    with server(valkey.url, max_wait_s=5) as srv:
        yield srv


def ids(reply: httpx.Response) -> list[str]:
    assert reply.status_code == 200, reply.text
    return [j["id"] for j in reply.json()["jobs"]]


def test_error_patterns_ignore_ids_and_numbers() -> None:
    assert error_pattern("job abc failed after 3 s") == error_pattern("job def failed after 5 s")
    assert error_pattern("job abc failed after 3 s") == "job <id> failed after <n> s"
    assert error_pattern("upstream 502 for gpu:0192abcdef0123456789") == "upstream <n> for <id>"
    assert error_pattern("bad input: no prompt") != error_pattern("bad input: no image")


def test_search_by_error_fragment_id_prefix_state_and_key(api: tuple[str, str], admin: httpx.Client) -> None:
    q = new_queue("search")
    oom, bad = dead_jobs(api, q, "CUDA out of memory (tried 2 GiB) [a-z]+.*", "bad input: no prompt")
    (keyed,) = enqueue(admin, q, {"p": 1})
    r = admin.post(f"/v1/queues/{q}/jobs", json={"input": 2}, headers={"Idempotency-Key": "order-77"})
    idem = r.json()["id"]
    search = f"/v1/queues/{q}/search"
    assert ids(admin.get(search, params={"error": "out OF memory"})) == [oom]  # any case
    assert ids(admin.get(search, params={"error": "[a-z]+.*"})) == [oom]  # plain text, not a pattern
    assert ids(admin.get(search, params={"error": ".*"})) == [oom]
    assert ids(admin.get(search, params={"error": "no prompt", "state": "queued"})) == []
    assert ids(admin.get(search, params={"id": bad})) == [bad]
    assert ids(admin.get(search, params={"id": keyed.partition(":")[2][:-3]})) == [keyed]  # prefix, queue implied
    assert sorted(ids(admin.get(search, params={"state": "queued"}))) == sorted([keyed, idem])
    assert ids(admin.get(search, params={"idempotency_key": "order-77"})) == [idem]
    assert ids(admin.get(search, params={"backend": "nowhere"})) == []
    now = int(time.time() * 1000)
    assert sorted(ids(admin.get(search, params={"finished_from": now - 600_000}))) == sorted([oom, bad])
    assert ids(admin.get(search, params={"created_from": now + 600_000})) == []


def test_search_pages_with_a_cursor(api: tuple[str, str], admin: httpx.Client) -> None:
    q = new_queue("pages")
    made = enqueue(admin, q, *range(7))
    seen: list[str] = []
    cursor: str | None = None
    for _ in range(10):
        params: dict[str, Any] = {"state": "queued", "limit": 3, **({"cursor": cursor} if cursor else {})}
        r = admin.get(f"/v1/queues/{q}/search", params=params)
        seen += ids(r)
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == made  # queued: oldest first, each once


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"error": "x" * 10_240}, "error"),
        ({"state": "sleeping"}, "state"),
        ({"id": "y" * 300}, "id"),
        ({"cursor": "9.9.9"}, "cursor"),
        ({"cursor": "42.0"}, "cursor"),
        ({"limit": 0}, "limit"),
        ({"created_from": -1}, "created_from"),
    ],
)
def test_hostile_search_input_is_a_4xx_naming_the_field(
    api: tuple[str, str], admin: httpx.Client, params: dict[str, Any], field: str
) -> None:
    q = new_queue("hostile")
    enqueue(admin, q, 1)
    r = admin.get(f"/v1/queues/{q}/search", params=params)
    assert r.status_code == 422, r.text
    assert [p["path"] for p in r.json()["detail"]] == [f"query.{field}"]
    assert "x" * 600 not in r.text  # a hostile value is not echoed back whole


def test_dead_groups_and_bulk_requeue_and_purge(api: tuple[str, str], admin: httpx.Client) -> None:
    q = new_queue("groups")
    slow = dead_jobs(api, q, "job abc failed after 3 s", "job def failed after 5 s", "job ghi failed after 12 s")
    (bad,) = dead_jobs(api, q, "bad input: no prompt")
    r = admin.get(f"/v1/queues/{q}/dead/groups")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["complete"] is True and body["scanned"] == 4
    top, other = body["groups"]
    assert (top["pattern"], top["count"], sorted(top["sample_ids"])) == ("job <id> failed after <n> s", 3, sorted(slow))
    assert (other["pattern"], other["count"], other["sample_ids"]) == ("bad input: no prompt", 1, [bad])
    viewer = client(api[0], make_key(api[0], api[1], "viewer", [q]))
    with viewer:
        assert viewer.get(f"/v1/queues/{q}/dead/groups").status_code == 200
        refused = viewer.post(f"/v1/queues/{q}/dead/groups/requeue", json={"pattern": top["pattern"]})
        assert refused.status_code == 403
    moved = admin.post(f"/v1/queues/{q}/dead/groups/requeue", json={"pattern": top["pattern"]})
    assert moved.status_code == 200 and sorted(moved.json()["moved"]) == sorted(slow)
    assert {admin.get(f"/v1/jobs/{j}").json()["state"] for j in slow} == {"queued"}
    assert admin.post(f"/v1/queues/{q}/dead/groups/purge", json={"ids": [bad, "other:0192"]}).json() == {"count": 1}
    assert admin.get(f"/v1/jobs/{bad}").status_code == 404
    assert admin.get(f"/v1/queues/{q}/dead/groups").json()["groups"] == []
    both = admin.post(f"/v1/queues/{q}/dead/groups/purge", json={"pattern": "x", "ids": [bad]})
    assert both.status_code == 422 and "pattern or ids" in both.text
