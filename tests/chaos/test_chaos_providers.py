"""The two-provider profile (`python -m bench.chaos --providers 2`, bench/chaos/providers.py): the routed queue it
configures is a valid offload.yaml, and its "paid at both providers" tells one submission created at both (a
defect) from a job's next submission elsewhere (as on one provider). The whole run is measured in the closing note
of issue 39; with the worker's cross-provider pin disabled a `--quick` run paid 18 submissions at both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.chaos import providers
from bench.chaos.faults import Profile
from bench.chaos.run import worker_config
from offload.config import load_settings


class _S3:
    def settings(self) -> dict[str, Any]:
        return {"kind": "local", "path": "/tmp/chaos-results"}


def test_the_routed_queue_it_writes_is_valid_offload_yaml(tmp_path: Path) -> None:
    path = worker_config(tmp_path / "w.yaml", "redis://h:1", _S3(), "http://h:2", "http-job", Profile(), None, 2)  # type: ignore[arg-type]
    settings = load_settings(path, env={})
    main = settings.queue("chaos")
    assert main.route_backends == ["sim", "sim2"] and main.backend is None
    assert [b.kind for _, b in settings.backends_for("chaos")] == ["http-job", "runpod"]
    assert settings.queue("capped").route_backends == ["sim"]
    assert yaml.safe_load(path.read_text())["backends"]["sim2"]["endpoint_id"] == "chaos"


def sub(input_id: str, family: str, key: str, replay: bool = False) -> dict[str, Any]:
    return {"input_id": input_id, "family": family, "idempotency_key": key, "replay": replay}


def test_paid_at_both_counts_one_submission_created_at_both_providers() -> None:
    records = {
        "chaos:1": {"state": "succeeded", "backend": "sim2"},
        "chaos:2": {"state": "succeeded", "backend": "sim"},
    }
    submissions = [
        sub("a", "jobs", "chaos:a.1"),  # a: submission 1 created at both (a try of unknown outcome moved): defect
        sub("a", "runpod", "chaos:a.1"),
        sub("b", "jobs", "chaos:b.1"),  # b: its run ended (a new number), the next one elsewhere: a new run
        sub("b", "runpod", "chaos:b.2"),
        sub("c", "jobs", "chaos:c.1"),  # c: a replay at the same provider is no payment
        sub("c", "jobs", "chaos:c.1", replay=True),
    ]
    got = providers.summary(records, submissions, "chaos")
    assert got["paid_at_both"] == 1 and got["paid_at_both_examples"] == ["chaos:a.1"]
    assert got["moved_after_remote_end"] == 1
    assert got["jobs_per_backend"] == {"sim2": 1, "sim": 1} and got["moved_share"] == 0.5


def test_a_synchronous_backend_or_webhooks_are_refused_at_once() -> None:
    with pytest.raises(SystemExit, match="--providers 2"):
        providers.check("openai", 2, False)
    with pytest.raises(SystemExit, match="--providers 2"):
        providers.check("replicate", 2, True)
    providers.check("openai", 1, False)
