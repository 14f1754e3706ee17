"""The rules that keep the autoscaler from leaking machines or killing work, as small pure functions and
constants, so each can be tested on its own and read in one place.

- never destroy a worker that is busy, touched a task in the last 30 s, or is protected (`spared`);
- provisioning failures back off poll x 2^n, capped at 10 min (`provision_backoff`);
- boot failures are judged per host: a machine that never got a ready worker within boot_timeout, or whose host
  could not start the container, has its host avoided for 24 h. One failing host does not pause the queue
  (others boot the same image); failures on n > 1 distinct hosts since the last healthy boot (within 24 h) do,
  as the image is then probably broken: the next rental waits boot_timeout x 2^(n-2) up to 1 h after boot
  timeouts (`boot_backoff`), 30 s doubling to 10 min after hosts that could not start it (`host_pause`). The
  first worker that becomes ready resets both (`QueueState.booted`);
- a running instance whose heartbeats stopped for `autoscaler.heartbeat_timeout` (5 min by default) is destroyed
  (the reconcile loop applies it; the setting lives in offload.autoscale.settings).
"""

from __future__ import annotations

from offload.autoscale.instances import Instance
from offload.backoff import compute_backoff

RECENT_TASK = 30.0
PROVISION_BACKOFF_CAP = 600.0
BOOT_BACKOFF_CAP = 3600.0
HOST_AVOID = 86_400.0
HOST_PAUSE_BASE = 30.0
HOST_PAUSE_CAP = 600.0
# Distinct failing hosts since the last healthy boot before the queue pauses: 2 for what the queue has not seen
# boot within a day (a broken image costs two boots), 3 for what booted healthy within a day, where failures are
# far more likely its hosts' (docs/benchmarks-cost.md, faulty-week: 2 paused a healthy fleet for hours).
# What booted healthy within a day also needs most of its recent boots to have failed: a run of failing hosts
# among healthy ones is bad luck (5 in a row at 15 % of hosts failing, once in the faulty week), not the image.
HOSTS_FOR_PAUSE = 2
HOSTS_FOR_PAUSE_KNOWN_GOOD = 3
BOOTS_WINDOW = 10
FAILED_OF_WINDOW = 6
BOOT_HOLD_FACTOR = 2.0  # a booting machine holds queue_depth/latency for this many measured boot times
PROVISION_GRACE = 120.0  # a provisioning record with no machine id: wait this long for it to show at the provider
TEARDOWN_ALERT_AFTER = 3  # failed destroy calls of one machine before an alert (it may still bill)


def spared(inst: Instance, now: float, recent: float = RECENT_TASK) -> str | None:
    """Why this instance must not be scaled down now, or None if it may be drained."""
    if inst.protected:
        return "protected"
    if inst.in_flight > 0:
        return "busy"
    if inst.last_task_at and now - inst.last_task_at < recent:
        return f"touched a task in the last {recent:.0f}s"
    return None


def provision_backoff(poll_interval: float, failures: int) -> float:
    return float(compute_backoff(max(failures, 0) + 1, base=poll_interval, cap=PROVISION_BACKOFF_CAP))


def boot_backoff(boot_timeout: float, failures: int) -> float:
    return float(compute_backoff(failures, base=boot_timeout, cap=BOOT_BACKOFF_CAP))


def host_pause(failures: int) -> float:
    return float(compute_backoff(failures, base=HOST_PAUSE_BASE, cap=HOST_PAUSE_CAP))


def boot_hold(boot_ewma: float, boot_timeout: float) -> float:
    """Seconds a booting machine holds the queue_depth and latency triggers: BOOT_HOLD_FACTOR times the queue's
    measured boot time (until one is measured, boot_timeout). Past it the machine is presumed stuck and the
    triggers may rent beside it; boot_timeout still judges (and destroys) it."""
    return min(boot_timeout, BOOT_HOLD_FACTOR * boot_ewma) if boot_ewma > 0 else boot_timeout
