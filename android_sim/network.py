"""A simulated phone network: latency and bandwidth applied to every request and response.

`SimulatedLink` is an httpx transport that wraps a real one (TCP to the orchestrator, or
`httpx.ASGITransport` in-process), so the device code is the same either way and only the
link differs. `Connector` hands each device its inner transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from android_sim.aiohttp_transport import AiohttpTransport


class Connector:
    """Each device's way to the orchestrator: its own TCP connection to a real server, as a phone
    has (one shared httpx pool would scan all its connections for every request: 3x slower at
    64 connections), or one shared in-process ASGI app."""

    def __init__(self, app: Any | None = None) -> None:
        self._shared = httpx.ASGITransport(app=app) if app is not None else None
        self._ssl = httpx.create_ssl_context()  # made once: building one per device costs ~ms each

    def transport(self) -> tuple[httpx.AsyncBaseTransport, bool]:
        """(a transport for one device, whether the device owns it and must close it)."""
        if self._shared is not None:
            return self._shared, False
        # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them under us.
        return AiohttpTransport(self._ssl, keepalive_seconds=4.0), True

    async def aclose(self) -> None:
        if self._shared is not None:
            await self._shared.aclose()


class SimulatedLink(httpx.AsyncBaseTransport):
    def __init__(
        self,
        inner: httpx.AsyncBaseTransport,
        bandwidth_mbps: float,
        latency_ms: float,
        *,
        owns_inner: bool = False,
        on_checkin: Callable[[float], None] | None = None,
    ) -> None:
        """`on_checkin(seconds)` hears how long each check-in took the server to answer (from
        the request's sending to its answer's last byte, the simulated link's delays left out)."""
        if bandwidth_mbps <= 0 or latency_ms < 0:
            raise ValueError(
                f"need bandwidth_mbps > 0 and latency_ms >= 0, got {bandwidth_mbps}, {latency_ms}"
            )
        self.inner = inner
        self.owns_inner = owns_inner
        self.bytes_per_second = bandwidth_mbps * 1e6 / 8
        self.latency_seconds = latency_ms / 1000
        self.bytes_up = 0
        self.bytes_down = 0
        self.on_checkin = on_checkin

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.bytes_up += len(body)
        await asyncio.sleep(self.latency_seconds / 2 + len(body) / self.bytes_per_second)
        started = time.perf_counter()
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        if self.on_checkin is not None and request.url.path.endswith("/checkin"):
            self.on_checkin(time.perf_counter() - started)
        self.bytes_down += len(content)
        await asyncio.sleep(self.latency_seconds / 2 + len(content) / self.bytes_per_second)
        return response

    async def aclose(self) -> None:
        if self.owns_inner:  # a shared one is closed by its owner
            await self.inner.aclose()
