"""A 404 for a remote job nobody has seen yet: the provider's status lagging its submit, not the job's expiry.

Some providers answer a status read with 404 for a while after they accepted the submit (an eventually consistent
status store, a queue in front of it). Read as expiry, that 404 would end the attempt and pay for a new run, again
and again while the lag lasts. So a 404 means expiry only once a poll has found the remote job, or once the grace
(`not_found_grace_s`, at most `poll_timeout`) after its submit has passed. The worker that submitted (or adopted
the job from a listing or a webhook, which a status read may lag too) knows both in memory; a worker that resumes
the job (its first owner stopped or died) has not seen it, and gives it a whole grace from its own first 404, on
its own monotonic clock. It does not shorten the grace by the submit time the store recorded: a step of the
store's clock between the submit and the resume would make that look old, the 404 read as expiry, and the job
paid twice. A grace too long only delays noticing a remote job that really vanished before anyone polled it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Sighting:
    """What this worker knows of one remote job's existence. `until`: the monotonic end of the grace, None while
    it is not known (a resumed job: its first 404 starts it)."""

    grace_s: float
    seen: bool = False
    until: float | None = None

    def submitted(self) -> None:
        """This worker has just submitted (or adopted) the remote job: the grace runs from now."""
        self.seen, self.until = False, time.monotonic() + self.grace_s

    def lagging(self) -> bool:
        """Whether a 404 now is the status lagging the submit (poll again) rather than the job gone. A resumed
        job's grace starts at its first 404 here."""
        if self.seen:
            return False
        if self.until is None:
            self.until = time.monotonic() + self.grace_s
        return time.monotonic() < self.until
