"""The systems compared: pinned versions, their venvs, and how each one's worker and producer are started."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
APPS = Path(__file__).resolve().parent / "apps"
VENVS = ROOT / ".bench-venvs"


@dataclass(frozen=True)
class System:
    name: str  # key in results and file names
    label: str  # what the tables call it
    app: str  # the script in apps/
    requirements: tuple[str, ...] = ()  # pinned; () = the project's own venv
    versions_of: tuple[str, ...] = ()  # distributions whose installed versions the report states
    worker: str = "work"  # the app's worker command
    setup: str = ""  # how its worker runs, for the method section
    knob: str = ""  # the concurrency setting used
    one_at_a_time: bool = False  # RQ: a worker process runs one job at a time, whatever the budget
    env: dict[str, str] = field(default_factory=dict)
    workloads: tuple[str, ...] = ("noop", "io", "gpu", "durability")

    @property
    def venv(self) -> Path | None:
        return VENVS / self.name if self.requirements else None

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python") if self.venv else sys.executable


OFFLOAD = System(
    "offload",
    "offload",
    "offload_app.py",
    worker="work-dispatch",
    versions_of=("offload", "redis"),
    setup="the dispatch worker (`offload.worker.dispatch.Worker`, unchanged) with an in-process backend for "
    "no-op and 50 ms jobs; the real `offload worker` process against the simulator for 30 s jobs and the "
    "SIGKILL test",
    knob="`--concurrency` (WorkerOptions.concurrency)",
)
OFFLOAD_STORE = System(
    "offload-store",
    "offload (QueueStore loop)",
    "offload_app.py",
    worker="work-store",
    versions_of=("offload", "redis"),
    workloads=("noop", "io"),
    setup="a lean asyncio loop over `QueueStore`: claim up to the free slots, acknowledge with `complete_many`",
    knob="jobs in flight of the loop",
)
PEERS = (
    System(
        "celery",
        "Celery",
        "celery_app.py",
        requirements=("celery[redis]==5.7.0", "kombu==5.7.0", "redis==8.1.0", "gevent==26.9.0"),
        versions_of=("celery", "kombu", "redis", "gevent"),
        setup="`worker --pool gevent --concurrency N`, one process, Redis broker, no result backend",
        knob="`--concurrency` of the gevent pool",
    ),
    System(
        "rq",
        "RQ",
        "rq_app.py",
        requirements=("rq==3.0.0", "redis==8.1.0"),
        versions_of=("rq", "redis"),
        setup="the default `Worker` (forks a work horse per job), one process",
        knob="none: one job at a time",
        one_at_a_time=True,
        env={"BENCH_SHARED_COUNTERS": "1"},
    ),
    System(
        "arq",
        "arq",
        "arq_app.py",
        requirements=("arq==0.28.0", "redis==5.3.1"),
        versions_of=("arq", "redis"),
        setup="`run_worker(WorkerSettings)`, one process",
        knob="`max_jobs`",
    ),
    System(
        "dramatiq",
        "Dramatiq",
        "dramatiq_app.py",
        requirements=("dramatiq[redis]==2.2.1", "redis==8.1.0"),
        versions_of=("dramatiq", "redis"),
        setup="`dramatiq --processes 1 --threads N`, Redis broker",
        knob="`--threads`",
    ),
    System(
        "taskiq",
        "taskiq",
        "taskiq_app.py",
        requirements=("taskiq==0.13.0", "taskiq-redis==1.2.4", "redis==8.1.0"),
        versions_of=("taskiq", "taskiq-redis", "redis"),
        setup="`taskiq worker --workers 1 --max-async-tasks N`, `RedisStreamBroker`",
        knob="`--max-async-tasks`",
    ),
    System(
        "saq",
        "SAQ",
        "saq_app.py",
        requirements=("saq[redis]==0.26.4", "redis==7.4.1", "typing_extensions==4.16.0"),
        versions_of=("saq", "redis"),
        setup="`Worker(queue, functions, concurrency=N).start()`, one process, Redis queue",
        knob="`concurrency`",
    ),
)
ALL = (OFFLOAD, OFFLOAD_STORE, *PEERS)
BY_NAME = {s.name: s for s in ALL}
# offload's (c) runs a second time with provider webhooks on (bench/peers/offload_hooks.py): a run of the
# offload system, reported under its own name beside the polling one.
OFFLOAD_WEBHOOKS = "offload-webhooks"
LABELS = {s.name: s.label for s in ALL} | {OFFLOAD_WEBHOOKS: "offload, webhooks"}


def venv_key(system: System, base: str) -> str:
    """What a system's venv is made from: its pinned requirements and the interpreter `base` (its real path), so a
    venv made by another interpreter is made again, never reused (a venv follows its interpreter's in-place
    upgrades by itself: it links to it)."""
    key = [sorted(system.requirements), os.path.realpath(base)]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def base_interpreter() -> str:
    """The interpreter running the benchmark, outside any venv: every system's venv is made from it."""
    return getattr(sys, "_base_executable", sys.executable)


def ensure_venv(system: System, log: Path) -> float:
    """Create or reuse the system's venv (keyed by its pinned requirements and the interpreter it is made from:
    every system runs on the interpreter that runs the benchmark); returns the seconds spent."""
    if system.venv is None:
        return 0.0
    stamp = system.venv / ".bench-requirements"
    base = base_interpreter()
    wanted = venv_key(system, base)
    if stamp.exists() and stamp.read_text() == wanted and Path(system.python).exists():
        return 0.0
    t0 = time.perf_counter()
    with log.open("ab") as out:
        subprocess.run([base, "-m", "venv", "--clear", str(system.venv)], check=True, stdout=out, stderr=out)
        subprocess.run(
            [system.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *system.requirements],
            check=True,
            stdout=out,
            stderr=out,
        )
    stamp.write_text(wanted)
    return time.perf_counter() - t0


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_versions(system: System) -> dict[str, str]:
    """Versions of the distributions the report names, as installed in the system's venv (read from its
    *.dist-info directories; the project's own from importlib.metadata)."""
    if system.venv is None:
        return {name: importlib.metadata.version(name) for name in system.versions_of}
    found: dict[str, str] = {}
    for info in system.venv.glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        found[_normal(name)] = version
    return {name: found.get(_normal(name), "?") for name in system.versions_of}
