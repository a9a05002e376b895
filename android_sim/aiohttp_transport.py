"""A simulated phone's TCP connection to the orchestrator: an httpx transport on aiohttp's client.

The device runtime speaks httpx; a phone runs one device, but the fleet runs thousands on one event
loop, where httpx's client cost ~1.4x the CPU a request over httpcore's pure-Python HTTP/1.1 (h11
over anyio) that it costs over this transport (aiohttp's C parser, asyncio streams;
`benchmarks/phone_connections.py`). The device code is unchanged: only what carries its
bytes differs, as with `SimulatedLink`.

It keeps httpx's contract: the request's `timeout` extension (connect, read), errors raised as
httpx's (`ConnectError`, `ReadTimeout`, ...), the body handed on as read (httpx decodes it), and
the `trace` extension's events for the stretch where a cancel is safe (aiohttp's is everywhere; the
device runtime uses them to cancel a long-poll it no longer needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import httpx

CHUNK_BYTES = 1 << 16
# What httpx already set on the request; aiohttp must neither add its own nor change them.
_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# A body is sent whole (read before sending), so its length is known: aiohttp sets it.
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
# httpcore's trace events for the stretch where a cancel is safe, from sending the request until
# its answer's headers are in.
SENDING, ANSWERED = "http11.send_request_headers.started", "http11.receive_response_headers.complete"

Trace = Callable[[str, dict[str, Any]], Awaitable[None]]


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One connection at a time, kept alive for `keepalive_seconds` (below the server's own
    keep-alive timeout, so that the server never closes it under a request)."""

    def __init__(self, ssl_context: ssl.SSLContext, keepalive_seconds: float = 4.0) -> None:
        self._ssl = ssl_context
        self._keepalive = keepalive_seconds
        self._session: aiohttp.ClientSession | None = None  # made in the event loop, on first use
        self._closed = False

    def _opened(self, request: httpx.Request) -> aiohttp.ClientSession:
        if self._closed:
            # A request the device gave up on, still on its way (e.g. in its simulated link's
            # latency) when the device hung up: it must not dial a connection nobody would close.
            raise httpx.ConnectError("the device has hung up this connection", request=request)
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=self._keepalive, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # httpx's client keeps the cookies
                auto_decompress=False,  # httpx decodes, as from its own transports
                skip_auto_headers=_AUTO_HEADERS,
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        trace: Trace | None = request.extensions.get("trace")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in _FRAMING
        ]
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read")
        )
        if trace is not None:
            await trace(SENDING, {"request": request})
        with _as_httpx_errors(request):
            response = await self._opened(request).request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=timeout,
            )
        if trace is not None:
            await trace(ANSWERED, {"request": request})
        return httpx.Response(
            response.status,
            headers=response.raw_headers,
            stream=_Body(response, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
            request=request,
        )

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await asyncio.shield(session.close())  # closed even when the device's task is cancelled


class _Body(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors(self._request):
            async for chunk in self._response.content.iter_chunked(CHUNK_BYTES):
                yield chunk

    async def aclose(self) -> None:
        self._response.release()  # back to the pool if read whole, else the connection is closed


@contextlib.contextmanager
def _as_httpx_errors(request: httpx.Request) -> Iterator[None]:
    """aiohttp's failures as the httpx errors that a caller of httpx expects."""
    try:
        yield
    except Exception as error:  # a cancel (BaseException) passes through as it is
        mapped = _httpx_error(error)
        if mapped is None:
            raise
        raise mapped(f"{type(error).__name__}: {error}", request=request) from error


def _httpx_error(error: BaseException) -> type[httpx.TransportError] | None:
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout
    if isinstance(error, (aiohttp.SocketTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError
    if isinstance(
        error, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)
    ):
        return httpx.RemoteProtocolError
    if isinstance(error, (aiohttp.ClientError, OSError)):
        return httpx.ReadError
    return None
