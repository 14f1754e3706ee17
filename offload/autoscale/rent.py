"""Scaling up: which provider rents, what the machine receives, the spend cap, and the rental journal around the
provider call.

- A queue names one provider or several in order of preference (`providers: [a, b]`). A provider is usable now
  unless it cannot be built, lacks a prerequisite, or backs off after failures (per provider: poll x 2^n, capped
  at 10 min). `choose: first` rents from the first usable one; `cheapest` asks each for its current offer price
  (`Provider.quote`) and rents from the lowest. Out of stock or a failed create moves on to the next provider
  in the same evaluation.
- Every failure, ambiguous ones included (a 5xx or a lost answer: the machine may exist), counts against the
  provider's backoff and raises an alert. An ambiguous create keeps its record, so the machine is adopted by its
  `offload-as-…` label if it shows up, and is never rented twice.
- A new machine on an avoided host, or priced over the cap, is released at once (landing.py). One on an avoided
  host counts as no rental and the provider is asked again (the third in a row is kept); one over the cap backs
  the provider off like a failed create.
- The spend cap looks one poll ahead: a rental is refused when today's spend plus the fleet's cost until the next
  evaluation would reach it. Dry-run (mock) spend is checked against dry-run spend only. The `autoscaler:` block's
  caps across all queues (machines, per provider, spend: fleet_caps.py) are checked at the same point.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any

from offload.access.api_keys import KeyStore
from offload.autoscale import landing, reconcile
from offload.autoscale.credentials import Credentials
from offload.autoscale.deploy import TOKEN_ENV, USER_ENV, script, start_command
from offload.autoscale.evaluation import Choice, Decision, Evaluation
from offload.autoscale.fleet_caps import fleet_cap
from offload.autoscale.instances import EventKind, Instance, log_event, new_instance_id, new_instance_token
from offload.autoscale.operator_only import OPERATOR, WHERE, host_commands, runs_on_host, secrets_problem
from offload.autoscale.providers import LaunchSpec, OutOfCapacity, Provider, ProviderError
from offload.autoscale.safety import provision_backoff
from offload.autoscale.state import spend
from offload.queue.memory import read_memory

if TYPE_CHECKING:
    from offload.autoscale.scaler import Autoscaler

log = logging.getLogger("offload.autoscale")


class RentOutcome(enum.StrEnum):
    OK = "ok"
    AMBIGUOUS = "ambiguous"  # the answer was lost: the machine may exist (its record stays, adopted by label)
    CAPACITY = "capacity"  # out of stock
    RELEASED = "released"  # landed on an avoided host and released at once: not a rental, ask again
    FAILED = "failed"


STARTED = (RentOutcome.OK, RentOutcome.AMBIGUOUS)  # count as a rental: the machine (may) exist


async def prerequisites(a: Autoscaler, ev: Evaluation, provider: Provider) -> str | None:
    """Why renting from this provider must not happen (None: fine). The admin key never goes to a machine, a
    block set over the API never runs its commands on this host, and the operator's secrets go only where the
    operator sent them (operator_only.py decides both): checked again here in case the provider changed after
    the block was set."""
    queue, cfg, source = ev.queue, ev.cfg, ev.source
    block = cfg.model_dump()
    if source == "api" and runs_on_host(provider.type) and (fields := host_commands(block)):
        return (
            f"{fields[0]} of an autoscale block set over the HTTP API would run on the server's own host "
            f"(provider type {provider.type!r}): {WHERE}"
        )
    if provider.type != "mock" and (why := await secrets_elsewhere(a, ev, provider)):
        return why
    key, what = machine_key(a, provider)
    if provider.real and not a.server.public_url:
        return "autoscaler.public_url (OFFLOAD_PUBLIC_URL) is not set: a rented machine could not reach us"
    if provider.type != "mock" and not key:
        return "autoscaler.worker_key (OFFLOAD_WORKER_API_KEY) is not set: rented machines need a worker key"
    if key and key == a.env.get("OFFLOAD_ADMIN_KEY"):
        return f"{what} is the admin key: refusing to send it to a rented machine"
    if provider.type == "local" and not (a.server.public_url or a.server_url):
        return "no server URL for local workers (set autoscaler.public_url)"
    if key and provider.type != "mock":  # the mock ships nothing anywhere
        return await worker_key_problem(a, key, queue, what)
    return None


async def secrets_elsewhere(a: Autoscaler, ev: Evaluation, provider: Provider) -> str | None:
    """Why this rental would carry a secret where it was not sent: an operator's secret to a provider or block an
    admin key configured, a vault credential to another git host, or an API-set block's `instance.env` to a
    provider that was re-created or moved since the values were given (None: it would not)."""
    queue, cfg, source = ev.queue, ev.cfg, ev.source
    origin, destination = a.origin(provider.name)
    own = bool(_own_key(provider))
    if why := secrets_problem(queue, cfg.model_dump(), source, provider.name, origin, own):
        return why
    if source == "api" and cfg.instance.env and a.bound.get(queue, {}).get(provider.name) != destination:
        return (
            f"instance.env of queue {queue}'s block was given for provider {provider.name!r} as it was then; it "
            "has been re-created or moved since (or the values predate that binding): PUT the block again "
            "with the values"
        )
    deployment = cfg.deployment
    if deployment is not None and deployment.git_credential:
        return await Credentials(a.redis).problem(deployment.git_credential, deployment.git_url)
    return None


def _own_key(provider: Provider) -> str | None:
    key = getattr(getattr(provider, "config", None), "worker_key", None)
    return key if isinstance(key, str) and key else None


def machine_key(a: Autoscaler, provider: Provider) -> tuple[str | None, str]:
    """The worker key a machine of this provider receives, and its name for messages: the provider's own, else
    the server's, which only the operator's providers get."""
    if own := _own_key(provider):
        return own, f"provider {provider.name!r}'s worker_key"
    key = a.server.worker_key if a.origin(provider.name)[0] == OPERATOR else None
    return key, "autoscaler.worker_key (OFFLOAD_WORKER_API_KEY)"


async def worker_key_problem(
    a: Autoscaler, token: str, queue: str, what: str = "autoscaler.worker_key (OFFLOAD_WORKER_API_KEY)"
) -> str | None:
    """The key a machine receives must be a live worker key covering the queue: never an admin, producer or
    viewer key, never one that was revoked (the machine would only loop on 401s)."""
    key = await KeyStore(a.redis).authenticate(token)
    if key is None:
        return (
            f"{what} is not a valid API key (unknown or revoked): create one with `offload keys create "
            f"--scope worker --queues {queue}`"
        )
    if key.scope != "worker":
        return f"{what} is a {key.scope} key: rented machines only ever get a worker-scoped key"
    if not key.covers(queue):
        return f"{what} does not cover queue {queue!r}"
    return None


async def cap_reached(a: Autoscaler, ev: Evaluation, *, dry_run: bool, extra: float = 0.0) -> str | None:
    """Whether today's (or this month's) spend plus the fleet's cost until the next evaluation (plus `extra`
    $/h more) reaches the queue's cap. Real and dry-run (mock) spend are counted apart."""
    queue, cfg = ev.queue, ev.cfg
    if cfg.daily_spend_cap is None and cfg.monthly_spend_cap is None:
        return None
    fleet = sum(i.price for i in ev.instances if i.live and (i.provider_type == "mock") == dry_run)
    ahead = (fleet + extra) * cfg.poll_interval / 3600
    today, month, _ = await spend(a.redis, queue, ev.now, dry_run=dry_run)
    kind = "dry-run " if dry_run else ""
    if cfg.daily_spend_cap is not None and today + ahead >= cfg.daily_spend_cap:
        return (
            f"queue {queue}: daily {kind}spend cap ${cfg.daily_spend_cap:.2f} reached (${today:.2f} spent, "
            f"${ahead:.2f} more until the next evaluation)"
        )
    if cfg.monthly_spend_cap is not None and month + ahead >= cfg.monthly_spend_cap:
        return (
            f"queue {queue}: monthly {kind}spend cap ${cfg.monthly_spend_cap:.2f} reached (${month:.2f} spent, "
            f"${ahead:.2f} more until the next evaluation)"
        )
    return None


async def _usable(a: Autoscaler, ev: Evaluation, name: str, c: Choice) -> Provider | None:
    """The provider if it may rent now; else None, with why in `c.skipped` (alerted unless it only backs off)."""
    queue = ev.queue
    try:
        provider = await a.provider(name)
    except Exception as exc:
        c.skipped[name] = f"unusable: {a.why(exc)}"
        await a.alerter.alert(
            "autoscale_failure", f"{queue}/{name}", f"queue {queue}: provider {name!r} is unusable: {a.why(exc)}"
        )
        return None
    if why := await prerequisites(a, ev, provider):
        c.skipped[name] = why
        await a.alerter.alert("autoscale_failure", f"{queue}/{name}", f"queue {queue}: not renting from {name}: {why}")
        return None
    until = ev.state.prov_until.get(name, 0.0)
    if until > ev.now:
        c.skipped[name] = f"backing off {until - ev.now:.0f}s after {ev.state.prov_failures.get(name, 0)} failure(s)"
        return None
    return provider


async def _by_price(a: Autoscaler, ev: Evaluation, c: Choice) -> None:
    """`choose: cheapest`: order the usable providers by their current offer (no quote: last)."""
    for p in c.order:
        try:
            c.quotes[p.name] = await p.quote(await launch_spec(a, ev, "offload-quote", quote=True))
        except Exception as exc:  # a quote is advice: a provider that cannot answer still rents, last
            log.warning("provider %s: quote failed: %s", p.name, a.why(exc))
            c.quotes[p.name] = None
    rank = {p.name: i for i, p in enumerate(c.order)}
    c.order.sort(key=lambda p: (c.quotes[p.name] is None, c.quotes[p.name] or 0.0, rank[p.name]))
    best = c.quotes[c.order[0].name]
    c.why = (
        f"cheapest current offer: {c.order[0].name} at ${best:.3f}/h"
        if best is not None
        else "no provider quoted a price: in order of preference"
    )


async def choose(a: Autoscaler, ev: Evaluation) -> Choice:
    c = Choice()
    for name in ev.cfg.names:
        if (provider := await _usable(a, ev, name, c)) is not None:
            c.order.append(provider)
    if ev.cfg.choose == "cheapest" and len(c.order) > 1:
        await _by_price(a, ev, c)
    elif c.order:
        c.why = f"first usable in order of preference: {c.order[0].name}"
    else:
        c.why = "no provider can rent now"
    return c


async def launch_spec(
    a: Autoscaler,
    ev: Evaluation,
    label: str,
    *,
    provider: Provider | None = None,
    instance_token: str | None = None,
    quote: bool = False,
) -> LaunchSpec:
    """What the machine receives: server URL, worker key, queue, instance id and token (and the git credential
    of its deployment). `quote`: the same for a price quote, without any secret."""
    queue, cfg = ev.queue, ev.cfg
    spec_cfg = cfg.instance
    env = {"OFFLOAD_QUEUE": queue, "OFFLOAD_INSTANCE_ID": label.removeprefix("offload-")}
    if not quote:
        env.update(spec_cfg.env)
    if url := a.server.public_url or a.server_url:
        env["OFFLOAD_SERVER"] = url
    key = machine_key(a, provider)[0] if provider is not None and not quote else None
    if key:
        env["OFFLOAD_TOKEN"] = key
    if instance_token and not quote:
        env["OFFLOAD_INSTANCE_TOKEN"] = instance_token
        a.redact.add(instance_token)
    handler = spec_cfg.handler
    command = ["offload", "worker", "--handler", handler, "--queue", queue] if handler else None
    deploy_script = None
    if cfg.deployment is not None:
        deploy_script, command, handler = script(cfg.deployment), start_command(cfg.deployment), None
        if cfg.deployment.git_credential and not quote:
            user, token = await Credentials(a.redis).reveal(cfg.deployment.git_credential, cfg.deployment.git_url)
            env[TOKEN_ENV] = token
            a.redact.add(token)
            if user:
                env[USER_ENV] = user
    return LaunchSpec(
        label=label,
        queue=queue,
        image=spec_cfg.image,
        gpu=spec_cfg.gpu,
        gpu_count=spec_cfg.gpu_count,
        disk_gb=spec_cfg.disk_gb,
        max_price_per_hour=spec_cfg.max_price_per_hour,
        env=env,
        handler=handler,
        command=command,
        spot=spec_cfg.spot,
        spot_max_price=spec_cfg.spot_max_price,
        script=deploy_script,
    )


async def _paused(a: Autoscaler, ev: Evaluation) -> str | None:
    """Why the whole queue may not rent now: a rental pause after machines that never booted or a broken host, or
    a job store that may evict or is full (a machine would be paid for nothing)."""
    qs, now = ev.state, ev.now
    until, why_paused = qs.paused_until()
    if until > now:
        if qs.last_reason != why_paused:
            await qs.save(a.redis, ev.queue, last_reason=why_paused)
            await log_event(
                a.redis,
                now,
                EventKind.BACKOFF,
                f"{ev.queue}: renting paused {until - now:.0f}s after {why_paused}",
                queue=ev.queue,
            )
        return f"renting paused {until - now:.0f}s after {why_paused}"
    memory = await read_memory(a.redis)
    full = "the job store is full (maxmemory): a GPU worker could claim nothing" if memory.full else None
    return memory.problem or full


async def provision(a: Autoscaler, ev: Evaluation, decision: Decision, n: int) -> int:
    """Rent up to `n` machines; returns how many rentals were started (an ambiguous one counts: it may exist)."""
    if held := await _paused(a, ev):
        decision.hold(held)
        return 0
    choice = await choose(a, ev)
    decision.provider = choice
    rented = 0
    failed_now: set[str] = set()
    avoid: dict[str, set[str]] = {}
    released: dict[str, int] = {}  # machines on avoided hosts released in a row, per provider
    for _ in range(n):
        for provider in choice.order:
            if provider.name in failed_now:
                continue
            if await _capped(a, ev, decision, provider):
                failed_now.add(provider.name)  # checked (and alerted) once per evaluation, not once per rental
                continue
            if provider.name not in avoid:
                avoid[provider.name] = await reconcile.avoided_hosts(a, provider.name, ev.now)
            outcome, inst = await _rent_from(a, ev, provider, avoid[provider.name], decision.reasons, released)
            if outcome in STARTED:
                rented += 1
                if inst is not None:
                    ev.instances.append(inst)
                decision.rented.append(provider.name)
                break
            failed_now.add(provider.name)  # out of stock or failed: the next provider, this very evaluation
        else:
            break
    return rented


async def _rent_from(
    a: Autoscaler, ev: Evaluation, provider: Provider, avoid: set[str], reasons: list[str], released: dict[str, int]
) -> tuple[RentOutcome, Instance | None]:
    """One rental from this provider, asked again after a machine released from an avoided host (landing.py keeps
    the third in a row, so this ends)."""
    while True:
        streak = released.get(provider.name, 0)
        outcome, inst = await rent_one(a, ev, provider, avoid, reasons, released=streak)
        if outcome != RentOutcome.RELEASED:
            released[provider.name] = 0 if outcome == RentOutcome.OK else streak
            return outcome, inst
        released[provider.name] = streak + 1


async def _capped(a: Autoscaler, ev: Evaluation, decision: Decision, provider: Provider) -> bool:
    """Whether one more machine from this provider would reach the queue's spend cap or a fleet-wide cap
    (held, and alerted for spend, if so)."""
    spec = ev.cfg.instance
    price = (spec.spot_max_price if spec.spot else spec.max_price_per_hour) or 0.0
    blocked = await cap_reached(a, ev, dry_run=provider.type == "mock", extra=price)
    fleet = None if blocked else await fleet_cap(a, ev, provider, price)
    if blocked or (fleet and "spend_cap" in fleet):
        await a.alerter.alert("spend_cap_reached", ev.queue, f"{blocked or fleet}; not renting")
    if why := blocked or fleet:
        decision.hold(why)
    return bool(blocked or fleet)


def _new_instance(ev: Evaluation, provider: Provider) -> tuple[Instance, str | None]:
    """The record of one rental and the token its machine receives (None for a dry run: nothing to bind)."""
    spec_cfg = ev.cfg.instance
    price = (spec_cfg.spot_max_price if spec_cfg.spot else spec_cfg.max_price_per_hour) or 0.0
    inst = Instance(
        id=new_instance_id(),
        queue=ev.queue,
        provider=provider.name,
        provider_type=provider.type,
        status="provisioning",
        created_at=ev.now,
        updated_at=ev.now,
        gpu=spec_cfg.gpu or "",
        price=price,
        spot=spec_cfg.spot,
    )
    inst.label = f"offload-{inst.id}"
    token = None
    if provider.type != "mock":
        token, inst.token_hash = new_instance_token()
    return inst, token


async def rent_one(
    a: Autoscaler, ev: Evaluation, provider: Provider, avoid: set[str], reasons: list[str], *, released: int = 0
) -> tuple[RentOutcome, Instance | None]:
    """One rental, journaled before the provider call; returns the outcome and the record (None if none stays).
    `released`: machines on this provider's avoided hosts released in a row this evaluation (landing.py)."""
    queue, now = ev.queue, ev.now
    inst, token = _new_instance(ev, provider)
    try:
        spec = await launch_spec(a, ev, inst.label, provider=provider, instance_token=token)
    except Exception as exc:  # e.g. the deployment's credential is missing: nothing was rented
        await a.alerter.alert(
            "autoscale_failure", f"{queue}/{provider.name}", f"queue {queue}: cannot rent: {a.why(exc)}"
        )
        return RentOutcome.FAILED, None
    spec.avoid_hosts = avoid
    await a.instances.create(inst, a.leader.token)  # the journal entry, before the provider call
    await log_event(
        a.redis,
        now,
        EventKind.PROVISIONING,
        f"{inst.id}: renting from {provider.name} for {queue} ({'; '.join(reasons)})",
        instance=inst.id,
        queue=queue,
    )
    try:
        await a.leader.check()
        a.provider_calls += 1
        machine = await provider.create(spec)
    except ProviderError as error:
        return await _create_failed(a, ev, provider, inst, error)
    changes: dict[str, Any] = {"provider_id": machine.provider_id, "host": machine.host_id or "", "accrued_at": now}
    if machine.price_per_hour:
        changes.update(price=float(machine.price_per_hour), price_reported=True)
    landed = await landing.settle(a, ev, provider, inst, spec, machine, changes, released)
    if landed == landing.Landing.RENT_AGAIN:
        return RentOutcome.RELEASED, None
    if landed == landing.Landing.NEXT_PROVIDER:
        return RentOutcome.FAILED, None
    await ev.state.provider_ok(a.redis, queue, provider.name)
    log.info("rented %s for %s: %s at %s", inst.id, queue, machine.provider_id, provider.name)
    return RentOutcome.OK, inst


async def _create_failed(
    a: Autoscaler, ev: Evaluation, provider: Provider, inst: Instance, error: ProviderError
) -> tuple[RentOutcome, Instance | None]:
    """The create call failed: back the provider off, alert, and keep the record only if the machine may exist."""
    queue, now, qs = ev.queue, ev.now, ev.state
    said = a.why(error)
    pause = provision_backoff(ev.cfg.poll_interval, qs.prov_failures.get(provider.name, 0) + 1)
    await qs.provider_failed(a.redis, queue, provider.name, pause, now)
    if error.ambiguous:  # may exist: reconcile adopts it by label, or fails it after the grace period
        await log_event(a.redis, now, EventKind.AMBIGUOUS, f"{inst.id}: {said}", instance=inst.id, queue=queue)
        await a.alerter.alert(
            "autoscale_failure",
            f"{queue}/{provider.name}",
            f"queue {queue}: renting "
            f"{inst.id} from {provider.name} may have failed ({said}); looking for it by its "
            f"label, renting from {provider.name} again in {pause:.0f}s",
        )
        return RentOutcome.AMBIGUOUS, inst
    await reconcile.fail(a, inst, f"provisioning failed: {said}", now, destroy=False)
    await a.alerter.alert(
        "autoscale_failure",
        f"{queue}/{provider.name}",
        f"queue {queue}: renting {inst.id} from {provider.name} failed ({said}); retrying there in {pause:.0f}s",
    )
    return (RentOutcome.CAPACITY if isinstance(error, OutOfCapacity) else RentOutcome.FAILED), None
