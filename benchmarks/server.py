"""Orchestrator benchmark: one server process on SQLite, a 3,706 x 50 model, load over loopback.

    ./dev bench-orchestrator        (or: python -m benchmarks.server)

Prints:
- check-ins/s: accepted check-ins (each creates an assignment) from many concurrent devices;
- reports/s: training reports (the sparse delta a device uploads: the 150 rows of 3,706 that a
  client changed), each validated, stored, and aggregated when its round commits (every 100th
  report commits a round: a new model version);
- aggregation throughput: bytes of deltas (dense-equivalent) per second through the server's own
  aggregation pipeline (`Pipeline`, assembled from a population's default settings: robust
  clipping and weight caps over the streaming weighted mean), in a round that starts from the
  reference norms the round before left, as every round after a population's first does; a dense
  delta is one with every row;
- server RSS every 100 rounds across 1,000 committed rounds (target: flat).
The load generator runs in this process and shares the 2 cores with the server, so the
server-side rates are lower bounds; its CPU time per request is printed too. Targets (issue 3):
>= 1,000 check-ins/s, >= 300 reports/s, >= 1 GB/s aggregation, flat RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from contracts.params import (
    SparseTensor,
    decode_sparse_delta,
    encode_sparse_delta,
)
from model_export.config import ModelConfig
from model_export.in_subprocess import export_in_subprocess
from orchestrator.aggregation.assemble import RoundInputs
from orchestrator.populations.config import pipeline_of
from orchestrator.populations.settings import PopulationSettings
from tests.orchestrator.conftest import Server, admin_create_population

NUM_ITEMS, DIM = 3706, 50


def export(out: Path) -> None:
    config = ModelConfig(num_items=NUM_ITEMS, embedding_dim=DIM, batch_size=5, max_batches=64)
    export_in_subprocess(config, out)


def client_delta(rng: np.random.Generator) -> dict[str, np.ndarray]:
    delta = np.zeros((NUM_ITEMS, DIM), np.float32)
    rows = rng.choice(NUM_ITEMS, 150, replace=False)
    delta[rows] = rng.normal(0, 0.01, (150, DIM)).astype(np.float32)
    return {"item_embeddings": delta}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def http_request(host: str, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> bytes:
    """An HTTP/1.1 request, written by hand (see Load)."""
    payload = body or b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(payload)}\r\n"
    return (head + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode() + payload


async def read_answer(reader: asyncio.StreamReader, status_line: bytes) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 answer whose status line was read."""
    status, length = int(status_line.split()[1]), 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


class Load:
    """Keep-alive HTTP/1.1 connections on one asyncio event loop, requests written and answers
    parsed by hand, so that the load generator takes as little as possible of the two cores it
    shares with the server (about 0.25 ms of CPU a request with the JSON of the answers, printed
    with the figures; http.client on a thread pool took 0.35-0.4 ms)."""

    def __init__(self, url: str, concurrency: int) -> None:
        parsed = urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.concurrency = concurrency
        self.loop = asyncio.new_event_loop()
        self.cpu_seconds, self.requests = 0.0, 0  # the generator's own cost
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(
        self,
        requests: list[tuple[str, str, bytes | None, dict[str, str]]],
        next_index: Iterator[int],
        answers: list[tuple[int, bytes]],
    ) -> None:
        # Connections are kept open across runs, as a device's client keeps its connection.
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        for i in next_index:
            request = http_request(self.host, *requests[i])
            writer.write(request)
            status_line = await reader.readline()
            if not status_line:  # the server closed the idle connection (keep-alive timeout): reopen
                writer.close()
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(request)
                status_line = await reader.readline()
            answers[i] = await read_answer(reader, status_line)
        self.idle.append((reader, writer))

    async def _run(
        self, requests: list[tuple[str, str, bytes | None, dict[str, str]]]
    ) -> list[tuple[int, bytes]]:
        answers: list[tuple[int, bytes]] = [(0, b"")] * len(requests)
        next_index = iter(range(len(requests)))  # shared: each connection takes the next request
        connections = min(self.concurrency, len(requests))
        await asyncio.gather(*(self._connection(requests, next_index, answers) for _ in range(connections)))
        return answers

    def run(
        self, requests: list[tuple[str, str, bytes | None, dict[str, str]]]
    ) -> tuple[float, list[tuple[int, bytes]]]:
        """(requests per second, answers) for `requests` sent concurrently."""
        start, cpu = time.perf_counter(), time.process_time()
        answers = self.loop.run_until_complete(self._run(requests))
        self.cpu_seconds += time.process_time() - cpu
        self.requests += len(requests)
        return len(requests) / (time.perf_counter() - start), answers

    def enroll(self, n: int) -> list[str]:
        _, answers = self.run([("POST", "/v1/devices", None, {})] * n)
        return [json.loads(body)["token"] for _, body in answers]

    def checkin(self, population: str, tokens: list[str]) -> tuple[float, list[dict[str, Any]]]:
        body = json.dumps({"example_count": 300}).encode()
        rate, answers = self.run(
            [
                (
                    "POST",
                    f"/v1/populations/{population}/checkin",
                    body,
                    {"Authorization": f"Bearer {t}", "Content-Type": "application/json"},
                )
                for t in tokens
            ]
        )
        assert all(status == 200 for status, _ in answers), answers[:3]
        return rate, [json.loads(b) for _, b in answers]

    def report(self, jobs: list[tuple[str, str, bytes]]) -> float:
        rate, answers = self.run(
            [
                (
                    "POST",
                    report_url,
                    body,
                    {"Authorization": f"Bearer {t}", "Content-Type": "application/octet-stream"},
                )
                for t, report_url, body in jobs
            ]
        )
        refused = [(s, b[:200]) for s, b in answers if s != 200]
        if refused:
            raise RuntimeError(f"{len(refused)} reports refused, e.g. {refused[0]}")
        return rate


def bench_aggregation(repeats: int) -> dict[str, float]:
    """Dense-equivalent GB/s of `repeats` contributions through one round of the server's pipeline."""
    shapes = {"item_embeddings": (NUM_ITEMS, DIM)}
    pipeline = pipeline_of(PopulationSettings.model_validate({}), shapes)
    rng = np.random.default_rng(0)
    deltas = [client_delta(rng) for _ in range(8)]
    nbytes = deltas[0]["item_embeddings"].nbytes
    every_row = np.arange(NUM_ITEMS, dtype=np.int32)
    dense = [{k: SparseTensor(v.shape, every_row, v) for k, v in d.items()} for d in deltas]
    sparse = [decode_sparse_delta(encode_sparse_delta(d)) for d in deltas]
    # The round before: it leaves the reference norms a round's clipping starts from.
    before = RoundInputs(rounds_committed=0, weights=[10.0] * len(sparse))
    reference = pipeline.aggregate(before, [(delta, 10.0) for delta in sparse]).norm_reference
    rates = {}
    for name, contributions in (("dense_gb_s", dense), ("sparse_dense_equivalent_gb_s", sparse)):
        inputs = RoundInputs(rounds_committed=1, weights=[10.0] * repeats, reference=reference)
        start = time.perf_counter()
        pipeline.aggregate(inputs, ((contributions[i % 8], 10.0) for i in range(repeats)))
        rates[name] = repeats * nbytes / (time.perf_counter() - start) / 1e9
    return rates


def load(url: str, model_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(1)
    # What a device uploads: the rows its task changed (TFLiteModel.update, orchestrator_client).
    body = encode_sparse_delta(client_delta(rng), {"num_examples": "150", "metrics": "{}"})
    results: dict[str, object] = {"report_body_bytes": len(body)}
    client = Load(url, args.concurrency)
    # Check-ins: one big round so that every check-in is accepted and creates an assignment.
    r = admin_create_population(
        url, model_dir, "checkins", json.dumps({"target_reports": 100_000, "oversampling": 1.0})
    )
    assert r.status_code == 201, r.text
    tokens = client.enroll(args.checkins)
    rates = []
    for chunk in np.array_split(np.array(tokens), 3):
        rate, answers = client.checkin("checkins", [str(t) for t in chunk])
        assert all(a["accepted"] for a in answers)
        rates.append(rate)
    results["checkins_per_s"] = statistics.median(rates)

    # Reports: rounds of 100, each committing (aggregation and a new model version) at its 100th.
    r = admin_create_population(
        url, model_dir, "reports", json.dumps({"target_reports": 100, "oversampling": 1.0})
    )
    assert r.status_code == 201, r.text
    rates = []
    for _ in range(args.report_rounds):
        tokens = client.enroll(100)
        _, answers = client.checkin("reports", tokens)
        rates.append(
            client.report([(t, a["report_url"], body) for t, a in zip(tokens, answers, strict=True)])
        )
    results["reports_per_s"] = statistics.median(rates)

    # RSS across many committed rounds of one report each.
    r = admin_create_population(
        url, model_dir, "soak", json.dumps({"target_reports": 1, "oversampling": 1.0})
    )
    assert r.status_code == 201, r.text
    token = client.enroll(1)[0]
    samples = []
    for i in range(args.rounds):
        _, (answer,) = client.checkin("soak", [token])
        client.report([(token, answer["report_url"], body)])
        if (i + 1) % max(1, args.rounds // 10) == 0:
            samples.append(round(rss_mb(args.server_pid), 1))
    results["rss_mb_every_tenth"] = samples
    results["load_generator_cpu_ms_per_request"] = 1000 * client.cpu_seconds / client.requests
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkins", type=int, default=3000)
    parser.add_argument("--report-rounds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    aggregation = bench_aggregation(400)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        export(model_dir)
        # The load comes from one address and reuses devices far faster than a fleet would:
        # the figures are the server's throughput, not its rate limits.
        limits = {"enrollment_burst": 1_000_000, "checkin_burst": 1_000_000}
        server = Server(Path(tmp) / "orchestrator.sqlite", settings=limits).start()
        try:
            assert server.process is not None
            args.server_pid = server.process.pid
            figures = load(server.url, model_dir, args)
        finally:
            server.stop()
    figures.update(aggregation)
    samples = figures["rss_mb_every_tenth"]
    assert isinstance(samples, list)
    rows = [
        ("check-ins/s (accepted, median of 3 batches)", f"{figures['checkins_per_s']:.0f}", ">= 1000"),
        ("reports/s (validate + store + commit, median)", f"{figures['reports_per_s']:.0f}", ">= 300"),
        ("aggregation, dense deltas (GB/s)", f"{aggregation['dense_gb_s']:.2f}", ">= 1"),
        (
            "aggregation, stored sparse deltas (dense-equiv. GB/s)",
            f"{aggregation['sparse_dense_equivalent_gb_s']:.2f}",
            "",
        ),
        (f"server RSS MB, every {args.rounds // 10} of {args.rounds} rounds", str(samples), "flat"),
        ("RSS growth, first to last sample (MB)", f"{samples[-1] - samples[0]:+.1f}", "~0"),
        ("load generator CPU per request (ms)", f"{figures['load_generator_cpu_ms_per_request']:.3f}", ""),
        ("report body (bytes)", str(figures["report_body_bytes"]), ""),
    ]
    setup = f"{NUM_ITEMS} x {DIM}, SQLite, one server process, {args.concurrency} clients"
    print(f"orchestrator benchmark ({setup})")
    for label, value, target in rows:
        print(f"  {label:<55} {value:>10}   {'target ' + target if target else ''}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
