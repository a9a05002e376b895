"""A fleet session, whatever the model: reach (or start) the orchestrator, create the population,
run the devices until the rounds are done, run the final evaluation, and let the devices serve."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from android_sim.admin import AdminClient, AdminError
from android_sim.fleet import TRAINING, DeviceSpec, Fleet, FleetOptions, FleetStats
from android_sim.network import Connector
from android_sim.profiles import SimClock
from android_sim.run_config import RunConfig, RunError
from android_sim.small_cohorts import simulation_policy
from android_sim.stall import stall_message
from device_runtime.task_runner import TaskRunner
from enrollment_authority.authority import EnrollmentAuthority
from orchestrator.local import LocalOrchestrator
from orchestrator.populations.settings import PopulationSettings

T = TypeVar("T")
# Settings of the orchestrator a run starts: every simulated phone enrolls from this machine's
# one address, where a real fleet's phones have addresses of their own.
SIMULATED_FLEET_LIMITS: dict[str, int] = {"enrollment_burst": 1_000_000}
# Once the rounds are done, devices get this long to finish what they are doing before they are
# switched off: the run does not wait out a request's timeout and retries.
STOP_GRACE_SECONDS = 5.0


@contextlib.asynccontextmanager
async def orchestrator(
    config: RunConfig, work: Path, console: Console
) -> AsyncIterator[tuple[str, str, Connector]]:
    """(URL, admin token, the devices' connector) of the orchestrator this run talks to."""
    if config.orchestrator_url:
        assert config.admin_token
        yield config.orchestrator_url.rstrip("/"), config.admin_token, Connector()
        return
    token = config.admin_token or secrets.token_urlsafe(32)  # given: to read /metrics while it runs
    work = work.resolve()  # the orchestrator process runs elsewhere: a relative path would not be this one
    database_url = f"sqlite:///{work / 'orchestrator.sqlite'}"
    if config.in_process:
        from pydantic import SecretStr

        from orchestrator.app import create_app
        from orchestrator.settings import Settings

        app = create_app(
            Settings(
                database_url=database_url,
                admin_token=SecretStr(token),
                tick_seconds=0.2,
                **SIMULATED_FLEET_LIMITS,  # type: ignore[arg-type]
            )
        )
        async with app.router.lifespan_context(app):
            connector = Connector(app)
            try:
                yield "http://orchestrator.local", token, connector
            finally:
                await connector.aclose()
        return
    server = LocalOrchestrator(
        database_url, token, log_path=work / "orchestrator.log", settings=SIMULATED_FLEET_LIMITS
    )
    await asyncio.to_thread(server.start)
    console.print(
        f"orchestrator: {server.url} (SQLite {work / 'orchestrator.sqlite'}, log {server.log_path})"
    )
    try:
        yield server.url, token, Connector()
    finally:
        await asyncio.to_thread(server.stop)


async def admin_call(coro: Awaitable[T]) -> T:
    try:
        return await coro
    except AdminError as e:
        raise RunError(str(e)) from None


def progress_line(stats: FleetStats, latest: dict[str, Any] | None) -> str:
    """The fleet's counters and the newest committed training round's loss, and under DP the
    epsilon spent so far, which the operator watches approach the budget."""
    parts = [
        f"reported {stats.total('reported')}",
        f"aborted {stats.total('aborted')}",
        f"vanished {stats.total('vanished')}",
        f"in task {stats.in_task}",
    ]
    if latest:
        metrics = latest["metrics"]
        metric = "query_rmse" if "query_rmse" in metrics and "query_loss" not in metrics else "query_loss"
        if metric in metrics:
            parts.append(f"{metric} {metrics[metric]:.4f}")
        if "dp_epsilon" in metrics:
            parts.append(f"epsilon {metrics['dp_epsilon']:.2f}")
    if stats.waiting_for_server:
        parts.append("[yellow]waiting for the orchestrator[/]")
    return " | ".join(parts)


class Monitor:
    """Watches the population's rounds through the admin API and drives the progress display."""

    def __init__(
        self, admin: AdminClient, population: str, fleet: Fleet, progress: Progress, stall: float
    ) -> None:
        self.admin = admin
        self.population = population
        self.fleet = fleet
        self.progress = progress
        self.stall_seconds = stall
        self.task = progress.add_task("training rounds", total=None)

    async def wait_for_rounds(self, start: int, rounds: int, fleet_task: asyncio.Task[None]) -> None:
        self.progress.update(self.task, total=rounds)
        last_change, last_count, last_printed = time.monotonic(), -1, -1
        while True:
            if fleet_task.done():
                fleet_task.result()  # raises what stopped the fleet
                raise RunError("the fleet stopped before the rounds were done")
            try:
                status = await self.admin.status(self.population)
            except AdminError as e:
                status = None
                self.fleet.stats.last_error = str(e)
            if status is not None:
                self.fleet.evaluation_round = _open_evaluation(status)
                done = status["training_rounds_committed"] - start
                if done != last_count:
                    last_change, last_count = time.monotonic(), done
                latest = await _latest_training_round(self.admin, self.population)
                description = progress_line(self.fleet.stats, latest)
                self.progress.update(self.task, completed=min(done, rounds), description=description)
                if not self.progress.console.is_terminal and done != last_printed and done and done % 10 == 0:
                    # No live display in a log file: a line every ten rounds instead.
                    self.progress.console.print(f"round {done}/{rounds}: {description}")
                    last_printed = done
                if done >= rounds:
                    return
                privacy = status.get("privacy")
                if privacy and privacy["budget_spent"]:
                    self.progress.console.print(f"[yellow]{privacy['message']}[/]")
                    return
            if time.monotonic() - last_change > self.stall_seconds:
                raise RunError(
                    stall_message(
                        self.stall_seconds, await self._closed_since_commit(), self.fleet.stats.last_error
                    )
                )
            await asyncio.sleep(0.5)

    async def _closed_since_commit(self) -> list[dict[str, Any]]:
        """The training rounds abandoned since the last commit (newest 100), for the stall's cause."""
        try:
            listed = await self.admin.rounds(self.population, kind="training", limit=100)
        except AdminError:
            return []
        closed = []
        for r in reversed(listed):  # AdminClient.rounds lists them oldest first
            if r["status"] == "committed":
                break
            if r["status"] == "abandoned":
                closed.append(r)
        return closed

    async def final_evaluation(self, duration: float, timeout: float) -> dict[str, Any] | None:
        """Open an evaluation round on the held-out devices, taking reports for `duration` seconds,
        and wait for it to close; an evaluation round still open (the last training round's commit
        may have opened one, for the population's shorter time) closes first. None when it does not
        close in time, or cannot open (a DP population whose budget is spent: an evaluation's sums
        are not noised, so the server runs none)."""
        deadline = time.monotonic() + timeout
        evaluation: dict[str, Any] | None = None
        while evaluation is None:
            try:
                evaluation = await self.admin.schedule_evaluation(self.population, duration)
            except AdminError as e:
                if "privacy budget is spent" in str(e):
                    self.progress.console.print("[yellow]no final evaluation: the privacy budget is spent[/]")
                    return None
                if "already open" not in str(e):
                    raise RunError(str(e)) from None
                if time.monotonic() >= deadline:
                    return None
                await asyncio.sleep(0.5)  # it closes at its target or its deadline
        self.fleet.evaluation_round = evaluation["id"]
        # Up to a minute of wall time with the defaults: said, so that the run does not look stuck.
        self.progress.update(
            self.task,
            description=f"final evaluation (up to {duration:.0f} s: devices report in their nightly windows)",
        )
        while time.monotonic() < deadline:
            for r in await admin_call(self.admin.rounds(self.population, kind="evaluation", limit=5)):
                if r["id"] == evaluation["id"] and r["status"] != "open":
                    return r
            await asyncio.sleep(0.5)
        return None


def _open_evaluation(status: dict[str, Any]) -> int | None:
    return next((int(r["id"]) for r in status["open_rounds"] if r["kind"] == "evaluation"), None)


async def _latest_training_round(admin: AdminClient, population: str) -> dict[str, Any] | None:
    try:
        rounds = await admin.rounds(population, kind="training", limit=5)
    except AdminError:
        return None
    committed = [r for r in rounds if r["status"] == "committed"]
    return committed[-1] if committed else None  # AdminClient.rounds: oldest first


@dataclass
class FleetRun(Generic[T]):
    """What a fleet run left: the fleet (its devices, their counters), the population's status and
    this run's rounds, the final evaluation round, and what the devices served after it (`serve`)."""

    fleet: Fleet
    status: dict[str, Any]
    rounds: list[dict[str, Any]]
    final: dict[str, Any] | None
    served: T
    attached: dict[str, Any] | None  # what `attach` returned (e.g. the mixing strategy attached)


def make_fleet(
    config: RunConfig,
    url: str,
    connector: Connector,
    specs: list[DeviceSpec],
    cache_dir: Path,
    runner: TaskRunner,
    clock: SimClock,
    options: FleetOptions,
) -> Fleet:
    """The fleet in this process, or sharded over `config.shards` Ray actors."""
    if config.shards < 2:
        return Fleet(url, connector, specs, cache_dir, runner, clock, options)
    from android_sim.ray_fleet import RayFleet  # Ray is an optional extra

    fleet = RayFleet(url, connector, specs, cache_dir, runner, clock, options)
    return fleet.start(config.shards, max(1, config.workers // config.shards), config.ray_address)


async def run_fleet(
    config: RunConfig,
    name: str,
    model_dir: Path,
    specs: list[DeviceSpec],
    settings: dict[str, Any],
    serve: Callable[[Fleet, dict[str, Any]], Awaitable[T]],
    console: Console,
    attach: Callable[[AdminClient], Awaitable[dict[str, Any] | None]] | None = None,
    initial_globals: bytes | None = None,
) -> FleetRun[T]:
    """Whatever the model: start (or reach) the orchestrator, create the population `name` of the
    export in `model_dir` with `settings`, run the devices of `specs` until `config.rounds` training
    rounds have committed, run the final evaluation, then `serve(fleet, status)` while the devices
    can still reach the server (e.g. held-out devices' top-10 with the final model). `attach` adds
    to the population before the devices start (e.g. a centralized dataset to mix in);
    `initial_globals` (safetensors, checked) replace the export's as a new population's version 0."""
    work = config.work_dir
    async with orchestrator(config, work, console) as (url, token, connector):
        admin = AdminClient(url, token, transport=connector.transport()[0])
        await admin_call(admin.ping())
        population = await admin_call(admin.ensure_population(name, model_dir, settings, initial_globals))
        if population["settings"] != PopulationSettings(**settings).model_dump():
            console.print(f"[yellow]population {name!r} exists: reusing it with its own settings[/]")
        attached = await attach(admin) if attach is not None else None
        start_committed = int(population["training_rounds_committed"])
        limit = population["settings"].get("max_training_rounds")
        if limit is not None and limit < start_committed + config.rounds:
            # A population reused from an earlier run stopped at that run's count: this run's go on.
            wanted = {"max_training_rounds": start_committed + config.rounds}
            population = await admin_call(admin.change_settings(name, wanted, "android_sim run"))
        closed_before = {r["id"] for r in await admin_call(admin.rounds(name)) if r["status"] != "open"}
        console.print(
            f"population {name!r}: model version {population['current_version']}, "
            f"{start_committed} rounds committed before this run"
        )
        with TaskRunner(config.workers) as runner:
            fleet = make_fleet(
                config,
                url,
                connector,
                specs,
                work / "model-cache",
                runner,
                SimClock(
                    config.day_seconds, start=float(np.random.default_rng(config.seed).uniform(0, 86_400))
                ),
                FleetOptions(
                    population=name,
                    cooldown_hours=config.cooldown_hours,
                    seed=config.seed,
                    seen_devices_evaluate=config.stateful,
                    privacy_policy=simulation_policy(config.aggregation, certified_roster=True),
                    # One authority for the run (its shards too): devices trust it, the server relays.
                    enrollment_authority=EnrollmentAuthority(),
                ),
            )
            fleet_task: asyncio.Task[None] | None = None
            try:
                await fleet.enroll()
                # What exists now (the modules, the devices and their clients) lives for the whole
                # run: frozen out of the collector, a full collection no longer walks it with the
                # event loop stopped (pauses of 183-207 ms before, 84-88 ms after; README).
                gc.freeze()
                fleet_task = asyncio.create_task(fleet.run())
                columns = (
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                )
                # Twice a second, not Rich's 10: its refresh thread renders holding the GIL, and
                # at 10 it took 3% of the fleet process's CPU in a secure main job (py-spy).
                with Progress(*columns, console=console, transient=False, refresh_per_second=2) as progress:
                    monitor = Monitor(admin, name, fleet, progress, config.stall_seconds)
                    await monitor.wait_for_rounds(start_committed, config.rounds, fleet_task)
                    if config.stateful:
                        fleet.training_paused = True  # the seen devices evaluate, then rest
                    else:
                        fleet.stop([TRAINING])
                    # A simulated day at least: a device takes part only in its nightly charging
                    # window, in its own time zone, and a round of the population's 10 s (4 simulated
                    # hours) evaluated whoever's night the run ended in: 7 of the 150 held-out devices
                    # reported from simulated 13:36 UTC, 40 (its target) from 00:06. It closes at its
                    # target before.
                    duration = max(config.round_seconds, config.day_seconds)
                    final = await monitor.final_evaluation(duration, duration + config.round_seconds * 2 + 5)
                if await fleet.switch_off(STOP_GRACE_SECONDS):
                    console.print(
                        f"[yellow]{fleet.stats.switched_off} devices were still busy "
                        f"{STOP_GRACE_SECONDS:.0f} s after the run ended and were switched off[/]"
                    )
                await fleet_task
                status = await admin_call(admin.status(name))
                rounds = [r for r in await admin_call(admin.rounds(name)) if r["id"] not in closed_before]
                served = await serve(fleet, status)
            finally:
                fleet.stop()
                if fleet_task is not None:
                    # Let every device finish its request before the connections close.
                    await asyncio.gather(fleet_task, return_exceptions=True)
                await fleet.aclose()
                await admin.aclose()
                gc.unfreeze()  # the run's objects may go once it is over (runs in one process, tests)
    return FleetRun(fleet, status, rounds, final, served, attached)
