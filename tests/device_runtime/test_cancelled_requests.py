"""A device cancels requests (a secure round's messages when it leaves the round, every request when
it is switched off): its connection must come back each time, or the device is cut off for good."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import ServerUnavailable

ENROLLED = json.dumps({"device_id": "d0123456789abcdef", "token": "t" * 32}).encode()
KEEP_ALIVE_SECONDS = 0.05
SLOW_SECONDS = 3.0  # a held answer (a long-poll), longer than the pool's wait for a connection


async def _answer_every_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server that enrolls whoever asks; requests for a model's global
    parameters wait `SLOW_SECONDS` for their answer."""
    try:
        while True:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await reader.read(4096)
                if not chunk:
                    return
                head += chunk
            if b"/global " in head.split(b"\r\n", 1)[0]:
                await asyncio.sleep(SLOW_SECONDS)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(ENROLLED)}\r\n\r\n".encode()
                + ENROLLED
            )
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


def test_a_request_cancelled_at_any_moment_gives_its_connection_back() -> None:
    async def attempts() -> tuple[list[str], int, float]:
        # Prepare: a device with one connection (as the fleet's phones have) whose keep-alive
        # expires between requests, so that each request first closes the old connection and
        # opens a new one; the pool waits at most 1 s for a free connection
        server = await asyncio.start_server(_answer_every_request, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        limits = httpx.Limits(max_connections=1, keepalive_expiry=KEEP_ALIVE_SECONDS)
        http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(limits=limits), timeout=httpx.Timeout(5.0, pool=1.0)
        )
        client = OrchestratorClient(f"http://127.0.0.1:{port}", http=http, attempts=1)
        failures, cancelled, after_held = [], 0, 0.0
        try:
            await client.enroll()
            # Execute: cancel a request after 0, 1, 2, ... turns of the event loop, then send another
            for turns in range(40):
                await asyncio.sleep(2 * KEEP_ALIVE_SECONDS)
                request = asyncio.create_task(client.enroll())
                for _ in range(turns):
                    await asyncio.sleep(0)
                request.cancel()
                outcome = (await asyncio.gather(request, return_exceptions=True))[0]
                cancelled += isinstance(outcome, asyncio.CancelledError)
                try:
                    await client.enroll()
                except ServerUnavailable as e:
                    failures.append(f"after a cancel at turn {turns}: {e}")
            # ... and cancel a request whose answer the server holds
            held = asyncio.create_task(client.global_params_at("p", 1))
            await asyncio.sleep(0.2)
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            started = time.monotonic()
            await client.enroll()
            after_held = time.monotonic() - started
        finally:
            await http.aclose()
            server.close()
            await server.wait_closed()
        return failures, cancelled, after_held

    failures, cancelled, after_held = asyncio.run(attempts())

    # Assert: every request after a cancel got a connection, the cancels did stop their callers,
    # and a held request let go of the connection at once rather than when its answer came
    assert failures == []
    assert cancelled >= 10
    assert after_held < 1.0
