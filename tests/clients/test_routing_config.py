"""Issue 39, item 1: a routed queue's configuration (`backends`, `route`, `weights`, `inputs`, `health`), checked
at start with every problem at once, each naming its field; the single-`backend` queue unchanged. (Before:
`backends` was an unknown key.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from offload.config import load_settings, problems
from offload.errors import ConfigError

BACKENDS = {
    "a": {"kind": "http-job", "base_url": "http://a.example", "price_per_job": 0.02},
    "b": {"kind": "runpod", "endpoint_id": "x", "price_per_second": 0.001},
}


def write(tmp_path: Path, queue: dict[str, Any]) -> Path:
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump({"backends": BACKENDS, "queues": {"q": queue}}))
    return path


def to_upper(job_input: Any) -> Any:
    return str(job_input).upper()


def test_a_routed_queue_is_read_with_its_route_weights_inputs_and_health(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "backends": ["a", "b"],
            "route": "weighted",
            "weights": {"a": 3, "b": 1},
            "inputs": {"b": "test_routing_config:to_upper"},
            "health": {"failures": 2, "cool_down_s": 5},
        },
    )
    settings = load_settings(path, env={})
    q = settings.queue("q")
    assert q.route_backends == ["a", "b"] and q.dispatched and q.route == "weighted"
    assert [name for name, _ in settings.backends_for("q")] == ["a", "b"]
    assert settings.input_maps("q")["b"]("x") == "X"
    assert (q.health.failures, q.health.window_s, q.health.cool_down_s) == (2, 60.0, 5.0)


def test_a_single_backend_queue_is_unchanged(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, {"backend": "a"}), env={})
    assert settings.queue("q").route_backends == ["a"] and settings.backend_for("q")[0] == "a"


def test_every_problem_of_a_routed_queue_is_reported_naming_its_field(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "backend": "a",
            "backends": ["a", "bb", "a"],
            "weights": {"a": 1, "c": 2},
            "inputs": {"a": "no_such_module_xyz:f", "c": "nocolon"},
            "health": {"cool_down_s": 60, "max_cool_down_s": 10},
        },
    )
    found = [str(p) for p in problems(path, env={})]
    expected = [
        "queues.q.backends: set either backend (one) or backends (several), not both",
        "queues.q.backends: no backend named 'bb' is configured",
        "queues.q.backends: each backend may be named once",
        "queues.q.weights: only read with route: weighted (route is fallback)",
        "queues.q.weights.c: not one of the queue's backends",
        "queues.q.inputs.a: cannot import 'no_such_module_xyz'",
        "queues.q.inputs.c: not one of the queue's backends",
        "queues.q.inputs.c: must look like module:function",
        "queues.q.health.max_cool_down_s: must be at least cool_down_s",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in found), (start, found)
    with pytest.raises(ConfigError, match=r"queues\.q\.backends"):
        load_settings(path, env={})


@pytest.mark.parametrize(
    ("queue", "message"),
    [
        ({"backends": ["a", "b"], "route": "weighted"}, "queues.q.weights: required with route: weighted"),
        ({"backends": ["a", "b"], "route": "weighted", "weights": {"a": 1}}, "queues.q.weights.b: missing"),
        ({"backends": ["a", "b"], "route": "weighted", "weights": {"a": 1, "b": 0}}, "greater than 0"),
        ({"backends": ["a", "b"], "route": "random"}, "queues.q.route"),
        ({"backends": []}, "queues.q.backends"),
    ],
)
def test_bad_route_settings_name_the_field(tmp_path: Path, queue: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_settings(write(tmp_path, queue), env={})


def test_a_spend_cap_on_a_routed_queue_reserves_its_dearest_backend(tmp_path: Path) -> None:
    settings = load_settings(
        write(tmp_path, {"backends": ["a", "b"], "daily_spend_cap": 10, "poll_timeout": 100}), env={}
    )
    limits = settings.cap_limits("q")
    assert limits is not None and limits.reserve == pytest.approx(0.1)  # b: 0.001/s x poll_timeout, over a's 0.02
