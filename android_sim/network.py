"""A simulated phone network: latency and bandwidth applied to every request and response.

`SimulatedLink` is an httpx transport that wraps a real one (TCP to the orchestrator, or
`httpx.ASGITransport` in-process), so the device code is the same either way and only the
link differs. Many devices share one inner transport (one connection pool), as a simulator
must, while each waits for its own link.
"""

from __future__ import annotations

import asyncio

import httpx


class SimulatedLink(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, bandwidth_mbps: float, latency_ms: float) -> None:
        if bandwidth_mbps <= 0 or latency_ms < 0:
            raise ValueError(
                f"need bandwidth_mbps > 0 and latency_ms >= 0, got {bandwidth_mbps}, {latency_ms}"
            )
        self.inner = inner
        self.bytes_per_second = bandwidth_mbps * 1e6 / 8
        self.latency_seconds = latency_ms / 1000
        self.bytes_up = 0
        self.bytes_down = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.bytes_up += len(body)
        await asyncio.sleep(self.latency_seconds / 2 + len(body) / self.bytes_per_second)
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        self.bytes_down += len(content)
        await asyncio.sleep(self.latency_seconds / 2 + len(content) / self.bytes_per_second)
        return response

    async def aclose(self) -> None:
        """The inner transport is shared by the fleet; its owner closes it."""
