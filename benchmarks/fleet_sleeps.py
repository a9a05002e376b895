"""How late a fleet shard's event loop runs when its devices sleep: `StopSwitch.sleep` (a timer and a
future per sleep) against the sleep it replaced (`asyncio.wait_for` on one shared `asyncio.Event`).

    .venv/bin/python -m benchmarks.fleet_sleeps [--devices 50000] [--mean-sleep 30] [--seconds 20]

Every device sleeps a random time (uniform, mean `--mean-sleep`), wakes and sleeps again, as a
fleet's devices do between charging windows, rests and a refusal's Retry-After; nothing else runs.
It prints the wakes done against those due, and how late a 50 ms probe woke (p50, p99): in a
shard, every request and every task of the devices in a round waits that long at each step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
from collections.abc import Awaitable, Callable

from android_sim.fleet import StopSwitch

PROBE_SECONDS = 0.05


async def measure(shared_event: bool, devices: int, mean_sleep: float, seconds: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    event, switch = asyncio.Event(), StopSwitch()

    async def event_sleep(s: float) -> None:  # the fleet's sleep before StopSwitch
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=s)

    sleep: Callable[[float], Awaitable[None]] = event_sleep if shared_event else switch.sleep
    wakes, due = 0, 0

    async def device(rng: random.Random) -> None:
        nonlocal wakes, due
        while not switch.is_set():
            nap = rng.random() * 2 * mean_sleep
            if loop.time() + nap < started + seconds:
                due += 1
            await sleep(nap)
            wakes += 1

    lags: list[float] = []

    async def probe() -> None:
        while True:
            asleep = loop.time()
            await asyncio.sleep(PROBE_SECONDS)
            lags.append(loop.time() - asleep - PROBE_SECONDS)

    tasks = [asyncio.create_task(device(random.Random(i))) for i in range(devices)]
    probing = asyncio.create_task(probe())
    started = loop.time()  # the devices start when this sleeps
    await asyncio.sleep(seconds)
    done_in_time = wakes
    probing.cancel()
    switch.set()
    event.set()
    await asyncio.gather(*tasks, probing, return_exceptions=True)
    lags.sort()
    return {
        "wakes_per_second": done_in_time / seconds,
        "due_per_second": due / seconds,
        "lag_p50_ms": lags[len(lags) // 2] * 1e3,
        "lag_p99_ms": lags[int(len(lags) * 0.99)] * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet_sleeps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=50_000, help="sleeping devices (a shard's)")
    parser.add_argument("--mean-sleep", type=float, default=30.0, help="their mean sleep, seconds")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each variant runs")
    args = parser.parse_args()
    print(
        f"{args.devices:,} devices, mean sleep {args.mean_sleep:g} s, {args.seconds:g} s each "
        f"(load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}):"
    )
    for label, shared in (("one shared asyncio.Event (before)", True), ("StopSwitch", False)):
        r = asyncio.run(measure(shared, args.devices, args.mean_sleep, args.seconds))
        print(
            f"  {label}: {r['wakes_per_second']:.0f} wakes/s of {r['due_per_second']:.0f} due; the loop "
            f"late by {r['lag_p50_ms']:.0f} ms p50, {r['lag_p99_ms']:.0f} ms p99"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
