"""The simulator's webhook client (offload/testing/sim/sender.py) against real sockets: keep-alive reuse, a
connection the receiver closed while idle, the three ways an answer's body ends, and the failures it must name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from offload.testing.sim.sender import LeanPost, SendError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    body = await reader.readexactly(int(fields.get("content-length", "0")))
    return head[0], fields, body


class Receiver:
    """A plain asyncio server; `answers` says what each request gets (by its order on the whole server)."""

    def __init__(self, answer: Callable[[int, bytes], bytes], close_after: bool = False) -> None:
        self.answer, self.close_after = answer, close_after
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                line, fields, body = await _request(reader)
                self.seen.append((line, fields, body))
                writer.write(self.answer(len(self.seen), body))
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Receiver], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(receiver: Receiver) -> str:
        server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.close()


def _ok(n: int, body: bytes) -> bytes:
    return b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def test_posts_reuse_one_connection_and_send_the_body_and_headers(serve: Callable[..., Awaitable[str]]) -> None:
    receiver = Receiver(_ok)
    url = await serve(receiver)
    client = LeanPost(limit=4, timeout_s=5, agent="test-agent")
    for i in range(5):
        assert await client.post(f"{url}/hook/{i}?x=1", b'{"n":%d}' % i, {"webhook-id": f"msg_{i}"}) == 200
    assert receiver.connections == 1  # kept alive between deliveries
    assert [s[0] for s in receiver.seen] == [f"POST /hook/{i}?x=1 HTTP/1.1" for i in range(5)]
    assert receiver.seen[3][1]["webhook-id"] == "msg_3" and receiver.seen[3][1]["user-agent"] == "test-agent"
    assert receiver.seen[4][2] == b'{"n":4}'
    await client.aclose()


async def test_a_connection_closed_while_idle_is_replaced_and_the_post_sent_once(
    serve: Callable[..., Awaitable[str]],
) -> None:
    """The receiver drops the idle connection between two deliveries (its keep-alive ran out): the second is sent
    on a new connection, and arrives exactly once."""
    receiver = Receiver(_ok)
    url = await serve(receiver)
    client = LeanPost(limit=4, timeout_s=5)
    assert await client.post(f"{url}/a", b"1", {}) == 200
    for writer in receiver.writers:  # the receiver closes it; the client learns only when it writes
        writer.transport.abort()
    await asyncio.sleep(0)
    assert await client.post(f"{url}/b", b"2", {}) == 200
    assert [s[2] for s in receiver.seen] == [b"1", b"2"] and receiver.connections == 2
    await client.aclose()


async def test_a_reused_connection_dropped_before_any_answer_is_sent_again_on_a_new_one(
    serve: Callable[..., Awaitable[str]],
) -> None:
    """The receiver takes the second request on a kept connection and hangs up without a byte of answer (it was
    closing the idle connection just as the request came): the client sends it once more on a new connection
    and returns that answer; a receiver that hangs up on a new connection is an error, not a loop."""
    receiver = Receiver(_ok)
    dropped: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if receiver.connections == 0:
            receiver.connections += 1
            _, _, body = await _request(reader)
            receiver.seen.append(("", {}, body))
            writer.write(_ok(1, body))
            await writer.drain()
            _, _, body = await _request(reader)
            dropped.append(body)
            writer.transport.abort()
            return
        await receiver.handle(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = LeanPost(limit=2, timeout_s=5)
    assert await client.post(url, b"1", {}) == 200
    assert await client.post(url, b"2", {}) == 200
    assert dropped == [b"2"] and [s[2] for s in receiver.seen] == [b"1", b"2"] and receiver.connections == 2

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.transport.abort()

    rude = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    with pytest.raises(SendError, match="IncompleteReadError"):
        await client.post(f"http://127.0.0.1:{rude.sockets[0].getsockname()[1]}/", b"x", {})
    server.close()
    rude.close()
    await client.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 202 Accepted\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;x=y\r\nefg\r\n0\r\nT: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\nfail",
    ],
    ids=["chunked", "no-body", "server-error"],
)
async def test_answers_of_every_framing_leave_the_connection_usable(
    serve: Callable[..., Awaitable[str]], answer: bytes
) -> None:
    receiver = Receiver(lambda n, body: answer)
    url = await serve(receiver)
    client = LeanPost(limit=2, timeout_s=5)
    codes = [await client.post(url + "/h", b"x", {}) for _ in range(3)]
    assert codes == [int(answer[9:12])] * 3 and receiver.connections == 1
    await client.aclose()


async def test_an_answer_without_length_is_read_to_the_close_and_not_reused(
    serve: Callable[..., Awaitable[str]],
) -> None:
    receiver = Receiver(lambda n, body: b"HTTP/1.0 200 OK\r\n\r\nall of it", close_after=True)
    url = await serve(receiver)
    client = LeanPost(limit=2, timeout_s=5)
    assert [await client.post(url, b"x", {}) for _ in range(2)] == [200, 200]
    assert receiver.connections == 2
    await client.aclose()


async def test_failures_are_named(serve: Callable[..., Awaitable[str]]) -> None:
    """Nothing listening, a garbage answer, a silent receiver (the timeout), a URL that is not http(s)."""
    client = LeanPost(limit=2, timeout_s=0.5)
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(SendError, match="cannot connect"):
        await client.post(f"http://127.0.0.1:{port}/", b"x", {})
    garbage = await serve(Receiver(lambda n, body: b"SMTP ready\r\n\r\n"))
    with pytest.raises(SendError, match=r"not an HTTP/1\.x answer"):
        await client.post(garbage, b"x", {})

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(5)

    quiet = await asyncio.start_server(silent, "127.0.0.1", 0)
    with pytest.raises(TimeoutError):
        await client.post(f"http://127.0.0.1:{quiet.sockets[0].getsockname()[1]}/", b"x", {})
    quiet.close()
    with pytest.raises(SendError, match="not an http"):
        await client.post("ftp://example.com/x", b"x", {})
    await client.aclose()
