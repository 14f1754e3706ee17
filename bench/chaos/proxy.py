"""A TCP fault proxy for Redis/Valkey (asyncio, loopback): what a flaky network does to a client, on purpose.

Clients connect to the proxy instead of the server. It forwards bytes both ways and frames them as RESP (both
directions, pipelines included), so it knows which reply answers which command. Faults:

- delay: every reply chunk waits `delay_s` (a slow link);
- drop reply: a chosen command is forwarded and executed, its reply is read from the server, and then the client
  connection is cut (RST) instead of forwarding it: the client sees a lost reply for a command that ran, which is
  exactly when a client library's automatic retry replays a script;
- reset: every open connection is cut with an RST;
- black-hole: for N seconds nothing moves in either direction and new connections hang (a partition that heals:
  what was sent is delivered afterwards, unless the client gave up).

Faults are chosen at random with a seed (`drop_rate` per command) or on a schedule (`drop_next`, `reset_all`,
`blackhole`). Every dropped reply is recorded with the command (scripts named by their SHA when the caller
provides the names) and the job ids found in the command and in the lost reply, so a checker can tie a later
anomaly to the lost reply that caused it.

Standalone: `python -m bench.chaos.proxy --listen 127.0.0.1:7000 --upstream 127.0.0.1:6379 --drop-rate 0.001
--delay-ms 2 --reset-every 30 --blackhole-every 60 --blackhole-s 3 --seed 1` (Ctrl+C prints the counts as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from offload.eventloop import within

CRLF = b"\r\n"
JOB_ID = re.compile(rb"[A-Za-z0-9_.\-]+:[0-9a-f]{28}")
MAX_IDS = 2000  # job ids kept per dropped reply (a claim reply can hold thousands)
CHUNK = 256 * 1024


class RespError(ValueError):
    """Bytes that are not RESP: the proxy stops framing that connection (and forwards blindly)."""


def _line_end(buf: bytes | bytearray, pos: int) -> int | None:
    end = buf.find(CRLF, pos)
    return None if end < 0 else end


def message_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """The index just past one complete RESP2/RESP3 message starting at `pos`, or None if more bytes are needed.
    Inline commands (a plain text line) count as one message."""
    stack = [1]  # elements still to read at each nesting level
    while stack:
        if pos >= len(buf):
            return None
        kind = buf[pos : pos + 1]
        end = _line_end(buf, pos)
        if end is None:
            return None
        stack[-1] -= 1
        if kind in b"$!=" and kind:
            size = int(buf[pos + 1 : end])
            pos = end + 2 if size < 0 else end + 2 + size + 2
            if size >= 0 and pos > len(buf):
                return None
        elif kind in b"*~>%|" and kind:
            count = int(buf[pos + 1 : end])
            pos = end + 2
            if kind in b"%|":
                count *= 2
            if kind == b"|":
                count += 1  # an attribute map is followed by the message it annotates
            if count > 0:
                stack.append(count)
        else:  # + - : _ , # ( and inline commands: one line
            pos = end + 2
        while stack and stack[-1] == 0:
            stack.pop()
    return pos


def split_messages(buf: bytearray) -> list[bytes]:
    """Remove and return every complete message at the start of `buf` (the partial tail stays)."""
    out: list[bytes] = []
    pos = 0
    while pos < len(buf):
        try:
            end = message_end(buf, pos)
        except ValueError as exc:
            raise RespError(str(exc)) from None
        if end is None:
            break
        out.append(bytes(buf[pos:end]))
        pos = end
    del buf[:pos]
    return out


def command_words(message: bytes, n: int = 2) -> list[str]:
    """The first `n` words of a command (name, first argument), upper-casing the name."""
    if not message.startswith(b"*"):
        return [w.decode(errors="replace") for w in message.split()[:n]]
    words: list[str] = []
    pos = message.find(CRLF) + 2
    while len(words) < n and pos < len(message) and message[pos : pos + 1] == b"$":
        end = message.find(CRLF, pos)
        size = int(message[pos + 1 : end])
        words.append(message[end + 2 : end + 2 + size].decode(errors="replace"))
        pos = end + 2 + size + 2
    if words:
        words[0] = words[0].upper()
    return words


@dataclass
class DroppedReply:
    """A command that ran on the server whose reply the client never got."""

    at: float
    command: str
    job_ids: list[str]
    client: str


@dataclass
class _Pending:
    command: bytes
    drop: bool


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    pending: deque[_Pending] = field(default_factory=deque)
    framing: bool = True


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped connection looks to the peer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """One listening port in front of one Redis/Valkey. All settings may change while it runs."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        seed: int | None = None,
        script_names: dict[str, str] | None = None,
        drop_rate: float = 0.0,
        delay_s: float = 0.0,
        drop_commands: Iterable[str] | None = None,
    ) -> None:
        self.upstream = upstream
        self.listen = listen
        self.rng = random.Random(seed)
        self.script_names = {sha.lower(): name for sha, name in (script_names or {}).items()}
        self.drop_rate = drop_rate
        self.delay_s = delay_s
        self.drop_commands = {c.upper() for c in drop_commands} if drop_commands else None
        self.counts: Counter[str] = Counter()
        self.dropped: list[DroppedReply] = []
        self.faults: list[tuple[float, str, float]] = []  # (time, kind, seconds) of resets and black-holes
        self._drop_next = 0
        self._open = asyncio.Event()
        self._open.set()
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self._reopen: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "proxy not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://{self.listen[0]}:{self.port}/0"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._handle, *self.listen, limit=CHUNK, backlog=1024)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset_all(record=False)
        self._open.set()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await within(self._server.wait_closed(), 5)

    # -- faults on a schedule ----------------------------------------------------------------------

    def drop_next(self, n: int = 1, commands: Iterable[str] | None = None) -> None:
        """Drop the replies of the next `n` commands (of these names, when given)."""
        self._drop_next += n
        if commands is not None:
            self.drop_commands = {c.upper() for c in commands}

    def reset_all(self, *, record: bool = True) -> int:
        """Cut every open connection with an RST; returns how many."""
        conns = list(self._conns)
        for conn in conns:
            self._cut(conn)
        if record:
            self.counts["resets"] += 1
            self.counts["connections_reset"] += len(conns)
            self.faults.append((time.time(), "reset", 0.0))
        return len(conns)

    def blackhole(self, seconds: float) -> None:
        """Nothing moves for `seconds` (starting now; a second call extends to the later end)."""
        loop = asyncio.get_running_loop()
        self._open.clear()
        self.counts["blackholes"] += 1
        self.faults.append((time.time(), "blackhole", seconds))
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = loop.call_later(seconds, self._open.set)

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    # -- forwarding --------------------------------------------------------------------------------

    def _cut(self, conn: _Conn) -> None:
        _rst(conn.client)
        if conn.upstream is not None:
            conn.upstream.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self._conns.add(conn)
        self.counts["connections"] += 1
        try:
            await self._open.wait()
            try:
                up_reader, up_writer = await within(asyncio.open_connection(*self.upstream, limit=CHUNK), 5)
            except (OSError, TimeoutError):
                self.counts["upstream_unreachable"] += 1
                _rst(writer)
                return
            conn.upstream = up_writer
            pumps = [
                asyncio.create_task(self._to_server(conn, reader, up_writer)),
                asyncio.create_task(self._to_client(conn, up_reader, writer)),
            ]
            _, rest = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in rest:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # the proxy is closing; a cancelled connection task would only be logged as an error
        finally:
            self._conns.discard(conn)
            self._cut(conn)

    def _should_drop(self, words: list[str]) -> bool:
        name = words[0] if words else ""
        if self.drop_commands is not None and name not in self.drop_commands:
            return False
        if self._drop_next > 0:
            self._drop_next -= 1
            return True
        return self.drop_rate > 0 and self.rng.random() < self.drop_rate

    async def _to_server(self, conn: _Conn, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter) -> None:
        buf = bytearray()
        while data := await reader.read(CHUNK):
            if conn.framing:
                buf += data
                try:
                    for message in split_messages(buf):
                        words = command_words(message)
                        conn.pending.append(_Pending(message, self._should_drop(words)))
                        self.counts["commands"] += 1
                except (RespError, ValueError):
                    conn.framing = False  # not RESP after all: forward blindly, inject nothing
                    conn.pending.clear()
            await self._open.wait()
            upstream.write(data)
            await upstream.drain()

    async def _to_client(self, conn: _Conn, upstream: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        buf = bytearray()
        while data := await upstream.read(CHUNK):
            if self.delay_s > 0:
                await asyncio.sleep(self.delay_s)
            await self._open.wait()
            if not conn.framing:
                client.write(data)
                await client.drain()
                continue
            buf += data
            out = bytearray()
            try:
                replies = split_messages(buf)
            except RespError:
                conn.framing = False
                client.write(bytes(buf))
                continue
            for reply in replies:
                if reply.startswith(b">"):  # a RESP3 push answers no command
                    out += reply
                    continue
                pending = conn.pending.popleft() if conn.pending else None
                if pending is not None and pending.drop:
                    client.write(bytes(out))
                    self._record_drop(conn, pending.command, reply)
                    with contextlib.suppress(ConnectionError):
                        await client.drain()
                    self._cut(conn)
                    return
                out += reply
                self.counts["replies"] += 1
            if out:
                client.write(bytes(out))
                await client.drain()

    def _record_drop(self, conn: _Conn, command: bytes, reply: bytes) -> None:
        words = command_words(command)
        name = words[0] if words else "?"
        if name in ("EVALSHA", "EVALSHA_RO") and len(words) > 1:
            name = f"{name} {self.script_names.get(words[1].lower(), words[1][:12])}"
        ids = list(dict.fromkeys(m.decode() for m in JOB_ID.findall(command + b" " + reply)))[:MAX_IDS]
        peer = conn.client.get_extra_info("peername")
        self.dropped.append(DroppedReply(time.time(), name, ids, f"{peer[0]}:{peer[1]}" if peer else "?"))
        self.counts["dropped_replies"] += 1

    def snapshot(self) -> dict[str, Any]:
        by_command = Counter(d.command for d in self.dropped)
        return {**self.counts, "dropped_by_command": dict(by_command), "open_connections": len(self._conns)}


# -- standalone ----------------------------------------------------------------------------------------


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _main(args: argparse.Namespace) -> None:
    proxy = await FaultProxy(
        _address(args.upstream),
        listen=_address(args.listen),
        seed=args.seed,
        drop_rate=args.drop_rate,
        delay_s=args.delay_ms / 1000,
    ).start()
    print(f"fault proxy on {proxy.url} -> {args.upstream}", flush=True)
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    next_reset = loop.time() + args.reset_every if args.reset_every else None
    next_hole = loop.time() + args.blackhole_every if args.blackhole_every else None
    end = loop.time() + args.seconds if args.seconds else None
    try:
        while end is None or loop.time() < end:
            await asyncio.sleep(0.1)
            now = loop.time()
            if next_reset is not None and now >= next_reset:
                proxy.reset_all()
                next_reset = now + args.reset_every * rng.uniform(0.5, 1.5)
            if next_hole is not None and now >= next_hole:
                proxy.blackhole(args.blackhole_s)
                next_hole = now + args.blackhole_every * rng.uniform(0.5, 1.5)
    finally:
        await proxy.close()
        print(json.dumps(proxy.snapshot()), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    parser.add_argument("--upstream", required=True, help="the Redis/Valkey host:port")
    parser.add_argument("--drop-rate", type=float, default=0.0, help="share of commands whose reply is dropped")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay of every reply chunk")
    parser.add_argument("--reset-every", type=float, default=0.0, help="mean seconds between resets (0: never)")
    parser.add_argument("--blackhole-every", type=float, default=0.0, help="mean seconds between black-holes")
    parser.add_argument("--blackhole-s", type=float, default=3.0, help="length of each black-hole")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until Ctrl+C)")
    parser.add_argument("--seed", type=int, default=None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
