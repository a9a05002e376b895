"""The fleet's transport against a real loopback server: what httpx's callers rely on holds."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from android_sim.aiohttp_transport import ANSWERED, SENDING, AiohttpTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head.decode("latin-1").split("\r\n")[:-2]
    method, target, _ = line.split(" ")
    headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return {"method": method, "target": target, "headers": headers, "body": body}


def _answer(status: int, body: bytes, *extra: str) -> bytes:
    head = [f"HTTP/1.1 {status} OK", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A real TCP server on loopback; `handler` answers each request of a connection."""
    counts = {"connections": 0}

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts["connections"] += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                await handler(reader, writer, request)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", counts
    finally:
        server.close()


async def echo(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: dict[str, Any]) -> None:
    shown = {**request, "body": len(request["body"])}
    writer.write(_answer(200, json.dumps(shown).encode(), "Content-Type: application/json"))
    await writer.drain()


def client(url: str, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=AiohttpTransport(httpx.create_ssl_context()), base_url=url, **kwargs)


def test_requests_arrive_as_httpx_sent_them_over_one_kept_alive_connection() -> None:
    async def go() -> tuple[list[dict[str, Any]], dict[str, int]]:
        async with serving(echo) as (url, counts), client(url) as http:
            first = await http.post("/a?wait=5", content=b"x" * 70_000, headers={"Authorization": "Bearer t"})
            second = await http.get("/b")
            return [first.json(), second.json()], counts

    (posted, got), counts = asyncio.run(go())
    assert (posted["method"], posted["target"], posted["body"]) == ("POST", "/a?wait=5", 70_000)
    assert posted["headers"]["authorization"] == "Bearer t"
    assert posted["headers"]["content-length"] == "70000"
    assert posted["headers"]["user-agent"].startswith("python-httpx/")  # httpx's, not aiohttp's
    assert (got["method"], got["target"], got["body"]) == ("GET", "/b", 0)
    assert counts["connections"] == 1


def test_an_encoded_answer_is_decoded_by_httpx_and_a_long_one_streams() -> None:
    payload = os.urandom(1_000_000)  # incompressible: it arrives in several chunks

    async def gzipped(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _q: dict[str, Any]) -> None:
        writer.write(_answer(200, gzip.compress(payload), "Content-Encoding: gzip"))
        await writer.drain()

    async def go() -> tuple[bytes, int]:
        async with serving(gzipped) as (url, _), client(url) as http:
            async with http.stream("GET", "/") as response:
                chunks = [chunk async for chunk in response.aiter_bytes()]
            return b"".join(chunks), len(chunks)

    body, chunks = asyncio.run(go())
    assert body == payload
    assert chunks > 1


def test_failures_surface_as_httpx_transport_errors() -> None:
    async def silent(_r: asyncio.StreamReader, _w: asyncio.StreamWriter, _q: dict[str, Any]) -> None:
        await asyncio.sleep(5)

    async def cut_short(_r: asyncio.StreamReader, writer: asyncio.StreamWriter, _q: dict[str, Any]) -> None:
        writer.write(_answer(200, b"x" * 1000)[:-500])
        await writer.drain()
        writer.close()
        raise ConnectionError

    async def go() -> list[type[BaseException]]:
        errors: list[type[BaseException]] = []
        async with serving(silent) as (url, _), client(url, timeout=httpx.Timeout(5.0, read=0.2)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.get("/")
        async with serving(cut_short) as (url, _), client(url) as http:
            with pytest.raises(httpx.TransportError) as cut:
                await http.get("/")
            errors.append(type(cut.value))
        async with serving(echo) as (url, _):
            pass  # closed: nothing listens on its port any more
        async with client(url) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get("/")
        return errors

    assert asyncio.run(go()) == [httpx.RemoteProtocolError]


def test_trace_marks_the_request_until_its_answer_and_a_cancelled_long_poll_frees_the_connection() -> None:
    async def held_then_echo(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: dict[str, Any]
    ) -> None:
        if request["target"] == "/hold":
            await asyncio.sleep(30)
        await echo(reader, writer, request)

    async def go() -> tuple[list[str], str]:
        events: list[str] = []

        async def trace(event: str, _info: dict[str, Any]) -> None:
            events.append(event)

        async with serving(held_then_echo) as (url, _), client(url) as http:
            await http.get("/traced", extensions={"trace": trace})
            poll = asyncio.ensure_future(http.get("/hold"))
            await asyncio.sleep(0.2)
            poll.cancel()
            with pytest.raises(asyncio.CancelledError):
                await poll
            # The device's one connection is free again at once (no pool slot lost to the cancel).
            after = await asyncio.wait_for(http.get("/after"), timeout=2.0)
            return events, after.json()["target"]

    events, target = asyncio.run(go())
    assert events == [SENDING, ANSWERED]
    assert target == "/after"


def test_a_request_still_on_its_way_when_the_device_hangs_up_dials_nothing() -> None:
    async def go() -> dict[str, int]:
        async with serving(echo) as (url, counts):
            transport = AiohttpTransport(httpx.create_ssl_context())
            await transport.aclose()
            with pytest.raises(httpx.ConnectError, match="hung up"):
                await transport.handle_async_request(httpx.Request("GET", f"{url}/late"))
            return counts

    assert asyncio.run(go())["connections"] == 0
