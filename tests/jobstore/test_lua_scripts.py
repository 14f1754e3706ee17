"""Every Lua script is a file of offload/queue/lua with a header naming its KEYS, ARGV and reply, loaded by the one
loader (offload/queue/scripts.py) as a typed `Scripts` attribute that some code uses; no Lua left in Python.

And the loader's promises at run time: includes are put in once, a misspelt script name is a mypy error, and a
script still runs after the server forgot every script (a restart, SCRIPT FLUSH): NOSCRIPT reloads it.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest
from support.admin_redis import redis_admin

from offload.autoscale import keyspace as autoscale_keys
from offload.autoscale.leader import Leader
from offload.connection import connect
from offload.queue import keyspace as queue_keys
from offload.queue.backend_limits import BackendLimits
from offload.queue.scripts import INCLUDE, NAMES, SCRIPTS, Scripts, source
from offload.queue.specs import JobSpec
from offload.queue.store import QueueStore

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "offload"
LUA = PACKAGE / "queue" / "lua"
INCLUDES = LUA / "includes"
LOADER = PACKAGE / "queue" / "scripts.py"


def _header(text: str) -> list[str]:
    lines = text.split("\n")
    if lines[0].startswith("#!lua"):  # script flags (allow-oom) come first, then the header
        lines = lines[1:]
    head: list[str] = []
    for line in lines:
        if not line.startswith("--") or INCLUDE.match(line):
            break
        head.append(line)
    return head


def _scripts() -> list[Path]:
    return sorted(LUA.glob("*.lua"))


def test_every_script_file_is_a_typed_attribute_and_back() -> None:
    assert sorted(p.stem for p in _scripts()) == sorted(NAMES)
    assert set(NAMES) == set(Scripts.__annotations__)
    assert all(getattr(SCRIPTS, name).name == name for name in NAMES)


@pytest.mark.parametrize("path", _scripts(), ids=lambda p: p.stem)
def test_every_script_has_a_header_naming_keys_argv_and_reply(path: Path) -> None:
    head = _header(path.read_text())
    tags = [line.split(":", 1)[0] for line in head if re.match(r"-- (KEYS|ARGV|Returns):", line)]
    assert tags == ["-- KEYS", "-- ARGV", "-- Returns"], f"{path.name}: header lines {tags}"
    assert head[0].startswith("-- ") and not head[0].startswith("-- KEYS"), f"{path.name}: say what it does first"
    keys_doc = " ".join(line for line in head if line.startswith(("-- KEYS", "--   ")))
    body = "\n".join(path.read_text().split("\n")[len(head) :])
    for n in sorted(set(re.findall(r"KEYS\[(\d+)\]", body))):
        assert f"[{n}]" in keys_doc, f"{path.name} uses KEYS[{n}] without naming it in its header"


def test_includes_are_each_used_exist_and_go_in_once() -> None:
    included: set[str] = set()
    for path in [*_scripts(), *INCLUDES.glob("*.lua")]:
        for name in INCLUDE.findall(path.read_text()):
            assert (INCLUDES / f"{name}.lua").exists(), f"{path.name} includes missing {name!r}"
            included.add(name)
    assert sorted(p.stem for p in INCLUDES.glob("*.lua")) == sorted(included)
    for name in NAMES:
        text = source(name)
        assert "@include" not in text
        assert text.count("local function now_ms(") <= 1  # clock is included by many includes: once per script
        assert text.count("local function jkey(") <= 1
        assert "__EVENTS_MAX__" not in text and "__HIST_BUCKETS__" not in text
    assert source("claim").count("local function now_ms(") == 1  # claim, outages -> clock: put in once


# A Lua comment to the line's end, or a string literal: neither names a function or a constant.
_NOT_CODE = re.compile(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"")
_TOP_LEVEL = re.compile(r"^local (?:function (\w+)|([\w, ]+?) =)", re.MULTILINE)
_ANY_LOCAL = re.compile(r"\blocal (?:function (\w+)|([\w, ]+))|\bfunction\s*\w*\(([^)]*)\)|\bfor ([\w, ]+) in")
_NAME = re.compile(r"(?<![.:\w])[A-Za-z_]\w*")


def _names(groups: list[tuple[str, ...]]) -> set[str]:
    return {n.strip() for group in groups for part in group for n in part.split(",") if n.strip()}


def _include_problems(scripts: dict[str, str], includes: dict[str, str]) -> list[str]:
    """Each script and include names, in its own `@include` lines, the includes whose functions and constants it
    uses, and no other: a name used from an include it only gets through another include is reported, as is an
    include it uses nothing of. Names are matched outside comments and strings; a file's own locals shadow."""
    home: dict[str, str] = {}
    problems: list[str] = []
    for inc, text in includes.items():
        for name in _names(_TOP_LEVEL.findall(_NOT_CODE.sub("", text))):
            if name in home:
                problems.append(f"{name} is defined in both {home[name]}.lua and {inc}.lua")
            home[name] = inc
    files = {**{f"{n}.lua": t for n, t in scripts.items()}, **{f"includes/{n}.lua": t for n, t in includes.items()}}
    for label, text in files.items():
        direct = INCLUDE.findall(text)
        code = _NOT_CODE.sub("", INCLUDE.sub("", text))
        own = _names(_ANY_LOCAL.findall(code))
        used = {name for name in _NAME.findall(code) if name in home and name not in own}
        for name in sorted(used):
            if home[name] not in direct:
                problems.append(f"{label} uses {name} without including {home[name]!r}")
        for inc in direct:
            if not any(home[name] == inc for name in used):
                problems.append(f"{label} includes {inc!r} and uses nothing of it")
    return problems


def test_each_file_includes_what_it_uses_and_nothing_else() -> None:
    scripts = {p.stem: p.read_text() for p in _scripts()}
    includes = {p.stem: p.read_text() for p in INCLUDES.glob("*.lua")}
    assert _include_problems(scripts, includes) == []


def test_the_include_check_catches_a_missing_and_an_unused_include() -> None:
    includes = {
        "records": "-- keys\nlocal P = KEYS[1]\nlocal function jkey(id) return P .. 'job:' .. id end\n",
        "events": "--- @include \"records\"\nlocal function event(ids) redis.call('XADD', P .. 'events') end\n",
        "caps": '--- @include "records"\nlocal function cap_base(w) return P .. w end\n',
    }
    scripts = {
        "fine": '--- @include "records"\n--- @include "events"\nevent({jkey(ARGV[1])}) -- cap_base in a comment\n',
        "transitive": '--- @include "events"\nevent({jkey(ARGV[1])})\n',
        "unused": "--- @include \"records\"\n--- @include \"caps\"\nreturn redis.call('GET', P .. 'cap_base')\n",
        "shadowed": '--- @include "records"\nlocal function event(x) return x end\nreturn event(P)\n',
    }
    assert _include_problems(scripts, includes) == [
        "transitive.lua uses jkey without including 'records'",
        "unused.lua includes 'caps' and uses nothing of it",
    ]


def test_every_script_attribute_is_used_by_offload() -> None:
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p != LOADER)
    unused = [name for name in NAMES if not re.search(rf"\bSCRIPTS\.{name}\b", code)]
    assert unused == []


def _inline_lua(root: Path, loader: Path | None) -> list[str]:
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if path == loader:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call(" in node.value:
                found.append(f"{path.name}:{node.lineno}: Lua source in Python")
            if isinstance(node, ast.Attribute) and node.attr in ("register_script", "eval", "script_load"):
                found.append(f"{path.name}:{node.lineno}: .{node.attr} outside the loader")
    return found


def test_no_lua_in_python_and_no_second_loader() -> None:
    """Bulk enqueue pipelines EVALSHA with the loader's sha and `Script.load` (allowed): no other way to run Lua."""
    assert _inline_lua(PACKAGE, LOADER) == []


def test_the_inline_check_catches_what_main_had(tmp_path: Path) -> None:
    (tmp_path / "leader.py").write_text(
        textwrap.dedent('''
        _RELEASE = """
        local cur = redis.call('GET', KEYS[1])
        """
        def setup(redis):
            return redis.register_script(_RELEASE)
        async def fail(redis):
            return await redis.eval("return 1", 0)
        ''')
    )
    assert len(_inline_lua(tmp_path, None)) == 3


def test_a_misspelt_script_is_a_type_error(tmp_path: Path) -> None:
    """Scripts used __getattr__ before: `SCRIPTS.claimm` type-checked and failed only when run."""
    from mypy import api

    snippet = tmp_path / "typo.py"
    snippet.write_text("from offload.queue.scripts import SCRIPTS\n\nSCRIPTS.claim\nSCRIPTS.claimm\n")
    out, _, status = api.run(
        [str(snippet), "--strict", "--follow-imports=silent", "--cache-dir", str(ROOT / ".mypy_cache")]
    )
    assert status == 1
    assert '"Scripts" has no attribute "claimm"' in out
    assert out.count("error:") == 1, out
    with pytest.raises(AttributeError):
        SCRIPTS.claimm  # type: ignore[attr-defined]  # noqa: B018


async def test_moved_scripts_run_again_after_the_server_forgets_them(valkey_url: str) -> None:
    """A restarted Redis has no scripts: each moved script (leader lock, rate limit, cool-down, auth guard,
    alert once) answers by EVAL after NOSCRIPT, with the same result as before the flush. On the suite's own
    Valkey: SCRIPT FLUSH is server-wide, and the system Redis is shared."""
    redis = await connect(valkey_url)
    try:
        leader = Leader(redis, ttl=30, owner="me")
        assert await leader.acquire()
        first = leader.token
        await redis_admin(redis).script_flush()
        assert await leader.acquire() and leader.token == first  # a renewal keeps the fencing token
        other = Leader(redis, ttl=30, owner="other")
        await redis_admin(redis).script_flush()
        assert not await other.acquire()  # an unexpired lock of another owner stays
        await leader.release()
        assert await redis.get(autoscale_keys.LEADER) is None

        limits = BackendLimits(redis, "flushtest", rate_per_s=1000, burst=1)
        await redis_admin(redis).script_flush()
        await limits.acquire()
        assert await redis.exists(queue_keys.backend_rate("flushtest")) == 1
        await redis_admin(redis).script_flush()
        assert await SCRIPTS.cool_down(redis, [queue_keys.backend_cooldown("flushtest")], [5000]) > 4000
        assert await SCRIPTS.cool_down(redis, [queue_keys.backend_cooldown("flushtest")], [10]) > 4000

        key = queue_keys.auth_failures("192.0.2.1")
        await redis_admin(redis).script_flush()
        counts = [await SCRIPTS.auth_fail(redis, [key], [60_000]) for _ in range(3)]
        assert [n for n, _ in counts] == [1, 2, 3] and all(0 < left <= 60_000 for _, left in counts)
        assert 0 < await redis.pttl(key) <= 60_000

        alert = autoscale_keys.alert("test", "flush")
        await redis_admin(redis).script_flush()
        assert await SCRIPTS.alert_once(redis, [alert], [repr(1000.0), 60]) == 1
        assert await SCRIPTS.alert_once(redis, [alert], [repr(1030.0), 60]) == 0
        assert await SCRIPTS.alert_once(redis, [alert], [repr(1061.0), 60]) == 1

        store = QueueStore(redis)
        await redis_admin(redis).script_flush()
        [job_id] = await store.enqueue_many("flushq", [JobSpec(input={"n": 1})])
        assert (await store.get(job_id)).state == "queued"
    finally:
        await redis.aclose()


async def test_a_garbled_leader_lock_is_taken_over_not_an_error_forever(valkey_url: str) -> None:
    """A lock value not in the owner|token|expiry form (a hand edit, a restore from an old dump) made the acquire
    script compare nil with a number: every acquire failed with a script error, so no server could ever lead
    again. Now the value parses to nothing: nobody holds it, the next acquire takes it, and a fenced instance
    write checked against it is refused, never applied."""
    from offload.autoscale.instances import Fenced, Instance, InstanceStore

    redis = await connect(valkey_url)
    try:
        await redis.set(autoscale_keys.LEADER, "garbage")
        store = InstanceStore(redis)
        inst = Instance(id="i-1", queue="gpu", provider="mock", status="provisioning", created_at=1.0)
        with pytest.raises(Fenced):
            await store.create(inst, fence="1")
        assert await redis.exists(autoscale_keys.instance("i-1")) == 0
        other = Leader(redis, ttl=30, owner="other")
        await other.release()  # not its lock: nothing happens
        assert await redis.get(autoscale_keys.LEADER) == "garbage"
        leader = Leader(redis, ttl=30, owner="me")
        assert await leader.acquire()
        await leader.check()
        await store.create(inst, fence=leader.token)
        assert await redis.hget(autoscale_keys.instance("i-1"), "status") == "provisioning"
    finally:
        await redis.aclose()
