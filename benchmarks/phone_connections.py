"""The fleet's phones' connections: httpx's client CPU a request over httpcore and over aiohttp.

    python -m benchmarks.phone_connections [--clients 200] [--requests 25] [--repeats 3]

A loopback server in its own process answers a small JSON object to a 2 KB POST; in this process
`--clients` httpx clients at once, each with its own connection as a simulated phone has (one
shared SSL context), send `--requests` requests each. Prints this process's CPU per request for
each transport, alternating, and the medians: what the device runtime's requests cost a fleet that
runs thousands of phones on one event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import httpx

from android_sim.aiohttp_transport import AiohttpTransport

BODY = b"x" * 2_000
ANSWER = b'{"phase": "share_keys", "padding": "' + b"a" * 300 + b'"}'


async def app(scope: dict[str, object], receive: object, send: object) -> None:
    """The server: reads the request's body, answers ANSWER (a bare ASGI app)."""
    assert scope["type"] == "http"
    more = True
    while more:
        message = await receive()  # type: ignore[operator]
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": ANSWER})  # type: ignore[operator]


def transport(kind: str, tls: object) -> httpx.AsyncBaseTransport:
    if kind == "aiohttp":
        return AiohttpTransport(tls)  # type: ignore[arg-type]
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0)
    return httpx.AsyncHTTPTransport(verify=tls, limits=one)  # type: ignore[arg-type]


async def fleet(url: str, kind: str, clients: int, requests: int) -> None:
    tls = httpx.create_ssl_context()

    async def phone() -> None:
        async with httpx.AsyncClient(transport=transport(kind, tls), base_url=url) as http:
            for _ in range(requests):
                async with http.stream(
                    "POST", "/x", content=BODY, headers={"Authorization": "Bearer t"}
                ) as r:
                    if r.status_code != 200 or b"share_keys" not in await r.aread():
                        raise SystemExit(f"the server answered {r.status_code}; expected 200 and its JSON")

    await asyncio.gather(*(phone() for _ in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.phone_connections", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=25, help="requests per client")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's port
    args = parser.parse_args()
    if args.serve is not None:
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=args.serve, log_level="warning")
        return
    if min(args.clients, args.requests, args.repeats) < 1:
        parser.error("--clients, --requests and --repeats must be at least 1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.phone_connections", "--serve", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.post(url, content=b"")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise SystemExit("the loopback server did not start within 10 s")
        cpu: dict[str, list[float]] = {"httpcore": [], "aiohttp": []}
        n = args.clients * args.requests
        for repeat in range(args.repeats):
            for kind in cpu:
                started, wall = time.process_time(), time.perf_counter()
                asyncio.run(fleet(url, kind, args.clients, args.requests))
                per_request = (time.process_time() - started) / n * 1e6
                cpu[kind].append(per_request)
                seconds = time.perf_counter() - wall
                print(
                    f"run {repeat + 1} {kind:>8}: {per_request:5.0f} us CPU a request, wall {seconds:.2f} s"
                )
        medians = {kind: statistics.median(values) for kind, values in cpu.items()}
        old, new = medians["httpcore"], medians["aiohttp"]
        print(
            f"{args.clients} clients x {args.requests} requests, medians: httpcore {old:.0f} us, "
            f"aiohttp {new:.0f} us a request ({old / new:.2f}x)"
        )
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
