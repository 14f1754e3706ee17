"""Redis keys of the autoscaler. All share the `{as}` hash tag, so the multi-key scripts (a fenced write checks
the leader key and changes an instance in one step) run on one node of a Redis/Valkey cluster too. The data is
small (instances, providers, per-queue counters), so one slot is plenty.
"""

from __future__ import annotations

from offload.queue.keyspace import NAMESPACE

P = f"{NAMESPACE}:{{as}}:"
LEADER = P + "leader"
FENCE = P + "fence"
PROVIDERS = P + "providers"
LIVE = P + "live"  # instance ids not yet finished (status not final, or teardown not confirmed)
ALL = P + "all"  # every instance id, scored by creation time (ms), for status and history
EVENTS = P + "events"
QUEUE_CONFIGS = P + "cfgs"  # queues with an autoscale block set through the API
DECIDED = P + "decided"  # queues the autoscaler has evaluated (each has a `why:<queue>` record)
CREDENTIALS = P + "creds"  # names of the vault credentials (private git repositories)


def provider(name: str) -> str:
    return P + f"provider:{name}"


def instance(instance_id: str) -> str:
    return P + f"inst:{instance_id}"


def queue_state(queue: str) -> str:
    return P + f"q:{queue}"


def queue_config(queue: str) -> str:
    return P + f"cfg:{queue}"


def decision(queue: str) -> str:
    """The queue's last evaluation: desired count, the triggers behind it, backoffs, the provider chosen."""
    return P + f"why:{queue}"


def credential(name: str) -> str:
    return P + f"cred:{name}"


def credential_host(name: str) -> str:
    """The git host a vault credential is bound to (plain text; it is also the credential's sealed context)."""
    return P + f"credhost:{name}"


def avoid(provider_name: str) -> str:
    return P + f"avoid:{provider_name}"


def failed_hosts(queue: str) -> str:
    """Hosts on which the queue's machines failed to boot since its last healthy boot (zset, scored by time)."""
    return P + f"failedhosts:{queue}"


def boot_outcomes(queue: str) -> str:
    """The queue's last boot outcomes, newest first ("1" healthy, "0" failed; a list trimmed to a window)."""
    return P + f"boots:{queue}"


def cost(queue: str, period: str) -> str:
    return P + f"cost:{queue}:{period}"


def alert(kind: str, subject: str) -> str:
    return P + f"alert:{kind}:{subject}"


def machines(provider_type: str, provider_name: str) -> str:
    """The mock and local providers' own records of what they 'rented'."""
    return P + f"{provider_type}:{provider_name}"


def mock_faults(provider_name: str) -> str:
    """How many of each scripted fault the mock provider has injected so far (hash)."""
    return machines("mock", provider_name) + ":faults"
