"""Key layout, queue-name rules and job ids.

Every key of a queue carries the queue's name as a Redis Cluster hash tag (`offload:{gpu}:ready`), so all
of a queue's atomic scripts run on one node of a cluster. Job ids embed their queue (`gpu:0192ab...`) so a
job can be found from its id alone without a cross-slot index.
"""

from __future__ import annotations

import hashlib
import os
import re
import time

from offload.errors import InvalidJob, InvalidQueueName

NAMESPACE = "offload"
QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
QUEUES_KEY = f"{NAMESPACE}:queues"

#: Sets a job can be listed from, by the state name users see.
STATE_SETS: dict[str, str] = {
    "queued": "ready",
    "delayed": "delayed",
    "retrying": "retry",
    "active": "active",
    "held": "held",
    "succeeded": "succeeded",
    "dead": "dead",
    "cancelled": "cancelled",
}


def validate_queue(name: str) -> str:
    """Reject names that would break key tags, URLs or S3 keys, naming the rule that failed."""
    if not isinstance(name, str) or not QUEUE_NAME_RE.match(name):
        raise InvalidQueueName(
            f"invalid queue name {name!r}: use 1-100 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    return name


def prefix(queue: str) -> str:
    """The key prefix every script receives as KEYS[1]."""
    return f"{NAMESPACE}:{{{queue}}}:"


def queue_of(job_id: str) -> str:
    """The queue a job id belongs to; raises InvalidJob for ids offload never issued."""
    queue, sep, rest = job_id.partition(":")
    if not sep or not rest or not QUEUE_NAME_RE.match(queue):
        raise InvalidJob(f"invalid job id {job_id!r}: expected '<queue>:<id>'")
    return queue


def new_job_id(queue: str) -> str:
    """Time-ordered, collision-resistant id: 48-bit ms timestamp + 64 random bits, hex."""
    return f"{queue}:{int(time.time() * 1000):012x}{os.urandom(8).hex()}"


def hooks_channel(queue: str, worker_id: str) -> str:
    """The pub/sub channel on which a dispatch worker hears of webhooks for the jobs it holds (hook.lua)."""
    return f"{prefix(queue)}hooks:{worker_id}"


def hook_digest(secret: str) -> str:
    """What a job record keeps of a webhook URL's secret (begin.lua), and what the server compares it with."""
    return hashlib.sha256(secret.encode()).hexdigest()
