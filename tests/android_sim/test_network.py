import asyncio
import time

import httpx
import pytest

from android_sim.network import Connector, SimulatedLink


def echo(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=b"x" * 50_000)


def test_a_link_charges_latency_and_bandwidth_both_ways() -> None:
    # 4 Mbps = 500,000 bytes/s: 50,000 bytes up and 50,000 down take 0.2 s, plus 100 ms latency.
    link = SimulatedLink(httpx.MockTransport(echo), bandwidth_mbps=4.0, latency_ms=100.0)

    async def call() -> float:
        async with httpx.AsyncClient(transport=link) as client:
            started = time.perf_counter()
            response = await client.post("http://orchestrator/x", content=b"y" * 50_000)
            assert response.content == b"x" * 50_000
            return time.perf_counter() - started

    elapsed = asyncio.run(call())

    assert 0.3 <= elapsed < 0.6
    assert (link.bytes_up, link.bytes_down) == (50_000, 50_000)


def test_each_device_gets_its_own_connection_but_in_process_is_shared() -> None:
    tcp = Connector()
    (a, owned_a), (b, _) = tcp.transport(), tcp.transport()
    assert a is not b and owned_a

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not called")

    local = Connector(app)
    (c, owned_c), (d, _) = local.transport(), local.transport()
    assert c is d and not owned_c


def test_a_link_refuses_impossible_numbers() -> None:
    with pytest.raises(ValueError, match="bandwidth_mbps > 0"):
        SimulatedLink(httpx.MockTransport(echo), bandwidth_mbps=0.0, latency_ms=1.0)
