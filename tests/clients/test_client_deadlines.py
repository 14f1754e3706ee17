"""deadline and max_cost through the Python client and the CLI: accepted in each form each face takes (epoch
seconds, a datetime, a timedelta; a duration or an ISO time on the command line) and shown on the record; a bad
value is one error line."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from test_cli import as_json, cli, failed, ok, with_store

from offload import Client, InvalidJob


def test_the_client_takes_epoch_seconds_a_datetime_or_a_timedelta(valkey_url: str) -> None:
    at = int(time.time()) + 3600
    with Client(valkey_url) as client:
        by_epoch = client.get(client.enqueue("dl", 1, deadline=at, max_cost=0.25))
        by_date = client.get(client.enqueue("dl", 2, deadline=datetime.fromtimestamp(at, UTC)))
        by_delta = client.get(client.enqueue("dl", 3, deadline=timedelta(minutes=10)))
        (bulk,) = client.enqueue_many("dl", [{"input": 4, "deadline_in": 60, "max_cost": 1}])
        with pytest.raises(InvalidJob, match=r"^deadline .* is in the past"):
            client.enqueue("dl", 5, deadline=datetime(2020, 1, 1, tzinfo=UTC))
        with pytest.raises(InvalidJob, match=r"^max_cost must be a number >= 0"):
            client.enqueue("dl", 6, max_cost=-1)
        assert (by_epoch.deadline, by_epoch.max_cost) == (at * 1000, 0.25)
        assert by_date.deadline == at * 1000
        assert by_delta.deadline == by_delta.created_at + 600_000  # from enqueue, on the store's clock
        assert client.get(bulk).max_cost == 1.0
        assert client.stats("dl").counts["queued"] == 4


def test_the_cli_takes_a_duration_or_an_iso_time(valkey_url: str) -> None:
    relative = ok(valkey_url, "enqueue", "-q", "dl", "-i", "1", "--deadline", "2h", "--max-cost", "0.05").strip()
    record = as_json(valkey_url, "status", relative)
    assert record["deadline"] - record["created_at"] == 7_200_000 and record["max_cost"] == 0.05
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)
    absolute = ok(valkey_url, "enqueue", "-q", "dl", "-i", "2", "--deadline", at.isoformat().replace("+00:00", "Z"))
    assert as_json(valkey_url, "status", absolute.strip())["deadline"] == int(at.timestamp()) * 1000
    assert "deadline" in ok(valkey_url, "status", relative)


def test_a_lines_own_deadline_replaces_the_command_lines(valkey_url: str, tmp_path: Path) -> None:
    at = int(time.time()) + 86_400
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b"1\n" + orjson.dumps({"input": 2, "deadline": at, "max_cost": 0.5}) + b"\n")
    doc = as_json(valkey_url, "enqueue", "-q", "dl", "--file", str(path), "--deadline", "1h", "--max-cost", "0.1")
    first, second = (as_json(valkey_url, "status", i) for i in doc["ids"])
    assert first["deadline"] - first["created_at"] == 3_600_000 and first["max_cost"] == 0.1
    assert (second["deadline"], second["max_cost"]) == (at * 1000, 0.5)


def test_bad_values_are_one_error_line(valkey_url: str) -> None:
    result = cli(valkey_url, "enqueue", "-q", "dl", "-i", "1", "--deadline", "soon")
    assert result.exit_code == 2 and "--deadline" in result.stderr
    err = failed(cli(valkey_url, "enqueue", "-q", "dl", "-i", "1", "--deadline", "2020-01-01T00:00Z"))
    assert err.startswith("error: deadline ") and "in the past" in err
    err = failed(cli(valkey_url, "enqueue", "-q", "dl", "-i", "1", "--deadline", "10m", "--delay", "3600"))
    assert err.startswith("error: deadline_in 600s is not after the job's start")
    assert failed(cli(valkey_url, "enqueue", "-q", "dl", "-i", "1", "--max-cost", "-1"), code=2)
    assert with_store(valkey_url, lambda s: s.queues()) == []
