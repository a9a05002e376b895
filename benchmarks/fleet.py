"""Fleet benchmark: the simulator against the real HTTP orchestrator, and at scale.

    ./dev bench-fleet        (or: python -m benchmarks.fleet)

Prints:
1. Simulated client tasks per second through the real HTTP orchestrator (its own process,
   loopback) versus the same device code with an in-process transport (the orchestrator app
   in the fleet's process over ASGI, no sockets). Devices are always eligible, with no
   simulated network delay, slowdown or dropouts, so the figure is the system's own rate.
   Target (issue 4): HTTP >= 50% of in-process.
2. 10,000 enrolled devices, each with its own example store, of which 1,000 check in at once,
   in waves: every check-in must be answered (p50/p99 latency), the accepted devices train and
   report, and rounds keep committing.
Both share the 2 cores with the fleet process; medians and ratios from one run are what to quote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console

from android_sim.admin import AdminClient
from android_sim.builtin_data import export, model_config, population_settings
from android_sim.device_data import expression_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.fleet import write_store
from android_sim.network import Connector
from android_sim.profiles import DeviceClass
from android_sim.run import run_async
from android_sim.run_config import RunConfig
from android_sim.session import SIMULATED_FLEET_LIMITS
from android_sim.small_cohorts import simulation_policy
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.task_runner import TaskRunner
from orchestrator.local import LocalOrchestrator

# The benchmark's phones take plaintext rounds (it measures the server's throughput).
POLICY = simulation_policy("plaintext")

# Always eligible, no slowdown, no network delay, no dropouts: the system's own rate.
BENCH_PHONE = (DeviceClass("bench", 1.0, 1.0, 1e6, 0.0, 0.0, 0.0, 24.0, 1.0, 0.0),)


def tasks_per_second(rounds: list[dict[str, Any]]) -> float:
    """Completed training tasks per second, from the orchestrator's own round timestamps."""
    training = [r for r in rounds if r["kind"] == "training" and r["status"] == "committed"]
    span = max(r["closed_at"] for r in training) - min(r["opened_at"] for r in training[1:] or training)
    return float(sum(r["counters"]["reported"] for r in training[1:] or training) / span)


def bench_config(work_dir: Path, devices: int, rounds: int, **options: Any) -> RunConfig:
    """A run of the benchmark's phones, kept busy (`options` override these)."""
    defaults: dict[str, Any] = {
        "target_reports": 40,
        "min_examples": 2,
        # Short rests keep the devices busy, so the rate is the system's, not the schedule's; more
        # devices than this only add rejected check-ins (a thundering herd, not tasks).
        "round_seconds": 10.0,
        "cooldown_hours": 0.25,
        "evaluation_every": 0,
        "device_mix": BENCH_PHONE,
        "held_out_fraction": 0.05,
        "show_devices": 0,
    }
    return RunConfig(work_dir=work_dir, devices=devices, rounds=rounds, **{**defaults, **options})


async def transport_comparison(work: Path, rounds: int, devices: int) -> dict[str, float]:
    rates = {}
    for label, in_process in (("http", False), ("in_process", True)):
        (work / label).mkdir(parents=True)
        (work / label / "model").symlink_to(work / "model", target_is_directory=True)
        config = bench_config(work / label, devices, rounds, in_process=in_process)
        result = await run_async(config, Console(quiet=True))
        rates[label] = tasks_per_second(result.summary["rounds"])
    return rates


@dataclass
class CheckinTimings:
    latencies: list[float] = field(default_factory=list)
    retried: int = 0  # attempts that failed in transport and were retried


class CheckinTimer(httpx.AsyncBaseTransport):
    """Times a device's check-ins from request to answer."""

    def __init__(self, inner: httpx.AsyncBaseTransport, timings: CheckinTimings) -> None:
        self.inner = inner
        self.timings = timings

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        started = time.perf_counter()
        try:
            response = await self.inner.handle_async_request(request)
            await response.aread()
        except httpx.TransportError:
            # e.g. a kept-alive connection the server closed meanwhile: the client retries.
            if request.url.path.endswith("/checkin"):
                self.timings.retried += 1
            raise
        if request.url.path.endswith("/checkin"):
            self.timings.latencies.append(time.perf_counter() - started)
        return response


async def scale(work: Path, enrolled: int, concurrent: int, waves: int) -> dict[str, Any]:
    data = expression_fleet(SyntheticConfig(num_expressions=1000, num_users=enrolled, seed=1))
    model = model_config(data)
    model_dir = export(model, work / "model")
    stores = work / "scale-stores"
    stores.mkdir()
    t0 = time.perf_counter()
    for i, device in enumerate(data.devices):
        write_store(stores / f"{i}.sqlite", device.events(), model.features())
    store_seconds = time.perf_counter() - t0
    settings = population_settings(
        RunConfig(work_dir=work, target_reports=100, oversampling=1.3, min_examples=1, round_seconds=60.0),
        data,
        model,
    )
    with LocalOrchestrator(
        f"sqlite:///{work / 'scale.sqlite'}",
        log_path=work / "scale.log",
        settings=SIMULATED_FLEET_LIMITS,
    ) as server:
        connector = Connector()
        timings = CheckinTimings()
        admin = AdminClient(server.url, server.admin_token)
        await admin.ensure_population("scale", model_dir, settings)
        https = [
            httpx.AsyncClient(transport=CheckinTimer(connector.transport()[0], timings), timeout=120.0)
            for _ in range(enrolled)
        ]
        clients = [OrchestratorClient(server.url, http=http) for http in https]
        t0 = time.perf_counter()
        limit = asyncio.Semaphore(64)

        async def enroll(client: OrchestratorClient) -> None:
            async with limit:
                await client.enroll()

        await asyncio.gather(*(enroll(c) for c in clients))
        enroll_seconds = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        outcomes: dict[str, int] = {}
        wave_latencies = []
        with TaskRunner(2) as runner:
            for _ in range(waves):
                timings.latencies.clear()
                chosen = rng.choice(enrolled, concurrent, replace=False)

                async def take_part(i: int) -> Participation:
                    with ExampleStore(stores / f"{i}.sqlite") as store:
                        agent = DeviceAgent(
                            clients[i], store, work / "scale-cache", "scale", runner=runner, policy=POLICY
                        )
                        return await agent.participate("training", seed=int(i))

                results = await asyncio.gather(*(take_part(int(i)) for i in chosen), return_exceptions=True)
                for p in results:
                    # An exception here is a device that got no answer after all its retries.
                    status = p.status if isinstance(p, Participation) else f"failed: {type(p).__name__}"
                    outcomes[status] = outcomes.get(status, 0) + 1
                wave_latencies.append(list(timings.latencies))
        population = await admin.status("scale")
        await admin.aclose()
        for http in https:
            await http.aclose()
    all_latencies = [x for wave in wave_latencies for x in wave]
    return {
        "enrolled": enrolled,
        "concurrent": concurrent,
        "waves": waves,
        "store_seconds": store_seconds,
        "enroll_per_second": enrolled / enroll_seconds,
        "checkins_answered": len(all_latencies),
        "checkins_failed": sum(n for k, n in outcomes.items() if k.startswith("failed")),
        "checkin_p50_ms": float(np.percentile(all_latencies, 50)) * 1000,
        "checkin_p99_ms": float(np.percentile(all_latencies, 99)) * 1000,
        "checkin_max_ms": max(all_latencies) * 1000,
        "outcomes": outcomes,
        "checkins_retried": timings.retried,
        "rounds_committed": population["training_rounds_committed"],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:  # 10,000 stores: deleted after
        work = Path(scratch)
        data = expression_fleet(SyntheticConfig(num_expressions=1000, num_users=args.devices, seed=0))
        export(model_config(data), work / "model")
        rates = await transport_comparison(work, args.rounds, args.devices)
        at_scale = await scale(work, args.enrolled, args.concurrent, args.waves)
    return {"tasks_per_second": rates, "scale": at_scale}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=300, help="fleet size for the transport comparison")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per transport")
    parser.add_argument("--enrolled", type=int, default=10_000)
    parser.add_argument("--concurrent", type=int, default=1000)
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    rates, at_scale = results["tasks_per_second"], results["scale"]
    ratio = rates["http"] / rates["in_process"]
    print(f"fleet benchmark ({args.devices} devices x {args.rounds} rounds of 40 per transport; 2 cores)")
    print(f"  client tasks/s, real HTTP orchestrator        {rates['http']:8.1f}")
    print(f"  client tasks/s, in-process transport          {rates['in_process']:8.1f}")
    print(f"  HTTP / in-process                              {ratio:8.0%}   target >= 50%")
    print(
        f"scale: {at_scale['enrolled']:,} enrolled devices (stores written in "
        f"{at_scale['store_seconds']:.0f} s, enrolled at {at_scale['enroll_per_second']:.0f}/s), "
        f"{at_scale['concurrent']:,} checking in at once, {at_scale['waves']} waves"
    )
    print(
        f"  check-ins answered {at_scale['checkins_answered']:,} (transport retries "
        f"{at_scale['checkins_retried']}), devices without an answer {at_scale['checkins_failed']}; "
        f"latency p50 {at_scale['checkin_p50_ms']:.0f} ms, p99 {at_scale['checkin_p99_ms']:.0f} ms, "
        f"max {at_scale['checkin_max_ms']:.0f} ms"
    )
    print(
        f"  device outcomes {json.dumps(at_scale['outcomes'])}; "
        f"rounds committed {at_scale['rounds_committed']}"
    )
    if args.json:
        args.json.write_text(json.dumps({**results, "http_over_in_process": ratio}, indent=2))
    return 0 if at_scale["checkins_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
