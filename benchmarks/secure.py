"""Secure aggregation benchmark: a 3,706 x 50 model (MovieLens 1M-sized), 100 devices, 20% dropping.

    ./dev bench-secure-aggregation   (or: python -m benchmarks.secure)

Prints:
- device: the extra CPU a device spends per task under secure aggregation (quantizing its dense
  delta, keys, Shamir shares and their encryption, the masks, the unmasking answer) next to what
  the plaintext task spends on its report (encoding the sparse delta); median over the round's
  devices, with SecAgg+ neighbours (k about 6 log2 n) and with the full graph. Target: <= 50 ms extra.
- server: time to unmask a round (sum the masked inputs, reconstruct the secrets, regenerate and
  remove the masks, dequantize), in process. Target: <= 2 s.
- a whole round over HTTP against a real server process on loopback: 100 devices, 5 leaving before
  each of the four phases (20%): whether it commits, its wall time, the server's own unmasking
  time, and the protocol's bytes up and down per device (medians), next to a plaintext report's,
  and the CPU seconds the server process and the drivers' process spent on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from android_sim.network import Connector
from android_sim.small_cohorts import simulation_policy
from contracts.manifest import load_manifest
from contracts.params import encode_sparse_delta
from contracts.protocol import Assignment
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.secure_round import SecureRoundDriver
from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from model_export.in_subprocess import export_in_subprocess
from secure_aggregation import server
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.messages import encode_vector, shares_to_json
from secure_aggregation.neighbours import suggested_neighbours
from secure_aggregation.quantization import Layout, quantize
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

NUM_ITEMS, DIM = 3706, 50
PHASES = ("advertise", "share_keys", "masked_input", "unmasking")
# The benchmark's phones: secure rounds only, floors below its rounds (threshold 0.4, half the devices).
POLICY = simulation_policy("secure", min_threshold=0.4)


def client_delta(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A task's dense delta: the ~150 rows of 3,706 a MovieLens client changes."""
    delta = np.zeros((NUM_ITEMS, DIM), np.float32)
    rows = rng.choice(NUM_ITEMS, 150, replace=False)
    delta[rows] = rng.normal(0, 0.01, (150, DIM)).astype(np.float32)
    return {"item_embeddings": delta}


def leaving(devices: int, per_phase: int) -> dict[int, str]:
    """Device index -> the phase before which it leaves: `per_phase` devices at each phase."""
    return {i * len(PHASES) + p: phase for i in range(per_phase) for p, phase in enumerate(PHASES)}


class Stopwatch:
    """CPU time per device, added up over the phases."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._device, self._start = 0, 0.0

    def __call__(self, device: int) -> Stopwatch:
        self._device = device
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._start
        self.seconds[self._device] = self.seconds.get(self._device, 0.0) + elapsed


def in_process(devices: int, neighbours: int, per_phase: int) -> dict[str, float]:
    """Every device's side and the server's unmasking, in this process, timed separately."""
    layout = Layout([("item_embeddings", (NUM_ITEMS, DIM))])
    params = RoundParameters("bench/1/x", layout.length, 32, 1.0, devices, neighbours, 0.4, devices // 2)
    rng = np.random.default_rng(0)
    leaves = {i + 1: phase for i, phase in leaving(devices, per_phase).items()}
    deltas = {i: client_delta(rng) for i in range(1, devices + 1)}
    plaintext = []
    for delta in deltas.values():
        start = time.perf_counter()
        encode_sparse_delta(delta)
        plaintext.append(time.perf_counter() - start)

    watch = Stopwatch()
    sessions = {i: DeviceSession(params) for i in deltas}
    roster = {}
    for i, session in sessions.items():
        if leaves.get(i) != "advertise":
            with watch(i):
                roster[i] = session.advertise()
    graph = round_graph(params, sorted(roster))
    shares = {}
    for i in roster:
        if leaves.get(i) != "share_keys":
            with watch(i):
                shares[i] = sessions[i].share_keys(i, roster)
                json.dumps(shares_to_json(shares[i]))
    masked = {}
    for i in shares:
        if leaves.get(i) != "masked_input":
            with watch(i):
                vector = quantize(layout.flatten(deltas[i]), params, rng)
                masked[i] = sessions[i].masked_input(vector, server.ciphertexts_for(i, graph, shares))
                encode_vector(masked[i], params)
    responses = {}
    for i in masked:
        if leaves.get(i) != "unmasking":
            with watch(i):
                responses[i] = sessions[i].unmask(sorted(masked))

    start = time.perf_counter()
    total = server.MaskedSum(params)
    for vector in masked.values():
        total.add(vector)
    server.unmask(params, total.total, roster, graph, shares, masked, responses)
    unmask_seconds = time.perf_counter() - start
    finishers = [watch.seconds[i] for i in responses]
    return {
        "neighbours": len(graph[min(graph)]),
        "plaintext_ms": 1000 * statistics.median(plaintext),
        "secure_ms": 1000 * statistics.median(finishers),
        "unmask_s": unmask_seconds,
        "survivors": len(masked),
    }


async def over_http(
    url: str, model_dir: Path, devices: int, per_phase: int, certified: bool
) -> dict[str, object]:
    """A secure round of `devices` real device drivers against the server at `url` (`certified`:
    each with a signing key certified by an enrollment authority, checking the roster and its
    neighbours' signatures, as the production policy requires)."""
    authority = EnrollmentAuthority()
    policy = dataclasses.replace(POLICY, certified_roster=certified)
    manifest = load_manifest(model_dir)
    leaves = leaving(devices, per_phase)
    rng = np.random.default_rng(1)
    # One connection per device, as on a phone, made as the fleet makes its phones' (aiohttp's
    # client: httpcore's cost the drivers ~1.4x the CPU a request). One client shared by all the
    # devices made each request scan the whole pool (httpcore's pool is O(connections x waiting
    # requests) a request); a capped pool queued the long polls behind each other.
    connector = Connector()
    async with contextlib.AsyncExitStack() as stack:
        https = [
            await stack.enter_async_context(
                httpx.AsyncClient(timeout=120, transport=connector.transport()[0])
            )
            for _ in range(devices)
        ]
        clients = [OrchestratorClient(url, http=http) for http in https]
        for client in clients:
            await client.enroll()
        assignments = [await c.checkin("movies", 100) for c in clients]
        assert all(isinstance(a, Assignment) for a in assignments), assignments
        identities = [
            DeviceIdentity.enroll(authority.certify, authority.public_key) if certified else None
            for _ in clients
        ]
        start = time.perf_counter()

        def stays_until(phase: str | None) -> Callable[[str], bool]:
            return lambda current: current != phase

        drivers = [
            SecureRoundDriver(
                c,
                a,  # type: ignore[arg-type]
                policy,
                stays=stays_until(leaves.get(i)),
                identity=identities[i],
            )
            for i, (c, a) in enumerate(zip(clients, assignments, strict=True))
        ]
        results = await asyncio.gather(*(d.run(manifest, client_delta(rng)) for d in drivers))
        seconds = time.perf_counter() - start
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    rounds = httpx.get(
        f"{url}/v1/admin/populations/movies/rounds?kind=training&limit=5", headers=headers
    ).json()
    first = rounds[-1]
    finished = [r for r in results if r.status == "reported"]
    plaintext = len(encode_sparse_delta(client_delta(rng)))
    return {
        "status": first["status"],
        "survivors": first["counters"]["reported"],
        "round_seconds": seconds,
        "server_unmask_s": first["metrics"].get("unmask_seconds", float("nan")),
        "up_kb": statistics.median(r.bytes_up for r in finished) / 1000,
        "down_kb": statistics.median(r.bytes_down for r in finished) / 1000,
        "plaintext_up_kb": plaintext / 1000,
        "statuses": {s: sum(r.status == s for r in results) for s in {r.status for r in results}},
        "phases": {
            p: round(first["metrics"][f"secure_{p}_seconds"], 2)
            for p in (*PHASES[:3], "consistency", "unmasking")
            if f"secure_{p}_seconds" in first["metrics"]
        },
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.secure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument(
        "--per-phase", type=int, default=5, help="devices leaving before each of the 4 phases"
    )
    parser.add_argument(
        "--certified",
        action="store_true",
        help="devices with certified signing keys that check the roster and their neighbours' signatures",
    )
    parser.add_argument(
        "--http-only", action="store_true", help="only the round over HTTP (skip the in-process figures)"
    )
    args = parser.parse_args()
    print(
        f"secure aggregation, {NUM_ITEMS} x {DIM} model, {args.devices} devices, "
        f"{args.per_phase} leaving before each phase"
    )
    # The full graph costs a device O(n) masks: past a few hundred devices, minutes in process.
    graphs = (
        (suggested_neighbours(args.devices), 0)
        if args.devices <= 400
        else (suggested_neighbours(args.devices),)
    )
    for neighbours in () if args.http_only else graphs:
        r = in_process(args.devices, neighbours, args.per_phase)
        print(
            f"  in process, {r['neighbours']} neighbours each: device extra per task {r['secure_ms']:.1f} ms "
            f"(plaintext report encoding {r['plaintext_ms']:.2f} ms; median over devices); server unmask "
            f"{r['unmask_s']:.2f} s for {r['survivors']} survivors"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        export_in_subprocess(
            ModelConfig(num_items=NUM_ITEMS, embedding_dim=DIM, batch_size=5, max_batches=64), model_dir
        )
        settings = {
            "target_reports": args.devices,
            "oversampling": 1.0,
            "min_reports": args.devices // 2,
            "aggregation": "secure",
            "secure": {
                "clip_norm": 1.0,
                # Deadlines that grow with the round: a phase's length, not its deadline, is measured.
                "advertise_seconds": max(120, 1.2 * args.devices),
                "share_keys_seconds": max(60, 0.6 * args.devices),
                "masked_input_seconds": max(60, 0.6 * args.devices),
                "unmasking_seconds": max(60, 0.6 * args.devices),
                # The devices here all run in this process at its pace: the protocol's cost, not
                # a fleet's stragglers, is measured.
                "straggler_wait": None,
            },
        }
        # A generous start-up time: on a loaded machine the server's imports alone can take a minute.
        with Server(Path(tmp) / "orchestrator.sqlite").start(timeout_seconds=300) as running:
            created = admin_create_population(running.url, model_dir, "movies", json.dumps(settings))
            assert created.status_code == 201, created.text
            assert running.process is not None
            # The CPU the round costs each side (enrolment and check-ins included), next to its wall
            # time: on a shared machine the wall time also says how much of the cores the round got.
            server_before, drivers_before = process_cpu_seconds(running.process.pid), time.process_time()
            h = asyncio.run(over_http(running.url, model_dir, args.devices, args.per_phase, args.certified))
            server_cpu = process_cpu_seconds(running.process.pid) - server_before
            drivers_cpu = time.process_time() - drivers_before
    print(
        f"  over HTTP: round {h['status']} with {h['survivors']} survivors in {h['round_seconds']:.1f} s "
        f"(device outcomes {h['statuses']}); server unmask {h['server_unmask_s']:.2f} s; per device "
        f"up {h['up_kb']:.0f} KB, down {h['down_kb']:.0f} KB "
        f"(a plaintext report: {h['plaintext_up_kb']:.0f} KB up); phases (s): {h['phases']}; "
        f"CPU (enrolment and check-ins included): server {server_cpu:.1f} s, drivers {drivers_cpu:.1f} s"
    )
    return 0 if h["status"] == "committed" else 1


if __name__ == "__main__":
    sys.exit(main())
