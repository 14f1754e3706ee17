"""The autoscaler loop: one leader (Redis lock + fencing token) evaluates each queue every poll_interval.

One evaluation of a queue:
1. list the provider's `offload-…` machines once, read the worker registry and the queue's events;
2. reconcile every live instance (reconcile.sync): worker correlation, provider-reported failures,
   boot timeout, lost heartbeats, drain completion;
3. decide (triggers.py) and act: rent what the scale-up triggers ask for, unless a backoff, the spend cap,
   missing prerequisites or a booting instance says wait; drain what the scale-down triggers allow, sparing
   busy, recently active and protected workers (safety.spared);
4. carry out the teardown journal (reconcile.teardown) until the provider confirms;
5. accrue cost. Every few minutes, sweep each provider for orphans.

Time comes from an injectable clock, so a whole day of load runs in a test in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

import orjson

from offload.autoscale import keys, reconcile
from offload.autoscale.alerts import Alerter, alert_settings
from offload.autoscale.config import AutoscaleSettings, ServerSide, open_env, server_side, validate_autoscale
from offload.autoscale.instances import ACTIVE, Fenced, Instance, InstanceStore, StaleState, log_event, new_instance_id
from offload.autoscale.leader import Leader
from offload.autoscale.operator_only import WHERE, host_commands, runs_on_host
from offload.autoscale.provider_store import ProviderStore
from offload.autoscale.providers import TYPES, LaunchSpec, Machine, Provider, ProviderError, build
from offload.autoscale.safety import RECENT_TASK, provision_backoff, spared
from offload.autoscale.state import QueueState, spend
from offload.autoscale.triggers import QueueLoad, down_fire, idle_since, idle_timeout, scale_up
from offload.autoscale.workers import RedisWorkers, WorkerInfo, WorkerSource
from offload.config import Settings
from offload.errors import ConfigError
from offload.queue.store import QueueStore
from offload.redact import Redactor

log = logging.getLogger("offload.autoscale")
Clock = Any
HISTORY_DAYS = 30  # finished instance records are kept this long (status history, cost audit)


class Autoscaler:
    def __init__(
        self, redis: Any, settings: Settings | None = None, *, clock: Clock = time.time, owner: str | None = None,
        workers: WorkerSource | None = None, providers: ProviderStore | None = None,
        alerter: Alerter | None = None, server_url: str | None = None,
        provider_override: dict[str, Provider] | None = None, drain_settle: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings or Settings()
        self.clock = clock
        self.env = dict(os.environ) if env is None else env
        self.server: ServerSide = server_side(self.settings.autoscaler, self.env)
        self.store = QueueStore(redis, clock=lambda: int(self.clock() * 1000))
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
        self.from_api: set[str] = set()  # queues whose block was set over the HTTP API (not offload.yaml)
        self.unreadable: set[str] = set()  # API-set blocks that cannot be decrypted here: not evaluated
        self.provider_calls = 0  # calls this process made to providers (the two-server test counts them)

    # -- configuration ---------------------------------------------------------------------------

    async def configs(self) -> dict[str, AutoscaleSettings]:
        """offload.yaml's autoscale blocks, overridden by any set through the API (stored in Redis)."""
        out: dict[str, AutoscaleSettings] = {}
        for name, q in self.settings.queues.items():
            if q.autoscale is not None:
                out[name] = validate_autoscale(q.autoscale, f"queues.{name}.autoscale")
        names = sorted(await self.redis.smembers(keys.QUEUE_CONFIGS))
        raws = await self.redis.mget([keys.queue_config(q) for q in names]) if names else []
        self.from_api, self.unreadable = set(), set()
        for queue, raw in zip(names, raws, strict=True):
            if raw:
                try:
                    block = open_env(orjson.loads(raw), self.providers.vault, queue)
                except ConfigError as exc:  # e.g. no master key: leave the queue alone rather than scale it to 0
                    log.warning("queue %s: its autoscale block cannot be read: %s", queue, exc)
                    self.unreadable.add(queue)
                    continue
                out[queue] = validate_autoscale(block, f"queues.{queue}.autoscale")
                self.from_api.add(queue)
        for cfg in out.values():
            self.redact.add(*cfg.instance.env.values())
        return out

    async def provider(self, name: str) -> Provider:
        if name in self.override:
            return self.override[name]
        record = await self.providers.get(name, reveal=True)
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
            except Exception:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # a cancel that redis-py turned into a TimeoutError: still a cancel
                log.exception("autoscaler evaluation failed; retrying next tick")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.server.tick)
        with contextlib.suppress(Exception):
            await self.leader.release()
        await self.aclose()

    async def tick(self, *, force: bool = False) -> bool:
        """One pass: evaluate the queues that are due. Returns whether this server is the leader."""
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

    async def _listing(self, name: str, listings: dict[str, tuple[bool, list[Machine]]]) -> tuple[bool, list[Machine]]:
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

    async def evaluate(self, queue: str, cfg: AutoscaleSettings, insts: list[Instance], workers: list[WorkerInfo],
                       listings: dict[str, tuple[bool, list[Machine]]], now: float) -> None:
        qs = await QueueState.load(self.redis, queue)
        by_instance = {w.instance_id: w for w in workers if w.instance_id}
        touched = await self.workers.touched(queue)
        for inst in insts:
            listed, machines = await self._listing(inst.provider, listings)
            by_id = {m.provider_id: m for m in machines}
            by_label = {m.label: m for m in machines}
            machine = by_id.get(inst.provider_id) if inst.provider_id else by_label.get(inst.label)
            try:
                worker = by_instance.get(inst.id)
                if worker is not None and worker.protected and not await self._self_protect_allowed(inst.provider):
                    worker = dataclasses.replace(worker, protected=False)  # a claim the provider does not honour
                await reconcile.sync(self, inst, cfg, machine, listed, worker, touched, qs, now)
                await reconcile.accrue(self, inst, now)
            except StaleState as exc:
                log.info("instance %s moved meanwhile: %s", inst.id, exc)
        await self._teardowns(insts, listings, now)
        active = [i for i in insts if i.status in ACTIVE and i.teardown != "pending"]
        fresh = [w for w in workers if queue in w.queues and now - w.last_heartbeat < self.server.heartbeat_timeout]
        stats = await self.store.stats(queue)
        load = QueueLoad(
            pending=0 if stats.paused else stats.counts.get("queued", 0),
            oldest_age=None if stats.paused or stats.oldest_ready_age_ms is None else stats.oldest_ready_age_ms / 1000,
            live_workers=max(len(fresh), stats.workers), paused=stats.paused,
        )
        decision = scale_up(cfg, load, active, now, qs.last_down_fire)
        if not cfg.enabled:
            decision.target = 0
        add = decision.target - len(active)
        if add > 0:
            await self._provision(queue, cfg, qs, add, decision.reasons, now)
        elif not decision.demand:
            await self._scale_down(queue, cfg, qs, active, decision.floor if cfg.enabled else 0, listings, now)

    async def _teardowns(self, insts: list[Instance], listings: dict[str, tuple[bool, list[Machine]]],
                         now: float) -> None:
        for inst in insts:
            if inst.teardown != "pending":
                continue
            listed, machines = await self._listing(inst.provider, listings)
            try:
                provider = await self.provider(inst.provider)
            except Exception as exc:
                log.warning("instance %s: provider %s unavailable: %s", inst.id, inst.provider, self.why(exc))
                continue
            await reconcile.teardown(self, inst, provider, {m.label: m for m in machines} if listed else {}, now)

    async def _self_protect_allowed(self, name: str) -> bool:
        """A worker reports `protected` itself; only a provider config with allow_worker_protect trusts it."""
        try:
            provider = await self.provider(name)
        except Exception:
            return False
        return bool(getattr(getattr(provider, "config", None), "allow_worker_protect", False))

    # -- scaling up ------------------------------------------------------------------------------

    async def _prerequisites(self, provider: Provider, queue: str, cfg: AutoscaleSettings) -> str | None:
        """Why renting must not happen (None: fine). The admin key never goes to a rented machine, and an
        API-set block never runs its commands on this host (see operator_only.py)."""
        if queue in self.from_api and runs_on_host(provider.type) and (fields := host_commands(cfg.model_dump())):
            return (f"{fields[0]} of an autoscale block set over the HTTP API would run on the server's own host "
                    f"(provider type {provider.type!r}): {WHERE}")
        key = self.server.worker_key
        if provider.real and not self.server.public_url:
            return "autoscaler.public_url (OFFLOAD_PUBLIC_URL) is not set: a rented machine could not reach us"
        if provider.type != "mock" and not key:
            return "autoscaler.worker_key (OFFLOAD_WORKER_API_KEY) is not set: rented machines need a worker key"
        if key and key == self.env.get("OFFLOAD_ADMIN_KEY"):
            return "autoscaler.worker_key is the admin key: refusing to send it to a rented machine"
        if provider.type == "local" and not (self.server.public_url or self.server_url):
            return "no server URL for local workers (set autoscaler.public_url)"
        if key and provider.type != "mock":  # the mock ships nothing anywhere
            return await self._worker_key_problem(key, queue)
        return None

    async def _worker_key_problem(self, token: str, queue: str) -> str | None:
        """The key a machine receives must be a live worker key covering the queue: never an admin, producer
        or viewer key, never one that was revoked (the machine would only loop on 401s)."""
        from offload.server.keys import KeyStore  # lazy: the server's routes import this module

        key = await KeyStore(self.redis).authenticate(token)
        what = "autoscaler.worker_key (OFFLOAD_WORKER_API_KEY)"
        if key is None:
            return f"{what} is not a valid API key (unknown or revoked): create one with `offload keys create " \
                   f"--scope worker --queues {queue}`"
        if key.scope != "worker":
            return f"{what} is a {key.scope} key: rented machines only ever get a worker-scoped key"
        if not key.covers(queue):
            return f"{what} does not cover queue {queue!r}"
        return None

    async def _provision(self, queue: str, cfg: AutoscaleSettings, qs: QueueState, n: int, reasons: list[str],
                         now: float) -> None:
        assert cfg.provider is not None
        try:
            provider = await self.provider(cfg.provider)
        except Exception as exc:
            await self.alerter.alert("autoscale_failure", queue, f"queue {queue}: provider {cfg.provider!r} is "
                                     f"unusable: {self.why(exc)}")
            return
        if why := await self._prerequisites(provider, queue, cfg):
            await self.alerter.alert("autoscale_failure", queue, f"queue {queue}: not renting: {why}")
            return
        until, why_paused = qs.paused_until()
        if until > now:
            if qs.last_reason != why_paused:
                await qs.save(self.redis, queue, last_reason=why_paused)
                await log_event(self.redis, now, "backoff", f"{queue}: renting paused {until - now:.0f}s after "
                                f"{why_paused}", queue=queue)
            return
        if blocked := await self._over_cap(queue, cfg, now):
            await self.alerter.alert("spend_cap_reached", queue, blocked)
            return
        avoid = await reconcile.avoided_hosts(self, cfg.provider, now)
        for _ in range(n):
            if not await self._rent_one(queue, cfg, provider, qs, avoid, reasons, now):
                break

    async def _over_cap(self, queue: str, cfg: AutoscaleSettings, now: float) -> str | None:
        if cfg.daily_spend_cap is None and cfg.monthly_spend_cap is None:
            return None
        today, month, _ = await spend(self.redis, queue, now)
        if cfg.daily_spend_cap is not None and today >= cfg.daily_spend_cap:
            return f"queue {queue}: daily spend cap ${cfg.daily_spend_cap:.2f} reached (${today:.2f}); not renting"
        if cfg.monthly_spend_cap is not None and month >= cfg.monthly_spend_cap:
            return f"queue {queue}: monthly spend cap ${cfg.monthly_spend_cap:.2f} reached (${month:.2f}); not renting"
        return None

    async def _rent_one(self, queue: str, cfg: AutoscaleSettings, provider: Provider, qs: QueueState,
                        avoid: set[str], reasons: list[str], now: float) -> bool:
        spec_cfg = cfg.instance
        inst = Instance(id=new_instance_id(), queue=queue, provider=provider.name, provider_type=provider.type,
                        status="provisioning", created_at=now, updated_at=now, gpu=spec_cfg.gpu or "",
                        price=spec_cfg.max_price_per_hour or 0.0)
        inst.label = f"offload-{inst.id}"
        env = {"OFFLOAD_QUEUE": queue, "OFFLOAD_INSTANCE_ID": inst.id, **spec_cfg.env}
        if url := self.server.public_url or self.server_url:
            env["OFFLOAD_SERVER"] = url
        if self.server.worker_key:
            env["OFFLOAD_TOKEN"] = self.server.worker_key
        command = ["offload", "worker", "--handler", spec_cfg.handler, "--queue", queue] if spec_cfg.handler else None
        spec = LaunchSpec(label=inst.label, queue=queue, image=spec_cfg.image, gpu=spec_cfg.gpu,
                          gpu_count=spec_cfg.gpu_count, disk_gb=spec_cfg.disk_gb,
                          max_price_per_hour=spec_cfg.max_price_per_hour, env=env, handler=spec_cfg.handler,
                          command=command, avoid_hosts=avoid)
        await self.instances.create(inst, self.leader.token)  # the journal entry, before the provider call
        await log_event(self.redis, now, "provisioning", f"{inst.id}: renting for {queue} ({'; '.join(reasons)})",
                        instance=inst.id, queue=queue)
        try:
            await self.leader.check()
            self.provider_calls += 1
            machine = await provider.create(spec)
        except ProviderError as exc:
            if exc.ambiguous:  # may exist: reconcile adopts it by label, or fails it after the grace period
                await log_event(self.redis, now, "ambiguous", f"{inst.id}: {self.why(exc)}", instance=inst.id,
                                queue=queue)
                return False
            failures = qs.prov_failures + 1
            pause = provision_backoff(cfg.poll_interval, failures)
            await qs.save(self.redis, queue, prov_failures=failures, prov_until=now + pause)
            await reconcile.fail(self, inst, f"provisioning failed: {self.why(exc)}", now, destroy=False)
            await self.alerter.alert("autoscale_failure", queue, f"queue {queue}: renting failed ({self.why(exc)}); "
                                     f"retrying in {pause:.0f}s")
            return False
        changes: dict[str, Any] = {"provider_id": machine.provider_id, "host": machine.host_id or "",
                                   "accrued_at": now}
        if machine.price_per_hour:
            changes.update(price=float(machine.price_per_hour), price_reported=True)
        await self.instances.update(inst, self.leader.token, now, **changes)
        if qs.prov_failures:
            await qs.save(self.redis, queue, prov_failures=0, prov_until=0.0)
        log.info("rented %s for %s: %s at %s", inst.id, queue, machine.provider_id, provider.name)
        return True

    # -- scaling down ----------------------------------------------------------------------------

    async def _scale_down(self, queue: str, cfg: AutoscaleSettings, qs: QueueState, active: list[Instance],
                          target: int, listings: dict[str, tuple[bool, list[Machine]]], now: float) -> None:
        fire = down_fire(cfg, now, max(cfg.poll_interval * 2, 120.0))
        if fire is not None and fire > qs.last_down_fire:
            await qs.save(self.redis, queue, last_down_fire=fire, down_pending=1)
            await log_event(self.redis, now, "schedule", f"{queue}: scale-down schedule fired", queue=queue)
        candidates: list[Instance] = []
        floor = target
        if qs.down_pending:
            floor = cfg.min_workers
            if len(active) <= floor:
                await qs.save(self.redis, queue, down_pending=0)
            candidates = sorted(active, key=lambda i: (i.status == "running", i.created_at))
        else:
            timeout = idle_timeout(cfg)
            if timeout is not None:
                candidates = sorted((i for i in active if i.status == "running" and now - idle_since(i) >= timeout),
                                    key=lambda i: i.created_at)
        excess = len(active) - floor
        for inst in candidates:
            if excess <= 0:
                break
            if spared(inst, now, self.server.recent_task) is not None:
                continue
            await self._drain(inst, listings, now)
            excess -= 1

    async def _drain(self, inst: Instance, listings: dict[str, tuple[bool, list[Machine]]], now: float) -> None:
        """Stop the worker claiming, let it finish what it has; reconcile destroys it once it holds nothing."""
        try:
            await self.instances.update(inst, self.leader.token, now, status="draining", drain_at=now)
        except StaleState:
            return
        if inst.worker_id:
            await self.workers.set_draining(inst.worker_id)
        _, machines = await self._listing(inst.provider, listings)
        machine = next((m for m in machines if m.provider_id == inst.provider_id), None)
        if machine is not None:
            try:
                provider = await self.provider(inst.provider)
                await self.leader.check()
                self.provider_calls += 1
                await provider.drain(machine)
            except ProviderError as exc:
                log.warning("drain signal to %s failed: %s", inst.id, self.why(exc))
        await log_event(self.redis, now, "draining", f"{inst.id}: idle, draining before teardown",
                        instance=inst.id, queue=inst.queue)

    # -- orphans ---------------------------------------------------------------------------------

    async def sweep(self, now: float) -> dict[str, list[str]]:
        known = {i.label for i in await self.instances.live()}
        names = set(self.override) | set(await self.redis.smembers(keys.PROVIDERS))
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
