"""A 404 for a remote job nobody has seen yet: the provider's status lagging its submit, not the job's expiry.

Some providers answer a status read with 404 for a while after they accepted the submit (an eventually consistent
status store, a queue in front of it). Read as expiry, that 404 would end the attempt and pay for a new run, again
and again while the lag lasts. So a 404 means expiry only once a poll has found the remote job, or once the grace
(`not_found_grace_s`, at most `poll_timeout`) after its submit has passed. The worker that submitted (or adopted
the job from a listing or a webhook, which a status read may lag too) knows both in memory; a worker that resumes
the job (its first owner stopped or died) has not seen it, and measures the grace from the submit time the job
store recorded, by the store's clock (so no two machines' clocks are compared). A grace too long only delays
noticing a remote job that really vanished before anyone polled it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Sighting:
    """What this worker knows of one remote job's existence. `until`: the monotonic end of the grace, None while
    it is not known (a resumed job: `lagging` asks the store once)."""

    grace_s: float
    seen: bool = False
    until: float | None = None

    def submitted(self) -> None:
        """This worker has just submitted (or adopted) the remote job: the grace runs from now."""
        self.seen, self.until = False, time.monotonic() + self.grace_s

    async def lagging(self, age_ms: Callable[[], Awaitable[int | None]]) -> bool:
        """Whether a 404 now is the status lagging the submit (poll again) rather than the job gone. `age_ms`:
        how long ago the store recorded the submission (None: it does not say, and the grace runs from now)."""
        if self.seen:
            return False
        if self.until is None:
            age = await age_ms()
            self.until = time.monotonic() + self.grace_s - max(age or 0, 0) / 1000
        return time.monotonic() < self.until
