"""Load benchmark: 1,200 simulated devices, 30% of them dropping out, against the orchestrator on
loopback; SQLite with one server process, and PostgreSQL with 1, 2 and 4.

    flock /tmp/cpu.lock python -m benchmarks.load --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres

A device's visit: check in; if accepted, 70% report a sparse delta (150 changed rows of a 3,706 x
50 model), 15% abort and 15% vanish (their assignment is dropped at the deadline). Rounds of 100
reports with oversampling 1.6, so that the 70% who report fill a round. Per deployment:
- closed loop: `--concurrency` visits at a time, back to back, for `--seconds`: check-ins/s and
  reports/s sustained, p50/p99 latency of each;
- open loop: visits started at `--rate` per second whatever the answers, for `--seconds`: p50/p99
  check-in latency at that rate (the target: p99 <= 100 ms at 500/s).
The server runs in its own processes (`python -m orchestrator serve --workers N`); the load
generator is this process: one asyncio event loop writing HTTP/1.1 by hand on keep-alive
connections. Both share the machine's cores, so the CPU each used is printed: seconds per request
of the generator and of the orchestrator processes, and the machine's busy share over the phase
(PostgreSQL's own processes are in that share, not in the orchestrator's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from benchmarks.server import client_delta, export, http_request, read_answer
from contracts.params import encode_sparse_delta
from orchestrator.local import LocalOrchestrator
from tests.orchestrator.conftest import ADMIN_TOKEN, admin_create_population

SETTINGS = {
    "target_reports": 100,
    "oversampling": 1.6,
    "round_duration_seconds": 20.0,
    "retry_after_seconds": 0,
}
DROPOUT, ABORT = 0.30, 0.15  # of accepted devices: 15% abort, 15% vanish


CONNECTION_LOST = 0  # the status noted for a request whose connection failed: no answer


@dataclass
class Measured:
    latencies: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds, answered only
    statuses: dict[int, int] = field(default_factory=dict)

    def note(self, kind: str, seconds: float, status: int) -> None:
        if status != CONNECTION_LOST:
            self.latencies.setdefault(kind, []).append(seconds)
        self.statuses[status] = self.statuses.get(status, 0) + 1


class Connections:
    """Keep-alive connections to the server, handed out one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def send(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """(status, body); (CONNECTION_LOST, b"") when the connection failed mid-request (reset
        under load): the connection is dropped, not reused, and the request is not sent again,
        since the server may have acted on it (a report counted)."""
        request = http_request(self.host, method, path, body, headers)
        writer: asyncio.StreamWriter | None = None
        try:
            if self.idle:
                reader, writer = self.idle.pop()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(request)
            status_line = await reader.readline()
            if not status_line:  # the server closed the idle connection (keep-alive timeout): reopen
                writer.close()
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(request)
                status_line = await reader.readline()
            answer = await read_answer(reader, status_line)
        except (OSError, asyncio.IncompleteReadError, IndexError, ValueError):
            # OSError covers ConnectionResetError and refused connections; the others, an answer
            # cut short. Either way this connection's state is unknown: a new one replaces it.
            if writer is not None:
                writer.close()
            return CONNECTION_LOST, b""
        self.idle.append((reader, writer))
        return answer

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def visit(conns: Connections, token: str, body: bytes, rng: random.Random, measured: Measured) -> None:
    """One device: check in, then report, abort or vanish."""
    auth = {"Authorization": f"Bearer {token}"}
    start = time.perf_counter()
    status, answer = await conns.send(
        "POST",
        "/v1/populations/load/checkin",
        b'{"example_count": 300}',
        {**auth, "Content-Type": "application/json"},
    )
    measured.note("checkin", time.perf_counter() - start, status)
    assignment = json.loads(answer) if status == 200 else {}
    if not assignment.get("accepted"):
        return
    fate = rng.random()
    if fate < ABORT:
        kind, path, payload = "abort", assignment["abort_url"], None
    elif fate < DROPOUT:
        return  # vanishes
    else:
        kind, path, payload = "report", assignment["report_url"], body
    start = time.perf_counter()
    status, _ = await conns.send("POST", path, payload, {**auth, "Content-Type": "application/octet-stream"})
    measured.note(kind, time.perf_counter() - start, status)


async def closed_loop(
    conns: Connections, tokens: list[str], body: bytes, concurrency: int, seconds: float
) -> Measured:
    measured, queue, end = Measured(), list(tokens), time.perf_counter() + seconds
    rng = random.Random(1)

    async def worker() -> None:
        while time.perf_counter() < end:
            token = queue.pop(0)
            await visit(conns, token, body, rng, measured)
            queue.append(token)  # back of the line: the next visit is another device's

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return measured


async def open_loop(
    conns: Connections, tokens: list[str], body: bytes, rate: float, seconds: float
) -> Measured:
    measured, rng = Measured(), random.Random(2)
    visits: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        # Visits start on schedule, whatever the server's answers so far.
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        visits.append(asyncio.create_task(visit(conns, tokens[i % len(tokens)], body, rng, measured)))
    await asyncio.gather(*visits)  # a visit that raises fails the benchmark
    return measured


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def postgres_cpu_seconds(postmaster: int | None) -> float:
    """CPU of a local PostgreSQL server: its backends, and those that exited (the postmaster
    reaps them, so their time is in its children's)."""
    if postmaster is None:
        return float("nan")
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return reaped + cpu_seconds(server_pids(postmaster))


def local_postmaster(database_url: str) -> int | None:
    """The pid of the PostgreSQL server's postmaster if it runs on this machine (the parent of a
    backend that /proc shows as postgres), else None."""
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            with contextlib.suppress(OSError):
                if Path(f"/proc/{backend}/comm").read_text().strip().startswith("postgres"):
                    return int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
    finally:
        engine.dispose()
    return None


def server_pids(parent: int) -> list[int]:
    """The server's parent process and its workers."""
    pids = [parent]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(stat.parent.name))
    return pids


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU ticks of the whole machine so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


class BackendStates:
    """Samples what the orchestrator's PostgreSQL connections are doing (pg_stat_activity, every
    20 ms, on a thread): of those inside a transaction, the share waiting for a lock, waiting for
    the orchestrator's next statement (`idle in transaction`: the server process is busy in Python
    or waits for the CPU meanwhile), or running in PostgreSQL. This says what bounds a deployment
    that does not use the cores."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(database_url, poolclass=NullPool)
        self.counts: dict[str, int] = {}
        self.lock_waits: dict[str, int] = {}  # the statement that waits, e.g. "UPDATE rounds"
        self.samples = 0  # each is a transaction of its own in the database's statistics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        query = text(
            "SELECT state, wait_event_type, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND (state = 'active' OR state LIKE 'idle in transaction%')"
        )
        with self.engine.connect() as conn:
            while not self._stop.wait(0.02):
                for state, wait, statement in conn.execute(query):
                    if wait == "Lock":
                        waiter = statement_kind(statement)
                        self.lock_waits[waiter] = self.lock_waits.get(waiter, 0) + 1
                    kind = (
                        "waiting for a lock"
                        if wait == "Lock"
                        else "waiting for the orchestrator"
                        if state != "active"
                        else "running"
                    )
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                self.samples += 1
                conn.rollback()  # a fresh snapshot of pg_stat_activity next time

    def __enter__(self) -> BackendStates:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()

    def shares(self) -> dict[str, float]:
        total = sum(self.counts.values()) or 1
        return {kind: n / total for kind, n in sorted(self.counts.items())}

    def lock_wait_shares(self) -> dict[str, float]:
        """Of the samples waiting for a lock, the share of each statement kind."""
        total = sum(self.lock_waits.values()) or 1
        return {kind: n / total for kind, n in sorted(self.lock_waits.items(), key=lambda kv: -kv[1])}


def statement_kind(statement: str) -> str:
    """ "SELECT rounds FOR UPDATE", "UPDATE rounds", ...: a statement's verb, first table, lock."""
    words = statement.replace(",", " ").replace("(", " ").split()
    verb = words[0].upper() if words else "?"
    after = {"SELECT": "FROM", "UPDATE": "UPDATE", "INSERT": "INTO", "DELETE": "FROM"}.get(verb)
    upper = [w.upper() for w in words]
    table = words[upper.index(after) + 1] if after in upper[: len(upper) - 1] else ""
    locked = " FOR UPDATE" if verb == "SELECT" and "FOR" in upper and "UPDATE" in upper else ""
    return f"{verb} {table}{locked}".strip()


def transaction_counts(database_url: str) -> tuple[int, int, int]:
    """(commits, rollbacks, deadlocks) of the database so far, from pg_stat_database. A backend
    reports its counts at most once a second while busy, and all of them when it exits: read
    after the server's connections have closed, they are exact."""
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT xact_commit, xact_rollback, deadlocks FROM pg_stat_database "
                    "WHERE datname = current_database()"
                )
            ).one()
    finally:
        engine.dispose()
    return int(row[0]), int(row[1]), int(row[2])


@dataclass
class Phase:
    """A phase's figures."""

    measured: Measured
    seconds: float
    generator_cpu: float
    server_cpu: float
    busy_share: float
    postgres_cpu: float = float("nan")  # a local PostgreSQL server's, else NaN
    backend_states: dict[str, float] = field(default_factory=dict)
    lock_waits: dict[str, float] = field(default_factory=dict)
    sampler_transactions: int = 0  # BackendStates' own, to leave out of the database's counts

    def rate(self, kind: str) -> float:
        return len(self.measured.latencies.get(kind, [])) / self.seconds

    def requests(self) -> int:
        return sum(len(v) for v in self.measured.latencies.values())


async def measure(
    pids: list[int], phase: Coroutine[Any, Any, Measured], postmaster: int | None = None
) -> Phase:
    cpu0, server0, busy0 = time.process_time(), cpu_seconds(pids), machine_busy()
    postgres0 = postgres_cpu_seconds(postmaster)
    start = time.perf_counter()
    measured = await phase
    seconds = time.perf_counter() - start
    busy1 = machine_busy()
    return Phase(
        measured,
        seconds,
        time.process_time() - cpu0,
        cpu_seconds(pids) - server0,
        (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
        postgres_cpu_seconds(postmaster) - postgres0,
    )


async def drive(
    port: int, pids: list[int], body: bytes, args: argparse.Namespace, database_url: str
) -> tuple[Phase, Phase]:
    conns = Connections("127.0.0.1", port)
    tokens: list[str] = []

    async def enroll(count: int) -> None:
        for _ in range(count):
            _, answer = await conns.send("POST", "/v1/devices", None, {})
            tokens.append(json.loads(answer)["token"])

    # As many connections as the closed loop keeps busy; more would only sit idle.
    share = -(-args.devices // args.concurrency)
    await asyncio.gather(
        *(enroll(max(0, min(share, args.devices - i * share))) for i in range(args.concurrency))
    )
    if database_url.startswith("postgresql"):
        postmaster = local_postmaster(database_url)
        with BackendStates(database_url) as states:
            closed = await measure(
                pids, closed_loop(conns, tokens, body, args.concurrency, args.seconds), postmaster
            )
        closed.backend_states = states.shares()
        closed.lock_waits = states.lock_wait_shares()
        closed.sampler_transactions = states.samples
    else:
        closed = await measure(pids, closed_loop(conns, tokens, body, args.concurrency, args.seconds))
    opened = await measure(pids, open_loop(conns, tokens, body, args.rate, args.seconds))
    conns.close()
    return closed, opened


@contextlib.contextmanager
def database(kind: str, postgres_url: str | None, tmp: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp / f'load-{secrets.token_hex(4)}.sqlite'}"
        return
    assert postgres_url
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    name = f"bench_load_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_deployment(
    kind: str, workers: int, model_dir: Path, args: argparse.Namespace, tmp: Path
) -> tuple[Phase, Phase, dict[str, float]]:
    """The closed and open loops' figures, and on PostgreSQL the database's transactions over the
    whole run (enrollment, both loops)."""
    body = encode_sparse_delta(
        client_delta(np.random.default_rng(0)), {"num_examples": "150", "metrics": "{}"}
    )
    with database(kind, args.postgres_url, tmp) as url:
        # The per-device and per-address rate limits are raised out of the way: the simulated
        # devices all come from one address, and each checks in more often than a real one would.
        limits = {
            "enrollment_burst": args.devices,
            "checkin_burst": 1000,
            "checkins_per_second": 100.0,
        }
        server = LocalOrchestrator(
            url, ADMIN_TOKEN, workers=workers, log_path=tmp / f"{kind}-{workers}.log", settings=limits
        )
        with server:
            assert server.process is not None
            created = admin_create_population(server.url, model_dir, "load", json.dumps(SETTINGS))
            assert created.status_code == 201, created.text
            time.sleep(1.0)  # every worker is up (the first answer may come from the first one started)
            closed, opened = asyncio.run(drive(server.port, server_pids(server.process.pid), body, args, url))
        if kind == "sqlite":
            return closed, opened, {}
        time.sleep(0.5)  # the server's backends have exited (and reported their counts)
        commits, rollbacks, deadlocks = transaction_counts(url)
        rollbacks -= closed.sampler_transactions
        requests = args.devices + closed.requests() + opened.requests()  # enrollments, then visits
        return (
            closed,
            opened,
            {
                "pg_transactions_per_request": (commits + rollbacks) / requests,
                "pg_rollbacks_per_1000_requests": 1000 * rollbacks / requests,
                "pg_deadlocks": float(deadlocks),
            },
        )


def process_counts(text: str) -> list[int]:
    """--workers: server process counts separated by commas, each 1-64."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(1 <= n <= 64 for n in counts):
        raise argparse.ArgumentTypeError(
            f"{text!r}; expected process counts from 1 to 64 separated by commas, e.g. 1,2,4"
        )
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--postgres-url", default=os.environ.get("TEST_POSTGRES_URL"), help="an admin URL")
    parser.add_argument("--devices", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=float, default=500.0, help="open loop: visits started per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--workers", type=process_counts, default=[1, 2, 4], help="PostgreSQL server processes to try"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    deployments = [("sqlite", 1)]
    if args.postgres_url:
        deployments += [("postgresql", n) for n in args.workers]
    else:
        print("no --postgres-url (or TEST_POSTGRES_URL): SQLite only", file=sys.stderr)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "model"
        model_dir.mkdir()
        export(model_dir)
        for kind, workers in deployments:
            closed, opened, database_counts = run_deployment(kind, workers, model_dir, args, tmp)
            c, o = closed.measured.latencies, opened.measured.latencies
            errors = sum(
                n
                for status, n in [*closed.measured.statuses.items(), *opened.measured.statuses.items()]
                if status >= 500
            )
            results[f"{kind}, {workers} process{'es' if workers > 1 else ''}"] = {
                "checkins_per_s": closed.rate("checkin"),
                "reports_per_s": closed.rate("report"),
                "checkin_p50_ms": percentile(c["checkin"], 50),
                "checkin_p99_ms": percentile(c["checkin"], 99),
                "report_p50_ms": percentile(c.get("report", []), 50),
                "report_p99_ms": percentile(c.get("report", []), 99),
                "open_checkins_per_s": opened.rate("checkin"),
                "open_checkin_p50_ms": percentile(o["checkin"], 50),
                "open_checkin_p99_ms": percentile(o["checkin"], 99),
                "generator_cpu_ms_per_request": 1000 * closed.generator_cpu / closed.requests(),
                "server_cpu_ms_per_request": 1000 * closed.server_cpu / closed.requests(),
                "postgres_cpu_ms_per_request": 1000 * closed.postgres_cpu / closed.requests(),
                "machine_busy_share": closed.busy_share,
                "errors_5xx": float(errors),
                "rate_limited_429": float(
                    closed.measured.statuses.get(429, 0) + opened.measured.statuses.get(429, 0)
                ),
                "connection_errors": float(
                    closed.measured.statuses.get(CONNECTION_LOST, 0)
                    + opened.measured.statuses.get(CONNECTION_LOST, 0)
                ),
                **database_counts,
                **{f"pg_in_transaction_{k.replace(' ', '_')}": v for k, v in closed.backend_states.items()},
                **{f"pg_lock_wait_{k}": v for k, v in closed.lock_waits.items()},
            }
    print(
        f"load benchmark: {args.devices} devices ({DROPOUT:.0%} of the accepted drop out), 3706 x 50 model, "
        f"closed loop {args.concurrency} at a time and open loop {args.rate:.0f} visits/s, "
        f"{args.seconds:.0f} s each"
    )
    header = (
        "deployment",
        "check-ins/s",
        "p50 ms",
        "p99 ms",
        "reports/s",
        "p50 ms",
        "p99 ms",
        f"@{args.rate:.0f}/s p50",
        "p99",
        "gen CPU ms/req",
        "server CPU ms/req",
        "busy",
        "5xx",
        "429",
        "conn errors",
    )
    print(" | ".join(header))
    for name, r in results.items():
        print(
            " | ".join(
                [
                    name,
                    f"{r['checkins_per_s']:.0f}",
                    f"{r['checkin_p50_ms']:.1f}",
                    f"{r['checkin_p99_ms']:.1f}",
                    f"{r['reports_per_s']:.0f}",
                    f"{r['report_p50_ms']:.1f}",
                    f"{r['report_p99_ms']:.1f}",
                    f"{r['open_checkin_p50_ms']:.1f}",
                    f"{r['open_checkin_p99_ms']:.1f}",
                    f"{r['generator_cpu_ms_per_request']:.3f}",
                    f"{r['server_cpu_ms_per_request']:.3f}",
                    f"{r['machine_busy_share']:.0%}",
                    f"{r['errors_5xx']:.0f}",
                    f"{r['rate_limited_429']:.0f}",
                    f"{r['connection_errors']:.0f}",
                ]
            )
        )
    for name, r in results.items():
        states = {
            k.removeprefix("pg_in_transaction_").replace("_", " "): v
            for k, v in r.items()
            if k.startswith("pg_in_transaction_")
        }
        if states:
            print(
                f"{name}, PostgreSQL connections inside a transaction (closed loop): "
                + ", ".join(f"{v:.0%} {k}" for k, v in states.items())
                + f"; whole run: {r['pg_transactions_per_request']:.2f} transactions per request, "
                f"{r['pg_rollbacks_per_1000_requests']:.1f} rolled back per 1000 requests, "
                f"{r['pg_deadlocks']:.0f} deadlocks"
            )
            waits = {
                k.removeprefix("pg_lock_wait_"): v for k, v in r.items() if k.startswith("pg_lock_wait_")
            }
            print(
                f"{name}, what waits for a lock: "
                + ", ".join(f"{v:.0%} {k}" for k, v in waits.items())
                + f"; PostgreSQL CPU {r['postgres_cpu_ms_per_request']:.3f} ms per request"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
