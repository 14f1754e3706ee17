"""The autoscaler loop: one leader (Redis lock + fencing token) evaluates each queue every poll_interval.

One evaluation of a queue reads into an `Evaluation` and ends in a `Decision` (evaluation.py):
1. list the providers' `offload-…` machines once, read the worker registry and the queue's events;
2. reconcile every live instance (reconcile.sync): worker correlation, provider-reported failures and
   pre-emptions, boot timeout, lost heartbeats, drain completion and drain timeout;
3. decide (triggers.py) the desired count and act: cancel idle drains and rent (rent.py) up to it, within
   max_workers counted over every machine still billed (draining and failing ones too), unless a backoff, the
   spend cap or missing prerequisites say wait; or drain (drain.py) what the scale-down rules allow;
4. carry out the teardown journal (reconcile.teardown) until the provider confirms;
5. accrue cost, and record the decision and its reasons (`offload autoscale status` shows them). Every few
   minutes, sweep each provider for orphans.

Time is the job store's (offload/queue/store_clock.py: Valkey's TIME, read at every tick), so every server that
may lead agrees on spend days, instance and heartbeat times and the lock's expiry whatever its own clock says; a test
injects a clock instead, so a whole day of load runs in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math

import orjson

from offload.autoscale import drain, fleet_caps, hybrid, keyspace, reconcile, rent, scale_in
from offload.autoscale.alert_settings import alert_settings
from offload.autoscale.alerts import Alerter
from offload.autoscale.drain import DrainReason
from offload.autoscale.evaluation import Decision, Evaluation, Listings
from offload.autoscale.instances import ACTIVE, Fenced, Instance, InstanceStore, StaleState
from offload.autoscale.leader import Leader
from offload.autoscale.operator_only import OPERATOR
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers import TYPES, Machine, Provider, build
from offload.autoscale.safety import RECENT_TASK, boot_hold
from offload.autoscale.settings import (
    AutoscaleSettings,
    ServerSide,
    env_bound,
    open_env,
    server_side,
    validate_autoscale,
    yaml_blocks,
)
from offload.autoscale.state import QueueState, save_decision
from offload.autoscale.triggers import QueueLoad, UpDecision, scale_up
from offload.autoscale.workers import RedisWorkers, WorkerInfo, WorkerSource
from offload.clock import Clock, in_ms
from offload.config import Settings
from offload.connection import is_outage
from offload.env import process_env
from offload.errors import ConfigError
from offload.eventloop import within
from offload.queue.store import QueueStore
from offload.queue.store_clock import StoreClock
from offload.redact import Redactor
from offload.redis_client import RedisClient

log = logging.getLogger("offload.autoscale")
HISTORY_DAYS = 30  # finished instance records are kept this long (status history, cost audit)


class Autoscaler:
    def __init__(
        self,
        redis: RedisClient,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
        owner: str | None = None,
        workers: WorkerSource | None = None,
        providers: ProviderStore | None = None,
        alerter: Alerter | None = None,
        server_url: str | None = None,
        provider_override: dict[str, Provider] | None = None,
        drain_settle: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings or Settings()
        self.clock = clock = clock or StoreClock()
        self.env = dict(process_env()) if env is None else env
        self.server: ServerSide = server_side(self.settings.autoscaler, self.env)
        # the queue's scripts read the store's clock themselves; an injected (test) clock is passed on to them
        injected = None if isinstance(clock, StoreClock) else in_ms(clock)
        self.store = QueueStore(redis, clock_ms=injected)
        self.instances = InstanceStore(redis)
        self.leader = Leader(redis, ttl=self.server.leader_ttl, clock=clock, owner=owner)
        self.workers = workers or RedisWorkers(redis)
        self.providers = providers or ProviderStore(redis)
        # every provider error, machine message and alert goes through this, fed with the secrets of the
        # configurations the scaler loaded (provider credentials, the worker key, instance.env values)
        self.redact = Redactor([self.server.worker_key])
        self.alerter = alerter or Alerter(alert_settings(self.settings.alerts), redis, clock, redact=self.redact)
        self.server_url = server_url
        self.override = provider_override or {}
        self.drain_settle = self.server.drain_settle if drain_settle is None else drain_settle
        self._cache: dict[str, tuple[int, Provider]] = {}
        self._next: dict[str, float] = {}
        self._next_sweep = 0.0
        self.sources: dict[str, str] = {}  # queue -> where its block came from: "offload.yaml" or "api"
        self.unreadable: set[str] = set()  # API-set blocks that cannot be decrypted here: not evaluated
        self.bound: dict[str, dict[str, str]] = {}  # queue -> the providers its API-set instance.env was given for
        self._origins: dict[str, tuple[str, str]] = {}  # provider -> (who made it, where it points), as last read
        self.provider_calls = 0  # calls this process made to providers (the two-server test counts them)

    # -- configuration ---------------------------------------------------------------------------

    async def configs(self) -> dict[str, AutoscaleSettings]:
        """offload.yaml's autoscale blocks, overridden by any set through the API (stored in Redis). Where each
        came from is kept in `self.sources` (a block set over the API may not run commands on this host)."""
        out: dict[str, AutoscaleSettings] = {}
        for name, block in yaml_blocks(self.settings).items():
            out[name] = validate_autoscale(block, f"queues.{name}.autoscale")
            self.sources[name] = "offload.yaml"
        names = sorted(await self.redis.smembers(keyspace.QUEUE_CONFIGS))
        raws = await self.redis.mget([keyspace.queue_config(q) for q in names]) if names else []
        self.unreadable = set()
        for queue, raw in zip(names, raws, strict=True):
            if raw:
                try:
                    stored = orjson.loads(raw)
                    self.bound[queue] = env_bound(stored) or {}
                    block = open_env(stored, self.providers.vault, queue)
                except ConfigError as exc:  # e.g. no master key: leave the queue alone rather than scale it to 0
                    log.warning("queue %s: its autoscale block cannot be read: %s", queue, exc)
                    self.unreadable.add(queue)
                    continue
                out[queue] = validate_autoscale(block, f"queues.{queue}.autoscale")
                self.sources[queue] = "api"
        for cfg in out.values():
            self.redact.add(*cfg.instance.env.values())
        return out

    def origin(self, name: str) -> tuple[str, str]:
        """(who made the provider, a digest of where it points) as of its last read: an injected provider is
        the operator's own, an unread one nobody's."""
        if name in self.override:
            return OPERATOR, f"override:{name}"
        return self._origins.get(name, ("", ""))

    async def provider(self, name: str) -> Provider:
        if name in self.override:
            return self.override[name]
        record = await self.providers.get(name, reveal=True)
        self._origins[name] = (record.origin, record.destination)
        self.redact.add(*(str(record.config[f]) for f in TYPES[record.type].secret_fields if record.config.get(f)))
        cached = self._cache.get(name)
        if cached and cached[0] == record.updated_at:
            return cached[1]
        if cached:
            await cached[1].aclose()
        built = build(name, record.type, record.config, self.redis, self.clock)
        self._cache[name] = (record.updated_at, built)
        return built

    def why(self, exc: BaseException) -> str:
        """An exception's text as it may be stored, logged or alerted: redacted."""
        return self.redact(str(exc))

    # -- the loop --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        log.info("autoscaler started (%s)", self.leader.owner)
        while not stop.is_set():
            try:
                await self.tick()
            except Fenced as exc:
                log.warning("autoscaler: %s", exc)
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # a cancel that redis-py turned into a TimeoutError: still a cancel
                if is_outage(exc):  # the store down or full (its maxmemory): nothing can be recorded, so nothing done
                    log.warning("autoscaler: the job store is unavailable (%s); retrying next tick", type(exc).__name__)
                else:
                    log.exception("autoscaler evaluation failed; retrying next tick")
            with contextlib.suppress(TimeoutError):
                await within(stop.wait(), self.server.tick)
        with contextlib.suppress(Exception):
            await self.leader.release()
        await self.aclose()

    async def tick(self, *, force: bool = False) -> bool:
        """One pass: evaluate the queues that are due. Returns whether this server is the leader."""
        if isinstance(self.clock, StoreClock):
            await self.clock.sync(self.redis)
        if not await self.leader.acquire():
            return False
        now = self.clock()
        configs = await self.configs()
        live = await self.instances.live()
        queues = (set(configs) | {i.queue for i in live}) - self.unreadable
        due = [q for q in sorted(queues) if force or now >= self._next.get(q, 0.0)]
        if due:
            workers = await self.workers.workers()
            listings: dict[str, tuple[bool, list[Machine]]] = {}
            for queue in due:
                cfg = configs.get(queue) or AutoscaleSettings.model_validate({})
                self._next[queue] = now + cfg.poll_interval
                await self.evaluate(queue, cfg, [i for i in live if i.queue == queue], workers, listings, now)
        if now >= self._next_sweep:
            self._next_sweep = now + self.server.orphan_sweep_interval
            await self.sweep(now)
            await self.instances.forget_before(now - HISTORY_DAYS * 86400)
            with contextlib.suppress(Exception):
                await self.alerter.monitor(self.store, await self.store.queues())
        return True

    async def listing(self, name: str, listings: Listings) -> tuple[bool, list[Machine]]:
        """The provider's machines, once per tick. (False, []) when the call failed: no conclusions then."""
        if name not in listings:
            try:
                provider = await self.provider(name)
                await self.leader.check()
                self.provider_calls += 1
                listings[name] = (True, await provider.list())
            except Fenced:
                raise
            except Exception as exc:
                log.warning("provider %s: listing failed: %s", name, self.why(exc))
                listings[name] = (False, [])
        return listings[name]

    async def evaluate(
        self,
        queue: str,
        cfg: AutoscaleSettings,
        insts: list[Instance],
        workers: list[WorkerInfo],
        listings: Listings,
        now: float,
    ) -> Decision:
        """One evaluation of one queue: reconcile its instances, decide, act, and record the decision."""
        qs = await QueueState.load(self.redis, queue)
        source = self.sources.get(queue, "offload.yaml")
        ev = Evaluation(queue=queue, cfg=cfg, state=qs, instances=insts, now=now, listings=listings, source=source)
        await self._reconcile(ev, workers)
        await self._teardowns(ev)
        ev.instances = [i for i in ev.instances if i.live]
        active = [i for i in ev.instances if i.status in ACTIVE and not i.teardown]
        draining = [i for i in ev.instances if i.status == "draining" and not i.teardown]
        load = await self._load(queue, ev.instances, workers, now)
        if scale_in.cost_trigger(cfg) is not None:
            await scale_in.observe(self.redis, queue, qs, load, now)
        await drain.schedule_targets(self, ev, active)
        up = scale_up(cfg, load, active, now, qs.last_down_fire, boot_hold(qs.boot_ewma, cfg.boot_timeout))
        if cfg.overflow is not None:  # the fleet carries the base load; overflow backends take the burst
            up = await hybrid.overflow_up(self.redis, self.store, ev, load, active, up)
        decision = Decision(
            at=now,
            enabled=cfg.enabled,
            active=len(active),
            billed=len(ev.instances),
            draining=len(draining),
            pending=load.pending,
            in_flight=load.in_flight,
            live_workers=load.live_workers,
            reasons=up.reasons,
        )
        mode, capped = await self._set_desired(ev, decision, up)
        short = (decision.desired or 0) - len(active)
        if short > 0:
            await self._grow(ev, decision, active, draining, short)
        elif up.held:
            decision.hold("a machine is booting: queue_depth and latency hold the count")
        if mode or (short <= 0 and not up.demand):
            fleet = [i for i in active if mode != DrainReason.SPEND_CAP or capped[i.provider_type == "mock"]]
            await drain.scale_down(self, ev, decision, fleet, mode)
        await save_decision(self.redis, queue, decision.to_dict())
        return decision

    async def _reconcile(self, ev: Evaluation, workers: list[WorkerInfo]) -> None:
        """Bring every instance of the queue in line with its machine and its worker, and accrue its cost."""
        by_instance = {w.instance_id: w for w in workers if w.instance_id}
        touched = await self.workers.touched(ev.queue)

        def registered(inst: Instance) -> float:
            worker = by_instance.get(inst.id)
            return worker.registered_at if worker is not None else math.inf

        # in the order the workers registered: the measured boot's average weighs the newest most, and the store
        # lists instances in the order of their random ids
        for inst in sorted(ev.instances, key=registered):
            listed, machines = await self.listing(inst.provider, ev.listings)
            by_id = {m.provider_id: m for m in machines}
            by_label = {m.label: m for m in machines}
            machine = by_id.get(inst.provider_id) if inst.provider_id else by_label.get(inst.label)
            try:
                worker = by_instance.get(inst.id)
                if worker is not None and worker.protected and not await self._self_protect_allowed(inst.provider):
                    worker = dataclasses.replace(worker, protected=False)  # a claim the provider does not honour
                await reconcile.sync(self, ev, inst, machine, listed, worker, touched)
                await reconcile.accrue(self, inst, ev.now)
            except StaleState as exc:
                log.info("instance %s moved meanwhile: %s", inst.id, exc)

    async def _set_desired(
        self, ev: Evaluation, decision: Decision, up: UpDecision
    ) -> tuple[DrainReason | None, dict[bool, str | None]]:
        """Set the desired count and floor: the triggers', or 0 when autoscaling is off or every kind of spend
        (real, dry-run) the queue's providers would add is capped. Returns that mode (None: the triggers) and
        the cap verdict per kind (keyed by dry-run)."""
        cfg, target, floor = ev.cfg, up.target, up.floor
        capped = {dry: await self._spend_capped(ev, dry) for dry in (False, True)}
        kinds = {(await self._kind(name)) == "mock" for name in cfg.names}
        mode = None
        if not cfg.enabled:
            target = floor = 0
            mode = DrainReason.DISABLED
        elif kinds and all(capped[k] for k in kinds):
            target = floor = 0
            mode = DrainReason.SPEND_CAP
            held = next(m for m in capped.values() if m) or ""
            await self.alerter.alert("spend_cap_reached", ev.queue, held)
            decision.hold(held)
        decision.desired, decision.floor = target, floor
        return mode, capped

    async def _spend_capped(self, ev: Evaluation, dry_run: bool) -> str | None:
        """The queue's own spend cap, else the one across all queues: either drains the queue's fleet."""
        return await rent.cap_reached(self, ev, dry_run=dry_run) or await fleet_caps.spend_reached(
            self, ev, dry_run=dry_run
        )

    async def _grow(
        self, ev: Evaluation, decision: Decision, active: list[Instance], draining: list[Instance], short: int
    ) -> None:
        """`short` machines too few: cancel idle drains first, then rent within max_workers."""
        undrained = await drain.cancel(self, draining, short, ev.now)
        want, room = short - undrained, ev.cfg.limit - len(ev.instances)
        decision.undrained = undrained
        if want > 0 and room <= 0:
            billed = len(ev.instances)
            decision.hold(
                f"max_workers {ev.cfg.limit} reached: {billed} machine(s) billed "
                f"({len(active)} active, {len(draining)} draining, "
                f"{billed - len(active) - len(draining)} failed, not yet destroyed)"
            )
        elif want > 0:
            await rent.provision(self, ev, decision, min(want, room))

    async def _load(self, queue: str, insts: list[Instance], workers: list[WorkerInfo], now: float) -> QueueLoad:
        """The queue's load. A worker counts as live only if it heart-beats, is not draining and its instance is
        not retired: a draining or failed machine's worker takes no new work (so no_workers must fire)."""
        stats = await self.store.stats(queue)
        retired = {i.id for i in insts if i.status not in ACTIVE or i.teardown}
        serving = [w for w in workers if queue in w.queues and now - w.last_heartbeat < self.server.heartbeat_timeout]
        live = [w for w in serving if not w.draining and (w.instance_id is None or w.instance_id not in retired)]
        dispatch = await self.workers.dispatch_workers(queue, now, {w.id for w in workers})
        counts = stats.counts
        return QueueLoad(
            pending=0 if stats.paused else counts.get("queued", 0),
            oldest_age=None if stats.paused or stats.oldest_ready_age_ms is None else stats.oldest_ready_age_ms / 1000,
            live_workers=len(live) + dispatch,
            paused=stats.paused,
            in_flight=counts.get("active", 0) + counts.get("submitted", 0),
            enqueued=stats.totals.get("enqueued", 0),
        )

    async def _kind(self, name: str) -> str:
        try:
            return (await self.provider(name)).type
        except Exception:
            return ""

    async def _teardowns(self, ev: Evaluation) -> None:
        """Carry out the queue's journaled teardowns until the provider confirms."""
        for inst in ev.instances:
            if inst.teardown != "pending":
                continue
            listed, machines = await self.listing(inst.provider, ev.listings)
            try:
                provider = await self.provider(inst.provider)
            except Exception as exc:
                log.warning("instance %s: provider %s unavailable: %s", inst.id, inst.provider, self.why(exc))
                continue
            await reconcile.teardown(self, inst, provider, {m.label: m for m in machines} if listed else {}, ev.now)

    async def _self_protect_allowed(self, name: str) -> bool:
        """A worker reports `protected` itself; only a provider config with allow_worker_protect trusts it."""
        try:
            provider = await self.provider(name)
        except Exception:
            return False
        return bool(getattr(getattr(provider, "config", None), "allow_worker_protect", False))

    # -- orphans ---------------------------------------------------------------------------------

    async def sweep(self, now: float) -> dict[str, list[str]]:
        known = {i.label for i in await self.instances.live()}
        names = set(self.override) | set(await self.redis.smembers(keyspace.PROVIDERS))
        found: dict[str, list[str]] = {}
        for name in sorted(names):
            try:
                provider = await self.provider(name)
                await self.leader.check()
                self.provider_calls += 1
                machines = await provider.list()
            except Fenced:
                raise
            except Exception as exc:
                log.warning("orphan sweep of %s failed: %s", name, self.why(exc))
                continue
            found[name] = await reconcile.sweep_orphans(self, name, provider, machines, known, now)
        return found

    async def aclose(self) -> None:
        for _, provider in self._cache.values():
            with contextlib.suppress(Exception):
                await provider.aclose()
        self._cache.clear()
        await self.alerter.aclose()


__all__ = ["RECENT_TASK", "Autoscaler"]
