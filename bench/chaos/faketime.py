"""A process whose wall clock is off by what a file says, stepped while it runs: libfaketime (Debian's `faketime`
package) preloaded, reading the offset from `FAKETIME_TIMESTAMP_FILE` at every call (`FAKETIME_NO_CACHE`).

Only the wall clock is faked (`FAKETIME_DONT_FAKE_MONOTONIC`): timers and timeouts keep the true monotonic clock,
as an NTP step or a restored VM leaves them. The fault harness runs its Valkey under one (to step the store's
clock back and forth, and to roll the capped queue's day) and restarts worker slots under a skewed one; the tests
do the same (tests/support/servers.py). libfaketime and jemalloc do not mix (libfaketime's start-up recursion through
jemalloc's clock_gettime kills the server at once), so `offload.local.embedded.server_env` keeps glibc's malloc for a
Valkey started under it.
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

PACKAGE_HINT = "install Debian's `faketime` package (apt-get install faketime, or `make faketime`)"
LIBRARY_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)


def library() -> str:
    """The path of libfaketime.so.1, or a RuntimeError naming the package to install."""
    for pattern in LIBRARY_GLOBS:
        if found := sorted(glob.glob(pattern)):
            return found[0]
    raise RuntimeError(f"libfaketime not found: {PACKAGE_HINT}")


class ClockFile:
    """The offset (seconds, may be negative) of every process started with `env()`, changed at any time."""

    def __init__(self, path: Path, offset_s: float = 0.0) -> None:
        self.path = path
        self.library = library()
        self.offset_s = 0.0
        self.history: list[tuple[float, float]] = []  # (when set, on the true clock; the offset from then)
        self.set(offset_s)

    def set(self, offset_s: float) -> None:
        """Every process on this file reads the new offset at its next clock call (a rename: never half a file)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(f"{offset_s:+.3f}\n")
        os.replace(tmp, self.path)
        self.offset_s = offset_s
        self.history.append((time.time(), offset_s))

    def step(self, by_s: float) -> None:
        self.set(self.offset_s + by_s)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with libfaketime preloaded on this file."""
        env = dict(os.environ if base is None else base)
        env["LD_PRELOAD"] = " ".join(filter(None, (self.library, env.get("LD_PRELOAD", ""))))
        env.update(
            FAKETIME_TIMESTAMP_FILE=str(self.path),
            FAKETIME_NO_CACHE="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        return env
