"""The submit intent (begin.lua), submission numbers, possible duplicates and the exact spend cap, on Valkey 9
and (when present) the system Redis 7."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from offload.connection import connect
from offload.errors import StaleLease
from offload.models import JobState
from offload.queue import keyspace
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore


@pytest.fixture
async def vstore(backend_url: str) -> AsyncIterator[QueueStore]:
    """A virtual clock, so leases end when a test says so (no outage: each jump is followed by a reap)."""
    now = [10_000_000]
    store = QueueStore(await connect(backend_url), clock_ms=lambda: now[0], lease_ms=1000, excuse_outages=False)
    store.now = now  # type: ignore[attr-defined]
    yield store
    await store.redis.aclose()


async def lapse(store: QueueStore, worker: str) -> None:
    """`worker` dies: its lease runs out and the maintenance returns its jobs."""
    store.now[0] += 1_001  # type: ignore[attr-defined]
    await store.reap("q")


async def test_submission_numbers_name_remote_runs(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert (c.submission, c.intent_open) == (0, False)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["OK:1"]
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["OK:1"]  # a repeat: the same, nothing new
    job = await vstore.get(job_id)
    assert (job.submission, job.intent_by, job.possible_duplicates) == (1, "w1", 0) and job.intent_at
    # the provider answered with an error (a 503): the same run is still wanted, under the same number
    assert await vstore.fail(job_id, c.token, "503", delay_ms=0, answered=True) == "retrying"
    (c,) = await vstore.claim("q", "w1", 1)
    assert (c.submission, c.intent_open) == (1, False)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["OK:1"]
    await vstore.checkpoint_many("q", [(job_id, c.token, "gpu", "r-1", 1)])
    # the remote run failed: a new run, a new number
    assert await vstore.fail(job_id, c.token, "remote job failed", delay_ms=0) == "retrying"
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["OK:2"]
    assert (await vstore.possible_duplicates("q")) == {}


async def test_an_intent_left_open_by_a_lost_worker_is_sent_again_and_counted(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)], backend="gpu") == ["OK:1"]
    await lapse(vstore, "w1")  # killed inside the submit call: the provider may have the job, we do not know
    (c2,) = await vstore.claim("q", "w2", 1)
    assert (c2.submission, c2.intent_open, c2.redelivered) == (1, True, True)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0)], backend="gpu") == ["OK:1:DUP"]
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0)], backend="gpu") == ["OK:1"]  # a repeat
    job = await vstore.get(job_id)
    assert (job.submission, job.possible_duplicates, job.intent_by) == (1, 1, "w2")
    assert await vstore.possible_duplicates("q") == {"gpu": 1}
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["STALE"]  # the lost worker pays nothing


async def test_begin_sees_a_cancel_right_before_the_submit(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.cancel(job_id) == "requested"
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0)]) == ["CANCEL"]
    assert (await vstore.get(job_id)).submission is None


async def test_over_the_job_cap_the_job_is_held_at_once_and_only_a_job_that_never_ran_gives_its_place_back(
    vstore: QueueStore,
) -> None:
    a, b, _ = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    ca, cb = await vstore.claim("q", "w", 2, job_cap=1)
    assert await vstore.begin_many("q", [(a, ca.token, 0.0), (b, cb.token, 0.0)], job_cap=1) == ["OK:1", "CAP:jobs"]
    held = await vstore.get(b)
    assert held.state is JobState.HELD and held.attempts == 0 and "jobs cap" in (held.error or "")
    assert await vstore.claim("q", "w", 5, job_cap=1) == [], "a capped queue hands out no fresh job"
    # a job counted today already (its remote run failed) may still go: it takes no more of the cap
    await vstore.checkpoint_many("q", [(a, ca.token, "gpu", "r-1", 1)])
    assert await vstore.fail(a, ca.token, "remote job failed", delay_ms=0) == "retrying"
    (ca,) = await vstore.claim("q", "w", 5, job_cap=1)
    assert ca.id == a
    assert await vstore.begin_many("q", [(a, ca.token, 0.0)], job_cap=1) == ["OK:2"]
    assert (await vstore.usage("q"))[1:] == (1, 0.0)
    # the provider refused a's second submission (a 4xx): that one runs nowhere, but a's first run was paid for
    # today, so a keeps its place and c still waits (giving it back let a capped day run two jobs)
    assert await vstore.fail(a, ca.token, "fatal: 400", retryable=False, answered=True, refund=True) == "dead"
    assert (await vstore.usage("q"))[1:] == (1, 0.0)
    assert await vstore.claim("q", "w", 5, job_cap=1) == []
    # a job refused at its first submission never ran: its place goes to the next job
    x, y = await vstore.enqueue_many("r", [JobSpec(input=i) for i in range(2)])
    (cx,) = await vstore.claim("r", "w", 1, job_cap=1)
    assert await vstore.begin_many("r", [(x, cx.token, 0.0)], job_cap=1) == ["OK:1"]
    assert await vstore.claim("r", "w", 1, job_cap=1) == []
    assert await vstore.fail(x, cx.token, "fatal: 400", retryable=False, answered=True, refund=True) == "dead"
    assert (await vstore.usage("r"))[1:] == (0, 0.0)
    (cy,) = await vstore.claim("r", "w", 1, job_cap=1)
    assert await vstore.begin_many("r", [(y, cy.token, 0.0)], job_cap=1) == ["OK:1"]


async def test_a_returned_job_gets_its_attempt_back_a_failed_one_does_not(vstore: QueueStore) -> None:
    """`returned` (a batch line expired before it ran): the attempt is given back, so returns past max_attempts
    still retry; without it the same failure uses the attempt up; a fatal one ends the job whatever it says."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=1)])
    for _ in range(3):
        (c,) = await vstore.claim("q", "w", 1)
        assert await vstore.fail(job_id, c.token, "expired", delay_ms=0, answered=True, returned=True) == "retrying"
        assert (await vstore.get(job_id)).attempts == 0
    (c,) = await vstore.claim("q", "w", 1)
    assert (await vstore.get(job_id)).attempts == 1
    assert await vstore.fail(job_id, c.token, "expired", delay_ms=0, answered=True) == "dead"
    [other] = await vstore.enqueue_many("q", [JobSpec(input=2, max_attempts=3)])
    (c,) = await vstore.claim("q", "w", 1)
    assert await vstore.fail(other, c.token, "fatal", retryable=False, returned=True) == "dead"
    assert (await vstore.get(other)).attempts == 1


async def test_the_spend_cap_reserves_the_worst_case_and_settles_the_real_cost(vstore: QueueStore) -> None:
    ids = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    c1, c2 = await vstore.claim("q", "w1", 2, spend_cap=1.5, estimate=1.0)
    assert await vstore.begin_many("q", [(c1.id, c1.token, 1.0), (c2.id, c2.token, 1.0)], spend_cap=1.5) == [
        "OK:1",
        "CAP:spend",
    ]
    assert (await vstore.usage("q"))[1:] == (1, 1.0)
    assert await vstore.claim("q", "w1", 1, spend_cap=1.5, estimate=1.0) == []  # 1.0 + 1.0 > 1.5
    await vstore.checkpoint_many("q", [(c1.id, c1.token, "gpu", "r-1", 1)])
    await lapse(vstore, "w1")  # its worker dies after the checkpoint: another one resumes and completes it
    (resumed,) = await vstore.claim("q", "w2", 1, spend_cap=1.5, estimate=1.0)
    assert resumed.id == c1.id and resumed.remote_id == "r-1"
    await vstore.complete(resumed.id, resumed.token, "s3://b/r", cost=0.25)  # the real cost replaces 1.0
    assert (await vstore.usage("q"))[1:] == (1, 0.25)
    (c3,) = await vstore.claim("q", "w2", 1, spend_cap=1.5, estimate=1.0)
    assert c3.id == ids[2]
    assert await vstore.begin_many("q", [(c3.id, c3.token, 1.0)], spend_cap=1.5) == ["OK:1"]
    # a failed run's reported cost settles too, and its retry is a new run, reserved again
    assert await vstore.fail(c3.id, c3.token, "remote job failed", delay_ms=0, cost=0.5) == "retrying"
    assert (await vstore.usage("q"))[1:] == (2, 0.75)


async def test_a_stale_workers_answer_is_attached_and_the_next_owner_polls_it(vstore: QueueStore) -> None:
    """A worker SIGSTOPped inside the submit call wakes with the provider's answer after its lease went to
    another worker: the remote id is kept for the job (ATTACHED) and the new owner's begin answers REMOTE, so
    nothing is sent twice."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1)])
    (c1,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c1.token, 0.0)]) == ["OK:1"]
    await lapse(vstore, "w1")
    (c2,) = await vstore.claim("q", "w2", 1)
    assert await vstore.checkpoint_many("q", [(job_id, c1.token, "gpu", "r-1", 1)]) == ["ATTACHED"]
    events = [e for _, e in await vstore.redis.xrange("offload:{q}:events") if job_id in e.get("jobs", "").split()]
    assert [e["state"] for e in events][-1] == "attached", events  # the history says where the id came from
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0)]) == ["REMOTE:1:r-1"]
    job = await vstore.get(job_id)
    assert (job.remote_id, job.submission, job.possible_duplicates) == ("r-1", 1, 0)
    # a job reaped while nobody holds it is claimed with the attached remote id: resumed, not submitted
    await lapse(vstore, "w2")
    (c3,) = await vstore.claim("q", "w3", 1)
    assert c3.remote_id == "r-1"


async def test_a_second_remote_id_for_one_submission_is_refused_with_the_first(vstore: QueueStore) -> None:
    """Both the stalled worker and the new owner sent submission 1 (a provider that ignores the
    Idempotency-Key ran it twice): whichever answer comes second learns of the first and cancels its copy."""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1)])
    (c1,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c1.token, 0.0)]) == ["OK:1"]
    await lapse(vstore, "w1")
    (c2,) = await vstore.claim("q", "w2", 1)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0)]) == ["OK:1:DUP"]
    assert await vstore.checkpoint_many("q", [(job_id, c1.token, "gpu", "r-1", 1)]) == ["ATTACHED"]
    assert await vstore.checkpoint_many("q", [(job_id, c2.token, "gpu", "r-2", 1)]) == ["DUP:r-1"]
    assert await vstore.checkpoint_many("q", [(job_id, c2.token, "gpu", "r-1", 1)]) == ["OK"]  # goes on with r-1
    assert (await vstore.get(job_id)).remote_id == "r-1"


async def test_a_stale_second_remote_id_is_refused_when_the_owner_recorded_first(vstore: QueueStore) -> None:
    [other] = await vstore.enqueue_many("q", [JobSpec(input=2)])
    (d1,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(other, d1.token, 0.0)]) == ["OK:1"]
    await lapse(vstore, "w1")
    (d2,) = await vstore.claim("q", "w2", 1)
    await vstore.begin_many("q", [(other, d2.token, 0.0)])
    assert await vstore.checkpoint_many("q", [(other, d2.token, "gpu", "s-2", 1)]) == ["OK"]
    assert await vstore.checkpoint_many("q", [(other, d1.token, "gpu", "s-1", 1)]) == ["STALE:DUP"]
    assert (await vstore.get(other)).remote_id == "s-2"


async def test_a_stale_answer_for_a_finished_job_or_an_older_submission_is_not_attached(vstore: QueueStore) -> None:
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c1,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c1.token, 0.0)]) == ["OK:1"]
    await lapse(vstore, "w1")
    (c2,) = await vstore.claim("q", "w2", 1)
    await vstore.begin_many("q", [(job_id, c2.token, 0.0)])
    await vstore.checkpoint_many("q", [(job_id, c2.token, "gpu", "r-2", 1)])
    await vstore.fail(job_id, c2.token, "remote job failed", delay_ms=0)  # a new run is wanted: submission 2
    (c3,) = await vstore.claim("q", "w3", 1)
    assert await vstore.begin_many("q", [(job_id, c3.token, 0.0)]) == ["OK:2"]
    assert await vstore.checkpoint_many("q", [(job_id, c1.token, "gpu", "r-1", 1)]) == ["STALE"]  # run 1 is over
    await vstore.checkpoint_many("q", [(job_id, c3.token, "gpu", "r-3", 2)])
    await vstore.complete(job_id, c3.token, "mem://x")
    assert await vstore.checkpoint_many("q", [(job_id, c1.token, "gpu", "r-9", 2)]) == ["STALE:DUP"]
    job = await vstore.get(job_id)
    assert (job.state, job.remote_id) == (JobState.SUCCEEDED, "r-3")


async def test_a_drain_closes_only_the_unsent_intents_its_own_lease_opened(vstore: QueueStore) -> None:
    """A draining worker names the jobs it began but never sent: their intents close, and the next owner sends
    the same run, uncounted; the job's spend reservation stands (taken once). A pair naming another lease's
    intent (a forged or stale token), or a job whose call was sent (not named), keeps its intent open and
    is counted when sent again."""
    a, b, c = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    leases = {j.id: j.token for j in await vstore.claim("q", "w1", 3)}
    items = [(j, leases[j], 2.0) for j in (a, b, c)]
    assert await vstore.begin_many("q", items, spend_cap=100.0) == ["OK:1", "OK:1", "OK:1"]
    unsent = [(a, leases[a]), (b, "w1/999")]  # b: not this lease's token; c: sent, so not named
    assert await vstore.release_leases("q", "w1", unsent=unsent) == 3
    again = {j.id: j for j in await vstore.claim("q", "w2", 3)}
    assert {j: again[j].intent_open for j in (a, b, c)} == {a: False, b: True, c: True}
    verdicts = await vstore.begin_many("q", [(j, again[j].token, 2.0) for j in (a, b, c)], spend_cap=100.0)
    assert verdicts == ["OK:1", "OK:1:DUP", "OK:1:DUP"]
    assert (await vstore.get(a)).possible_duplicates == 0
    assert (await vstore.usage("q"))[2] == pytest.approx(2.0 + 2 * 4.0)  # a reserved once; b, c again


async def test_a_job_handed_back_unsent_is_counted_in_the_day_it_is_sent_not_the_day_it_was_begun(
    vstore: QueueStore,
) -> None:
    """A drain hands back a capped job it began but never sent: its place in the day goes to the next job, and
    the job counts once, in the day its call goes out (kept, the begun day ran one job fewer than its cap and
    the job counted in two days). A job whose call was sent (not named) keeps its place."""
    a, b, c = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    leases = {j.id: j.token for j in await vstore.claim("q", "w1", 3, job_cap=2)}
    items = [(j, leases[j], 1.0) for j in (a, b, c)]
    assert await vstore.begin_many("q", items, job_cap=2, spend_cap=10.0) == ["OK:1", "OK:1", "CAP:jobs"]
    day, jobs, spend = await vstore.usage("q")
    assert (jobs, spend) == (2, 2.0)
    assert await vstore.release_leases("q", "w1", unsent=[(a, leases[a]), (b, "w1/999")]) == 2
    assert (await vstore.usage("q"))[1:] == (1, 1.0), "a's place was not given back"
    # the next day: a is sent there and counts there only
    vstore.now[0] += 86_400_000  # type: ignore[attr-defined]
    await vstore.release_held("q")
    again = {j.id: j for j in await vstore.claim("q", "w2", 3, job_cap=2)}
    assert set(again) == {a, b, c}
    verdicts = await vstore.begin_many("q", [(j, again[j].token, 1.0) for j in (a, b, c)], job_cap=2)
    assert verdicts == ["OK:1", "OK:1:DUP", "CAP:jobs"]
    assert (await vstore.redis.get(keyspace.cap("q", day, "jobs"))) == "1"
    assert (await vstore.usage("q"))[1] == 2


async def test_a_capped_job_cancelled_before_its_call_gives_its_place_back(vstore: QueueStore) -> None:
    """A capped job begun, then cancelled before its call went out (the worker says `unsent`): its place in the
    day goes to the next job and its spend reservation is refunded. A cancel of a job whose call was sent keeps
    both (the provider may have run it); so does a cancel naming another lease's token (refused)."""
    a, b, c = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(3)])
    leases = {j.id: j.token for j in await vstore.claim("q", "w1", 3, job_cap=2)}
    items = [(j, leases[j], 1.0) for j in (a, b, c)]
    assert await vstore.begin_many("q", items, job_cap=2, spend_cap=10.0) == ["OK:1", "OK:1", "CAP:jobs"]
    for job_id in (a, b):
        assert await vstore.cancel(job_id) == "requested"
    with pytest.raises(StaleLease):
        await vstore.ack_cancel(a, "w1/999", unsent=True)
    assert (await vstore.usage("q"))[1:] == (2, 2.0)
    await vstore.ack_cancel(a, leases[a], unsent=True)
    assert (await vstore.usage("q"))[1:] == (1, 1.0), "a's place was not given back"
    await vstore.ack_cancel(b, leases[b])  # sent: kept
    assert (await vstore.usage("q"))[1:] == (1, 1.0)
    assert {(await vstore.get(j)).state for j in (a, b)} == {JobState.CANCELLED}
    # c stays held for the day (held jobs wait for the roll); a job enqueued now takes the place
    [d] = await vstore.enqueue_many("q", [JobSpec(input=3)])
    (fresh,) = await vstore.claim("q", "w2", 1, job_cap=2)
    assert fresh.id == d
    assert await vstore.begin_many("q", [(d, fresh.token, 1.0)], job_cap=2, spend_cap=10.0) == ["OK:1"]
    assert (await vstore.usage("q"))[1:] == (2, 2.0)


async def test_a_claim_with_begin_opens_the_intents_begin_would_and_leaves_the_unsettled_ones_to_it(
    vstore: QueueStore,
) -> None:
    """claim.lua's `begin` (a synchronous API without caps): each fresh job comes back begun, with the number
    begin.lua would give it and the intent recorded as this lease's; a repeat of the claim (its reply lost)
    answers the same; the begin of the job's first try is then only a repeat. A job with an open intent from a
    lost lease or a cap in the window is not begun: begin.lua decides those."""
    a, b, c = await vstore.enqueue_many("q", [JobSpec(input=i, max_attempts=5) for i in range(3)])
    first = {j.id: j for j in await vstore.claim("q", "w1", 3, begin=True, request_id="r1")}
    assert {j: (first[j].begun, first[j].submission, first[j].intent_open) for j in first} == {
        a: (True, 1, False),
        b: (True, 1, False),
        c: (True, 1, False),
    }
    job = await vstore.get(a)
    assert (job.submission, job.intent_by, job.possible_duplicates) == (1, "w1", 0) and job.intent_at
    repeat = {j.id: j for j in await vstore.claim("q", "w1", 3, begin=True, request_id="r1")}
    assert repeat == first, "a repeated claim answered other leases or another begin"
    assert await vstore.begin_many("q", [(j, first[j].token, 0.0) for j in (a, b, c)]) == ["OK:1"] * 3
    # a: its run recorded and failed (a new run is wanted: number 2); b: its worker is lost with the intent open
    await vstore.checkpoint_many("q", [(a, first[a].token, "gpu", "r-a", 1)])
    assert await vstore.fail(a, first[a].token, "remote job failed", delay_ms=0) == "retrying"
    assert await vstore.complete_many("q", [(c, first[c].token, "results/c", None)]) == ["OK"]
    await lapse(vstore, "w1")
    again = {j.id: j for j in await vstore.claim("q", "w2", 3, begin=True)}
    assert set(again) == {a, b}
    assert (again[a].begun, again[a].submission, again[a].intent_open) == (True, 2, False)
    assert (again[b].begun, again[b].submission, again[b].intent_open) == (False, 1, True)
    verdicts = await vstore.begin_many("q", [(j, again[j].token, 0.0) for j in (a, b)], backend="gpu")
    assert verdicts == ["OK:2", "OK:1:DUP"]
    # under a cap the claim begins nothing: the reservation is begin.lua's
    [d] = await vstore.enqueue_many("q", [JobSpec(input=9)])
    (capped,) = await vstore.claim("q", "w3", 1, begin=True, job_cap=5)
    assert (capped.id, capped.begun, capped.submission) == (d, False, 0)
    assert await vstore.begin_many("q", [(d, capped.token, 0.0)], job_cap=5) == ["OK:1"]
    assert (await vstore.usage("q"))[1] == 1


async def test_a_drain_closes_the_intents_a_claim_opened(vstore: QueueStore) -> None:
    """Jobs begun by their claim and handed back unsent (a drain) go out again as the same run, uncounted; one
    not named (its call was sent) is a possible duplicate."""
    a, b = await vstore.enqueue_many("q", [JobSpec(input=i) for i in range(2)])
    leases = {j.id: j.token for j in await vstore.claim("q", "w1", 2, begin=True)}
    assert await vstore.release_leases("q", "w1", unsent=[(a, leases[a])]) == 2
    again = {j.id: j for j in await vstore.claim("q", "w2", 2)}
    assert {j: again[j].intent_open for j in (a, b)} == {a: False, b: True}
    verdicts = await vstore.begin_many("q", [(j, again[j].token, 0.0) for j in (a, b)], backend="gpu")
    assert verdicts == ["OK:1", "OK:1:DUP"]


async def test_an_open_intent_is_settled_at_the_backend_it_was_recorded_with(vstore: QueueStore) -> None:
    """Issue 39, item 3: a routed queue's submission of unknown outcome at backend a is never sent to b. The
    backend is recorded with the intent, before the call; a new owner asking to send it to b is answered MOVED:a
    and opens nothing; at a it is the same submission again (counted). Once a's submission is settled (answered
    with an error: nothing runs there), the next one may go anywhere. (Before: b was answered OK:1:DUP, and the
    same run went to a second provider.)"""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0, "", "a", "fallback: sent to a")]) == ["OK:1"]
    job = await vstore.get(job_id)
    assert (job.backend, job.routed) == ("a", "fallback: sent to a")
    await lapse(vstore, "w1")  # killed inside the call at a
    (c2,) = await vstore.claim("q", "w2", 1)
    assert (c2.backend, c2.intent_open) == ("a", True)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, "", "b", "")]) == ["MOVED:a"]
    assert (await vstore.get(job_id)).backend == "a"
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, "", "a", "")]) == ["OK:1:DUP"]
    # a's answer was an error that says nothing ran (its intent closed): free to go elsewhere
    assert await vstore.fail(job_id, c2.token, "500", delay_ms=0, answered=True) == "retrying"
    (c3,) = await vstore.claim("q", "w2", 1)
    assert (c3.backend, c3.intent_open) == (None, False)
    assert await vstore.begin_many("q", [(job_id, c3.token, 0.0, "", "b", "fallback: sent to b")]) == ["OK:1"]
    assert (await vstore.get(job_id)).backend == "b"


async def test_an_intent_left_open_by_a_gateway_error_keeps_its_backend(vstore: QueueStore) -> None:
    """A submit whose answer was a gateway's 5xx (not answered: the intent stays open) keeps the backend on the
    record through the retry, so the next owner settles it there. (Before: fail.lua dropped the backend.)"""
    [job_id] = await vstore.enqueue_many("q", [JobSpec(input=1, max_attempts=5)])
    (c,) = await vstore.claim("q", "w1", 1)
    assert await vstore.begin_many("q", [(job_id, c.token, 0.0, "", "a", "")]) == ["OK:1"]
    assert await vstore.fail(job_id, c.token, "502", delay_ms=0, answered=False) == "retrying"
    (c2,) = await vstore.claim("q", "w1", 1)
    assert (c2.backend, c2.intent_open) == ("a", True)
    assert await vstore.begin_many("q", [(job_id, c2.token, 0.0, "", "b", "")]) == ["MOVED:a"]
