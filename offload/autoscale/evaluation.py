"""One evaluation of one queue: what it reads (`Evaluation`) and what it decided and why (`Decision`).

The scaler builds an `Evaluation` per due queue each tick and hands it to reconcile, rent and drain instead of a
dozen loose arguments; they fill in the `Decision`, which is stored as the queue's last decision (`offload
autoscale status` and the dashboard read it back through `state.load_decision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offload.autoscale.instances import Instance
from offload.autoscale.providers import Machine
from offload.autoscale.settings import AutoscaleSettings
from offload.autoscale.state import QueueState

if TYPE_CHECKING:
    from offload.autoscale.drain import DrainReason
    from offload.autoscale.providers import Provider

Listings = dict[str, tuple[bool, list[Machine]]]  # provider -> (the listing answered, its machines), per tick


@dataclass
class Evaluation:
    """What one evaluation of one queue reads. `instances` are the queue's billed (live) machines; a rental
    appends to it, so the spend cap and max_workers see it within the same evaluation."""

    queue: str
    cfg: AutoscaleSettings
    state: QueueState
    instances: list[Instance]
    now: float  # seconds, the job store's clock
    listings: Listings  # shared by every queue evaluated in one tick: each provider is listed once
    source: str = "offload.yaml"  # where the queue's block came from: "offload.yaml" or "api"
    run_s: float = 0.0  # the queue's expected run time, seconds, once its overflow sizing read it (0: not read)


@dataclass
class Choice:
    """Which providers may rent now, in which order, and why (shown by `offload autoscale status`)."""

    order: list[Provider] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    quotes: dict[str, float | None] = field(default_factory=dict)
    why: str = ""

    def explain(self) -> dict[str, Any]:
        return {"order": [p.name for p in self.order], "skipped": self.skipped, "quotes": self.quotes, "why": self.why}


@dataclass
class ScaleDownOutcome:
    """What scale-down did: why it drained, above which floor, how many, and what it spared (id -> why)."""

    reason: DrainReason
    floor: int
    draining: int
    spared: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "floor": self.floor, "draining": self.draining, "spared": self.spared}


@dataclass
class Decision:
    """What one evaluation decided and why. `to_dict` is the stored form; its keys keep the order in which an
    evaluation sets them, `held` where it was first set."""

    at: float
    enabled: bool
    active: int
    billed: int
    draining: int
    pending: int
    in_flight: int
    live_workers: int
    reasons: list[str]
    desired: int | None = None  # set with `floor` once the trigger count is final
    floor: int = 0
    undrained: int = 0  # drains cancelled because load came back
    held: str = ""  # what keeps the count from being reached
    provider: Choice | None = None
    rented: list[str] = field(default_factory=list)  # one provider name per rental started
    scale_down: ScaleDownOutcome | None = None
    _held_at: int = field(default=0, repr=False)

    def hold(self, why: str) -> None:
        if not self.held:
            self._held_at = len(self._parts())
        self.held = why

    def _parts(self) -> list[tuple[str, Any]]:
        parts: list[tuple[str, Any]] = [
            ("at", self.at),
            ("enabled", self.enabled),
            ("active", self.active),
            ("billed", self.billed),
            ("draining", self.draining),
            ("pending", self.pending),
            ("in_flight", self.in_flight),
            ("live_workers", self.live_workers),
            ("reasons", self.reasons),
        ]
        if self.desired is not None:
            parts += [("desired", self.desired), ("floor", self.floor)]
        if self.undrained:
            parts.append(("undrained", self.undrained))
        if self.provider is not None:
            parts.append(("provider", self.provider.explain()))
        if self.rented:
            parts.append(("rented", self.rented))
        return parts

    def to_dict(self) -> dict[str, Any]:
        parts = self._parts()
        if self.held:
            parts.insert(self._held_at, ("held", self.held))
        if self.scale_down is not None:
            parts.append(("scale_down", self.scale_down.to_dict()))
        return dict(parts)
