"""Property-based fuzzing of the HTTP API from its own OpenAPI document (schemathesis), against a real server
over TCP with an admin key: whatever the input (valid by the schema, or deliberately not), the answer is never
a 5xx. Validation failures must come back as 4xx with a JSON body, so a 500 here is a bug in input handling.

schemathesis's pytest plugin does not load under this pytest, so each operation's strategy is driven by
hypothesis directly; the checks are schemathesis's own."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err, Ok
from support.server_helpers import server
from support.servers import ValkeyServer

pytestmark = pytest.mark.xdist_group("server-fuzz")

# Streams and long-polls answer slowly by design; their inputs are covered by test_server_api.py.
SKIPPED = ("/v1/events", "/wait", "/ui", "/metrics")
EXAMPLES = 12


def fuzz_operation(op: Any, headers: dict[str, str], calls: dict[str, int]) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        mode = data.draw(st.sampled_from([GenerationMode.POSITIVE, GenerationMode.NEGATIVE]))
        case = data.draw(op.as_strategy(generation_mode=mode))
        case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=30)
        calls[op.label] = calls.get(op.label, 0) + 1

    fuzz()


def test_no_input_makes_the_server_fail(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Valkey of its own: other tests' flushes must not move the ground under a fuzzing run."""
    with ValkeyServer(tmp_path_factory.mktemp("fuzz-valkey")) as valkey, server(valkey.url) as (url, admin):
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        results = list(schema.get_all_operations())
        operations = [r.ok() for r in results if isinstance(r, Ok)]
        assert len(operations) == len(results), [r.err() for r in results if isinstance(r, Err)]
        fuzzed = [op for op in operations if not any(part in op.path for part in SKIPPED)]
        assert len(fuzzed) >= 20, [op.label for op in operations]  # the API is there to fuzz
        headers = {"Authorization": f"Bearer {admin}"}
        calls: dict[str, int] = {}
        for op in fuzzed:
            fuzz_operation(op, headers, calls)
        assert all(calls.get(op.label, 0) >= 1 for op in fuzzed), calls
