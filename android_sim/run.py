"""`python -m android_sim run`: the whole pipeline, from export to personalized recommendations.

1. Export the model for the data (or reuse an identical export in the work directory).
2. Start a local orchestrator on an SQLite file in the work directory, or use one by URL.
3. Create (or reuse) the population; write one example store per device; enroll the fleet.
4. Run the fleet until `rounds` training rounds have committed; evaluation rounds on the
   held-out devices run along the way (every `evaluation_every`) and once at the end.
5. Write the run report (JSON + plots) and show personalized top-10s next to the global one.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from android_sim import report
from android_sim.admin import AdminClient, AdminError
from android_sim.central_data import centralized_examples
from android_sim.device_data import DeviceData, FleetData, expression_fleet, movielens_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.fleet import HELD_OUT, TRAINING, DeviceSpec, Fleet, FleetOptions, write_store
from android_sim.network import Connector
from android_sim.profiles import DEFAULT_MIX, DeviceClass, SimClock, draw_profiles
from android_sim.recommendations import HitRates, held_out_hit_rates, seen_device_examples, top_k_table
from android_sim.shakespeare import DEFAULT_FOLDER as DEFAULT_SHAKESPEARE
from contracts.manifest import Manifest, ManifestError, load_manifest
from contracts.mixing import MixingConfig, MixingError, encode_examples
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.privacy_policy import PrivacyPolicy
from device_runtime.task_runner import TaskRunner
from model_export.config import Feedback, ModelConfig, TrainingDefaults
from model_export.in_subprocess import export_in_subprocess
from orchestrator.aggregation import ServerOptimizerConfig
from orchestrator.local import LocalOrchestrator
from orchestrator.population_settings import PopulationSettings

T = TypeVar("T")
DEFAULT_RATINGS = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "movielens-100k" / "u.data"
)
SHAKESPEARE = "shakespeare"
# Builder arguments of the next-word model that follow from the run's own options.
RUN_SETS_MODEL_ARGS = {
    "num_global_tokens": "--vocab-size",
    "num_oov_buckets": "--oov-buckets",
    "seq_len": "--seq-len",
}
# Settings of the orchestrator a run starts: every simulated phone enrolls from this machine's
# one address, where a real fleet's phones have addresses of their own.
SIMULATED_FLEET_LIMITS: dict[str, int] = {"enrollment_burst": 1_000_000}
# Once the rounds are done, devices get this long to finish what they are doing before they are
# switched off: the run does not wait out a request's timeout and retries.
STOP_GRACE_SECONDS = 5.0


class RunError(RuntimeError):
    """A problem the user can fix (bad input, no orchestrator, a stalled run); printed without a traceback."""


@dataclass(frozen=True)
class RunConfig:
    work_dir: Path
    # "expressions" (synthetic, implicit), "movielens" (ratings, explicit) or "shakespeare"
    # (next-word prediction, `android_sim.run_next_word`)
    data: str = "expressions"
    ratings: Path = DEFAULT_RATINGS
    # --data shakespeare: the text's folder, the vocabulary's words, the local OOV buckets, the
    # window length, and further keyword arguments of the model's builder (as text, checked by it).
    shakespeare: Path = DEFAULT_SHAKESPEARE
    vocab_size: int = 1000
    oov_buckets: int = 100
    seq_len: int = 20
    model_args: dict[str, str] = field(default_factory=dict)
    devices: int = 1000  # expressions: users; movielens: at most this many users (0 = all)
    expressions: int = 1000
    held_out_fraction: float = 0.15
    rounds: int = 60
    target_reports: int = 40
    oversampling: float = 1.3
    min_examples: int = 3
    round_seconds: float = 10.0
    aggregation: str = "plaintext"  # or "secure": secure aggregation (README, "Privacy")
    # Deadline of the secure phases that need no training (share keys, unmasking): the devices
    # answer within about a second. Check-ins (advertising keys) close at capacity or after half
    # the round's time, and the masked-input phase (training) has the round's time.
    secure_phase_seconds: float = 2.0
    secure_clip_norm: float = 10.0  # L2 bound each device clips its delta to under secure aggregation
    evaluation_every: int = 10
    day_seconds: float = 60.0  # wall seconds per simulated day
    cooldown_hours: float = 2.0  # simulated hours a device rests after it took part
    orchestrator_url: str | None = None
    admin_token: str | None = None
    population: str | None = None
    device_mix: tuple[DeviceClass, ...] = DEFAULT_MIX
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    in_process: bool = False  # the orchestrator app in this process over ASGI (benchmarks)
    stall_seconds: float = 120.0  # give up when no round commits for this long
    seed: int = 0
    show_devices: int = 3
    # The algorithm: task config fields over the data's defaults (split, reuse_below, steps and
    # learning rates, local_state, local_learning_rate, ...), and the server optimizer.
    task: dict[str, Any] = field(default_factory=dict)
    server_optimizer: dict[str, Any] = field(default_factory=dict)

    @property
    def stateful(self) -> bool:
        return self.task.get("local_state") == LocalState.KEEP.value

    # DP-FedAvg (on when clip_norm is set): devices clip to it, the server adds noise to the sum.
    clip_norm: float | None = None
    noise_multiplier: float | None = None
    population_size: int | None = None  # default: the fleet's training devices
    epsilon_budget: float | None = None
    # Adaptive clipping: --clip-norm is then the first round's; the count's noise is reports / 20.
    target_unclipped_quantile: float | None = None
    # Mixing centralized data (contracts.mixing): MixingConfig fields; {} = none. The centralized
    # dataset: `central_examples` public shares by popularity, plus the expressions no training
    # device holds (android_sim/central_data.py).
    mixing: dict[str, Any] = field(default_factory=dict)
    central_examples: int = 2000

    def __post_init__(self) -> None:
        problems = []
        try:
            MixingConfig.from_json(self.mixing)
        except (TypeError, MixingError) as e:
            problems.append(f"mixing: {e}")
        if self.data == SHAKESPEARE and self.mixing.get("strategy", "none") != "none":
            problems.append("mixing runs with the expression and MovieLens data, not with --data shakespeare")
        if self.central_examples < 1:
            problems.append(f"central_examples must be >= 1, got {self.central_examples}")
        try:
            algorithm_task({}, self.task)
        except (TypeError, ValueError) as e:
            problems.append(f"algorithm: {e}")
        if self.server_optimizer:
            try:
                ServerOptimizerConfig.from_json({"name": "sgd", **self.server_optimizer})
            except (TypeError, ValueError) as e:
                problems.append(f"algorithm: {e}")
        if self.data not in ("expressions", "movielens", SHAKESPEARE):
            problems.append(f"data must be 'expressions', 'movielens' or 'shakespeare', got {self.data!r}")
        if self.data == SHAKESPEARE:
            problems += self._next_word_problems()
        elif self.model_args:
            problems.append("--model-arg is for --data shakespeare (the other data export their own model)")
        if not 0 <= self.held_out_fraction < 1:
            problems.append(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        for name in ("rounds", "target_reports", "min_examples", "workers"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.aggregation not in ("plaintext", "secure"):
            problems.append(f"aggregation must be 'plaintext' or 'secure', got {self.aggregation!r}")
        if self.aggregation == "secure" and self.target_reports < 6:
            problems.append("secure aggregation needs target_reports >= 6 (min_reports = target / 2 >= 3)")
        if self.devices < 0 or self.expressions < 2:
            problems.append("devices must be >= 0 and expressions >= 2")
        dp_options = ("noise_multiplier", "population_size", "epsilon_budget", "target_unclipped_quantile")
        if self.clip_norm is None and any(getattr(self, name) is not None for name in dp_options):
            problems.append(
                "--noise-multiplier, --population-size, --epsilon-budget and --target-unclipped-quantile "
                "need --clip-norm"
            )
        if self.clip_norm is not None and self.noise_multiplier is None:
            problems.append("--clip-norm needs --noise-multiplier (0 for clipping without noise)")
        if self.orchestrator_url and not self.admin_token:
            problems.append("an orchestrator URL needs its admin token (--admin-token)")
        if problems:
            raise RunError("; ".join(problems))

    def _next_word_problems(self) -> list[str]:
        problems = [
            f"{name} must be >= 1, got {getattr(self, name)}"
            for name in ("vocab_size", "oov_buckets", "seq_len")
            if getattr(self, name) < 1
        ]
        for key in sorted(set(self.model_args) & set(RUN_SETS_MODEL_ARGS)):
            problems.append(f"--model-arg {key} is set by the run: use {RUN_SETS_MODEL_ARGS[key]}")
        if self.stateful:
            problems.append(
                "--local-state keep is not available with --data shakespeare: its evaluation is on "
                "held-out roles, which a stateful population does not have"
            )
        return problems


@dataclass
class RunResult:
    report_path: Path
    plots: list[Path]
    rounds_committed: int
    final_evaluation: dict[str, float]
    hit_rates: HitRates | None
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)


def load_data(config: RunConfig) -> FleetData:
    if config.data == "movielens":
        return movielens_fleet(config.ratings, config.devices or None)
    return expression_fleet(
        SyntheticConfig(
            num_expressions=config.expressions, num_users=config.devices or 1000, seed=config.seed
        )
    )


def model_config(data: FleetData) -> ModelConfig:
    if data.feedback is Feedback.IMPLICIT:
        return ModelConfig(
            num_items=data.num_items,
            embedding_dim=32,
            batch_size=8,
            max_batches=64,
            top_k=min(100, data.num_items),
            feedback=Feedback.IMPLICIT,
            item_bias=True,
            # Tuned on the synthetic data (held-out hit rate@10 after 80-160 rounds of 40 clients).
            training=TrainingDefaults(
                reconstruction_learning_rate=0.5,
                update_learning_rate=1.0,
                update_max_epochs=5,
                l2_global=1e-4,
                l2_local=1e-3,
            ),
        )
    return ModelConfig(
        num_items=data.num_items,
        top_k=min(100, data.num_items),
        item_bias=True,
        user_bias=True,
        global_mean=True,
        global_mean_init=data.label_mean,
    )


def algorithm_task(base: dict[str, Any], overrides: dict[str, Any]) -> TaskConfig:
    """`overrides` over `base`; a stateful task without its own local learning rate trains the kept
    locals at the reconstruction rate (the rate at which a device fits its locals)."""
    values = {**base, **overrides}
    if values.get("local_state") == LocalState.KEEP.value and "local_learning_rate" not in overrides:
        values["local_learning_rate"] = values.get(
            "reconstruction_learning_rate", TaskConfig.reconstruction_learning_rate
        )
    return TaskConfig.from_json(values)


def server_optimizer(config: RunConfig, data: FleetData) -> dict[str, Any]:
    # Each item row's delta is averaged over every client, most of which never touched it;
    # a server step larger than 1 makes up for that dilution of sparse rows (implicit data).
    default = {"name": "sgd", "learning_rate": 10.0 if data.feedback is Feedback.IMPLICIT else 1.0}
    return optimizer_over(default, config.server_optimizer)


def optimizer_over(default: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """The run's server optimizer choices over the data's default."""
    if chosen.get("name", default["name"]) != default["name"]:
        return dict(chosen)  # another optimizer: none of the default's hyperparameters carry over
    return {**default, **chosen}


def differential_privacy(config: RunConfig, training_devices: int) -> dict[str, Any] | None:
    """The population's DP settings from the run's flags; None without --clip-norm."""
    if config.clip_norm is None:
        return None
    settings: dict[str, Any] = {
        "clip_norm": config.clip_norm,
        "noise_multiplier": config.noise_multiplier,
        "population_size": config.population_size or training_devices,
    }
    if config.epsilon_budget is not None:
        settings["epsilon_budget"] = config.epsilon_budget
    if config.target_unclipped_quantile is not None:
        settings["target_unclipped_quantile"] = config.target_unclipped_quantile
        # Andrew et al.'s suggestion: the count's noise at a twentieth of the reports per round.
        settings["clipped_count_stddev"] = config.target_reports / 20
    return settings


def population_settings(
    config: RunConfig, data: FleetData, model: ModelConfig, training_devices: int = 0
) -> dict[str, Any]:
    task = algorithm_task(
        {
            **{k: v for k, v in asdict(model.training).items()},
            "split": SplitPolicy.ALTERNATE.value,
            # Few examples: use them for both support and query (the keyboard deployment's lesson).
            "reuse_below": 10 if data.feedback is Feedback.IMPLICIT else 0,
            "min_examples": config.min_examples,
        },
        config.task,
    )
    return round_settings(config, task, server_optimizer(config, data), training_devices)


def round_settings(
    config: RunConfig, task: TaskConfig, optimizer: dict[str, Any], training_devices: int
) -> dict[str, Any]:
    """A population's settings from the run's round options, whatever the model: `task` is what
    the devices do, `optimizer` the server optimizer."""
    return {
        "target_reports": config.target_reports,
        "oversampling": config.oversampling,
        "min_reports": max(1, config.target_reports // 2),
        "round_duration_seconds": config.round_seconds,
        "min_examples": config.min_examples,
        "retry_after_seconds": 2.0,
        "server_optimizer": optimizer,
        "task_config": task.to_json(),
        "evaluation_every": config.evaluation_every,
        "evaluation_target_reports": config.target_reports,
        "evaluation_round_duration_seconds": config.round_seconds,
        "aggregation": config.aggregation,
        "secure": {
            "clip_norm": config.secure_clip_norm,
            "advertise_seconds": config.round_seconds / 2,
            # A roster still short of min_reports then waits as long again: a round's check-in
            # time, like a plaintext round's, before it is abandoned.
            "advertise_patience_seconds": config.round_seconds,
            "share_keys_seconds": config.secure_phase_seconds,
            "masked_input_seconds": config.round_seconds,
            "unmasking_seconds": config.secure_phase_seconds,
        },
        "differential_privacy": differential_privacy(config, training_devices),
    }


def export(config: ModelConfig, out: Path) -> Path:
    """Export, unless `out` already holds an export of exactly this config."""
    config_file = out / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()) == config.to_json():
        with contextlib.suppress(ManifestError, OSError):
            load_manifest(out)
            return out
    return export_in_subprocess(config, out)


@dataclass(frozen=True)
class Devices:
    specs: list[DeviceSpec]
    future: dict[int, np.ndarray]  # held-out device index -> items it shares next


def prepare_devices(config: RunConfig, data: FleetData, model: ModelConfig, store_dir: Path) -> Devices:
    rng = np.random.default_rng(config.seed)
    store_dir.mkdir(parents=True, exist_ok=True)
    # A stateful population evaluates on its seen devices' newest examples: no device is held out.
    fraction = 0.0 if config.stateful else config.held_out_fraction
    held_out = set(rng.permutation(len(data.devices))[: round(fraction * len(data.devices))].tolist())
    profiles = draw_profiles(len(data.devices), config.device_mix, rng)
    specs: list[DeviceSpec] = []
    future: dict[int, np.ndarray] = {}
    for i, device in enumerate(data.devices):
        stored: DeviceData = device
        if i in held_out and data.feedback is Feedback.IMPLICIT and len(device) >= 2:
            stored, future[i] = device.split_future(1)
        path = store_dir / f"device-{i:05d}.sqlite"
        write_store(path, stored.events(), model.features())
        specs.append(DeviceSpec(HELD_OUT if i in held_out else TRAINING, profiles[i], path, len(stored)))
    return Devices(specs, future)


@contextlib.asynccontextmanager
async def orchestrator(
    config: RunConfig, work: Path, console: Console
) -> AsyncIterator[tuple[str, str, Connector]]:
    """(URL, admin token, the devices' connector) of the orchestrator this run talks to."""
    if config.orchestrator_url:
        assert config.admin_token
        yield config.orchestrator_url.rstrip("/"), config.admin_token, Connector()
        return
    token = secrets.token_urlsafe(32)
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


async def _admin_call(coro: Awaitable[T]) -> T:
    try:
        return await coro
    except AdminError as e:
        raise RunError(str(e)) from None


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

    def _describe(self, status: dict[str, Any], latest: dict[str, Any] | None) -> str:
        stats = self.fleet.stats
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
        if stats.waiting_for_server:
            parts.append("[yellow]waiting for the orchestrator[/]")
        return " | ".join(parts)

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
                description = self._describe(status, latest)
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
                    f"no training round committed for {self.stall_seconds:.0f} s "
                    f"(last problem: {self.fleet.stats.last_error or 'none'}); are enough devices eligible? "
                    "Try more --devices, a lower --target-reports or --min-examples"
                )
            await asyncio.sleep(0.5)

    async def final_evaluation(self, timeout: float) -> dict[str, Any] | None:
        """Open an evaluation round on the held-out devices and wait for it to close."""
        try:
            evaluation = await self.admin.schedule_evaluation(self.population)
        except AdminError as e:
            if "already open" not in str(e):
                raise RunError(str(e)) from None
            status = await _admin_call(self.admin.status(self.population))
            evaluation = next(r for r in status["open_rounds"] if r["kind"] == "evaluation")
        self.fleet.evaluation_round = evaluation["id"]
        self.progress.update(self.task, description="final evaluation")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in await _admin_call(self.admin.rounds(self.population, kind="evaluation", limit=5)):
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
    return committed[-1] if committed else None


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


async def run_fleet(
    config: RunConfig,
    name: str,
    model_dir: Path,
    specs: list[DeviceSpec],
    settings: dict[str, Any],
    serve: Callable[[Fleet, dict[str, Any]], Awaitable[T]],
    console: Console,
    attach: Callable[[AdminClient], Awaitable[dict[str, Any] | None]] | None = None,
) -> FleetRun[T]:
    """Whatever the model: start (or reach) the orchestrator, create the population `name` of the
    export in `model_dir` with `settings`, run the devices of `specs` until `config.rounds` training
    rounds have committed, run the final evaluation, then `serve(fleet, status)` while the devices
    can still reach the server (e.g. held-out devices' top-10 with the final model). `attach` adds
    to the population before the devices start (e.g. a centralized dataset to mix in)."""
    work = config.work_dir
    async with orchestrator(config, work, console) as (url, token, connector):
        admin = AdminClient(url, token, transport=connector.transport()[0])
        await _admin_call(admin.ping())
        population = await _admin_call(admin.ensure_population(name, model_dir, settings))
        if population["settings"] != PopulationSettings(**settings).model_dump():
            console.print(f"[yellow]population {name!r} exists: reusing it with its own settings[/]")
        attached = await attach(admin) if attach is not None else None
        start_committed = int(population["training_rounds_committed"])
        closed_before = {r["id"] for r in await _admin_call(admin.rounds(name)) if r["status"] != "open"}
        console.print(
            f"population {name!r}: model version {population['current_version']}, "
            f"{start_committed} rounds committed before this run"
        )
        with TaskRunner(config.workers) as runner:
            fleet = Fleet(
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
                    privacy_policy=PrivacyPolicy.for_simulation(config.aggregation),
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
                with Progress(*columns, console=console, transient=False) as progress:
                    monitor = Monitor(admin, name, fleet, progress, config.stall_seconds)
                    await monitor.wait_for_rounds(start_committed, config.rounds, fleet_task)
                    if config.stateful:
                        fleet.training_paused = True  # the seen devices evaluate, then rest
                    else:
                        fleet.stop([TRAINING])
                    final = await monitor.final_evaluation(timeout=config.round_seconds * 2 + 5)
                if await fleet.switch_off(STOP_GRACE_SECONDS):
                    console.print(
                        f"[yellow]{fleet.stats.switched_off} devices were still busy "
                        f"{STOP_GRACE_SECONDS:.0f} s after the run ended and were switched off[/]"
                    )
                await fleet_task
                status = await _admin_call(admin.status(name))
                rounds = [r for r in await _admin_call(admin.rounds(name)) if r["id"] not in closed_before]
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


async def run_async(config: RunConfig, console: Console) -> RunResult:
    if config.data == SHAKESPEARE:
        from android_sim.run_next_word import run_next_word

        return await run_next_word(config, console)
    started = time.monotonic()
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    data = load_data(config)
    console.print(f"data: {data.source}: {len(data.devices)} devices, {data.num_events:,} examples")
    model = model_config(data)
    t0 = time.monotonic()
    model_dir = await asyncio.to_thread(export, model, work / "model")
    manifest = load_manifest(model_dir)
    console.print(
        f"model: {model.num_items} x {model.embedding_dim}, {model.feedback.value} feedback, "
        f"sha256 {manifest.model_sha256[:12]}... ({time.monotonic() - t0:.1f} s)"
    )
    devices = await asyncio.to_thread(prepare_devices, config, data, model, work / "devices")
    held_out = sum(1 for spec in devices.specs if spec.role == HELD_OUT)
    console.print(f"fleet: {len(devices.specs) - held_out} training devices, {held_out} held-out devices")
    name = config.population or f"{config.data}-{manifest.model_sha256[:8]}"
    settings = population_settings(config, data, model, len(devices.specs) - held_out)

    async def recommend(fleet: Fleet, status: dict[str, Any]) -> tuple[HitRates | None, list[dict[str, Any]]]:
        if config.stateful:
            return await seen_device_examples(fleet, name, status, config.show_devices)
        return await held_out_hit_rates(fleet, devices.future, name, status, data, config.show_devices)

    async def attach(admin: AdminClient) -> dict[str, Any] | None:
        return await _attach_mixing(config, data, devices, manifest, admin, name, console)

    session = await run_fleet(config, name, model_dir, devices.specs, settings, recommend, console, attach)
    return _write_report(
        config,
        session.attached,
        data,
        model,
        session.fleet,
        session.status,
        session.rounds,
        session.final,
        session.served,
        started,
        console,
    )


def _write_report(
    config: RunConfig,
    mixing: dict[str, Any] | None,
    data: FleetData,
    model: ModelConfig,
    fleet: Fleet,
    status: dict[str, Any],
    rounds: list[dict[str, Any]],
    final: dict[str, Any] | None,
    recommendations: tuple[HitRates | None, list[dict[str, Any]]],
    started: float,
    console: Console,
) -> RunResult:
    hit_rates, examples = recommendations
    work = config.work_dir
    explicit = data.feedback is Feedback.EXPLICIT
    plots = [work / "metrics.png", work / "funnel.png"]
    report.plot_metrics(plots[0], rounds, explicit)
    report.plot_funnel(plots[1], rounds)
    training = [r for r in rounds if r["kind"] == "training" and r["status"] == "committed"]
    seconds = time.monotonic() - started
    header = report_header(config, status, fleet, _evaluation_name(config))
    body = {
        "config": header.pop("config"),
        "data": {"source": data.source, "devices": len(data.devices), "examples": data.num_events},
        "model": model.to_json(),
        **header,
        "mixing": _mixing_summary(mixing, fleet),
        "rounds": rounds,
        "final_evaluation": final,
        "hit_rates": asdict(hit_rates) if hit_rates else None,
        "recommendations": examples,
        "seconds": seconds,
    }
    report_path = work / "report.json"
    report.write_json(report_path, body)
    result = RunResult(
        report_path, plots, len(training), (final or {}).get("metrics", {}), hit_rates, seconds, body
    )
    _print_summary(result, config, data, examples, console)
    privacy = status.get("privacy")
    if privacy:
        console.print(f"differential privacy: {privacy['message']}")
    mixed = cast(dict[str, Any] | None, body["mixing"])
    if mixed:
        extra, count = mixed["central_bytes_per_assignment"], mixed["assignments_with_central_download"]
        console.print(
            f"mixing {mixed['mixing']['strategy']}: {extra:,.0f} extra bytes per training assignment "
            f"(median over {count})"
        )
    return result


async def _attach_mixing(
    config: RunConfig,
    data: FleetData,
    devices: Devices,
    manifest: Manifest,
    admin: AdminClient,
    name: str,
    console: Console,
) -> dict[str, Any] | None:
    """Attach the run's mixing strategy and its centralized dataset to the population."""
    if MixingConfig.from_json(config.mixing).strategy == "none":
        return None
    training = [data.devices[i] for i, spec in enumerate(devices.specs) if spec.role == TRAINING]
    central = centralized_examples(data, training, data.devices, config.central_examples, config.seed)
    blob = encode_examples(central.examples, manifest.features, central.accounts)
    attached = await _admin_call(admin.attach_mixing(name, config.mixing, blob))
    console.print(
        f"mixing: {attached['mixing']['strategy']} over {central.examples.num_examples} centralized examples "
        f"of {len(np.unique(central.accounts))} public accounts ({len(blob):,} bytes; "
        f"{len(central.new_items)} items no training device holds)"
    )
    return {**attached, "dataset_bytes": len(blob), "new_items": len(central.new_items)}


def _mixing_summary(mixing: dict[str, Any] | None, fleet: Fleet) -> dict[str, Any] | None:
    """The mixing strategy, its dataset, and the extra bytes each training assignment downloaded."""
    if mixing is None:
        return None
    sizes = fleet.stats.central_bytes
    return {
        **mixing,
        "assignments_with_central_download": len(sizes),
        "central_bytes_per_assignment": float(np.median(sizes)) if sizes else 0.0,
        "central_bytes_total": int(sum(sizes)),
    }


def report_header(config: RunConfig, status: dict[str, Any], fleet: Fleet, evaluation: str) -> dict[str, Any]:
    """What every run's report starts with, whatever the model: the configuration, the population,
    the fleet's counters and the algorithm (`evaluation` names how the model was evaluated)."""
    classes: dict[str, int] = {}
    for device in fleet.devices:
        classes[device.profile.device_class.name] = classes.get(device.profile.device_class.name, 0) + 1
    return {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(config).items()
            if k != "admin_token"  # a secret; never in a report
        },
        "population": {
            k: status[k] for k in ("name", "current_version", "training_rounds_committed", "artifact_sha256")
        },
        "privacy": status.get("privacy"),
        "fleet": {
            "device_classes": classes,
            "device_side_outcomes": {
                f"{role}/{s}": n for (role, s), n in sorted(fleet.stats.outcomes.items())
            },
            "median_task_seconds": float(np.median(fleet.stats.task_seconds))
            if fleet.stats.task_seconds
            else None,
            "switched_off": fleet.stats.switched_off,
        },
        "algorithm": {
            "local_state": status["settings"]["task_config"]["local_state"],
            "evaluation": evaluation,
            "task_config": status["settings"]["task_config"],
            "server_optimizer": status["settings"]["server_optimizer"],
        },
    }


def _evaluation_name(config: RunConfig) -> str:
    if config.stateful:
        return "StandardEval on seen devices (their kept locals, on their newest 10% of examples)"
    return "ReconEval on held-out devices"


def _print_summary(
    result: RunResult,
    config: RunConfig,
    data: FleetData,
    examples: list[dict[str, Any]],
    console: Console,
) -> None:
    console.print(f"\n[bold]{result.rounds_committed} training rounds committed in {result.seconds:.0f} s[/]")
    algorithm = result.summary["algorithm"]
    console.print(
        f"local parameters: {algorithm['local_state']} "
        f"(local learning rate {algorithm['task_config']['local_learning_rate']}); "
        f"server optimizer {algorithm['server_optimizer']['name']} "
        f"{algorithm['server_optimizer']['learning_rate']}"
    )
    final = result.final_evaluation
    if final:
        shown = ", ".join(f"{k} {final[k]:.4f}" for k in ("loss", "rmse", "accuracy") if k in final)
        console.print(f"final {_evaluation_name(config)}: {shown} (weight {final.get('weight_sum', 0):.0f})")
    else:
        console.print("final evaluation: no device reported in time")
    if result.hit_rates:
        h = result.hit_rates
        console.print(
            f"held-out devices' next share in the top-10 ({h.devices} devices): "
            f"personalized {h.personalized:.1%}, "
            f"global top-10 {h.global_model:.1%}, most-shared top-10 {h.most_shared:.1%} "
            f"(lift over global {h.lift_over_global:+.1%})"
        )
    for example in examples:
        table = top_k_table(example, data.item_labels)
        console.print(table)
    console.print(f"report: {result.report_path}")
    console.print("plots: " + ", ".join(str(p) for p in result.plots))


def run(config: RunConfig, console: Console | None = None) -> RunResult:
    return asyncio.run(run_async(config, console or Console()))
