"""Self-tests for the real-server helpers: if these fail, every fixture built on them lies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from support.servers import HOST, NAMED_REDIS_VAR, SLOT_RANGES, ValkeyCluster, ValkeyServer, closed_port, named_redis


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_aof_always_survives_sigkill(tmp_path: Path) -> None:
    with ValkeyServer(tmp_path, appendfsync="always") as server:
        port, pid = server.port, server.pid
        with redis.Redis.from_url(server.url) as c:
            c.set("k", "v")
        server.kill()
        assert not server.running
        server.restart()
        assert (server.port, server.running) == (port, True)
        assert server.pid != pid
        with redis.Redis.from_url(server.url) as c:
            assert c.get("k") == b"v"
    assert server.pid is None


def test_cluster_covers_all_slot_ranges(cluster: ValkeyCluster) -> None:
    rc = RedisCluster.from_url(cluster.url)
    try:
        keys: dict[int, str] = {}
        i = 0
        while len(keys) < len(SLOT_RANGES):
            slot = rc.keyslot(f"key{i}")
            rng = next(n for n, (lo, hi) in enumerate(SLOT_RANGES) if lo <= slot <= hi)
            keys.setdefault(rng, f"key{i}")
            i += 1
        for key in keys.values():
            assert rc.set(key, key)
            assert rc.get(key) == key.encode()
        assert len({rc.get_node_from_key(k).port for k in keys.values()}) == 3
        assert sorted(p for _, p in cluster.startup_nodes) == sorted(n.port for n in rc.get_nodes())
    finally:
        rc.close()


def test_cluster_eval_same_hash_tag(cluster: ValkeyCluster) -> None:
    rc = RedisCluster.from_url(cluster.url)
    try:
        script = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[2]);" \
                 " return redis.call('MGET', KEYS[1], KEYS[2])"  # fmt: skip
        assert rc.eval(script, 2, "{q}:a", "{q}:b", "1", "2") == [b"1", b"2"]
    finally:
        rc.close()


def test_no_redis_but_the_tests_own_unless_a_variable_names_one(
    valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NAMED_REDIS_VAR, raising=False)
    assert named_redis() is None
    monkeypatch.setenv(NAMED_REDIS_VAR, f"redis://{HOST}:{valkey.port}/9")
    assert named_redis(worker=2) == f"redis://{HOST}:{valkey.port}/7"  # one DB per xdist worker
    monkeypatch.setenv(NAMED_REDIS_VAR, f"redis://:hunter2@{HOST}:{closed_port()}/15")
    with pytest.raises(RuntimeError, match=f"{NAMED_REDIS_VAR}=redis://:\\*\\*\\*@.* does not answer") as e:
        named_redis()
    assert "hunter2" not in str(e.value)


def test_start_failure_reports_log(tmp_path: Path) -> None:
    server = ValkeyServer(tmp_path, appendfsync="bogus")
    with pytest.raises(RuntimeError, match="log tail"):
        server.start()
    assert not server.running
