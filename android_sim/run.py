"""`python -m android_sim run`: the whole pipeline, from a model and per-device data to a served top-k.

1. The workload: the user's export (`--model-dir`, or `--model MODULE:FUNCTION` exported here)
   and examples table (`--examples`), or a built-in data set with its model (`builtin_data`).
2. Start a local orchestrator on an SQLite file in the work directory, or use one by URL.
3. Create (or reuse) the population; write one example store per device; enroll the fleet.
4. Run the fleet until `rounds` training rounds have committed; evaluation rounds on the
   held-out devices run along the way (every `evaluation_every`) and once at the end.
5. Write the run report (JSON + plots) with the model's own metrics; a ranking model's held-out
   devices show their personalized top-k next to the global one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from android_sim.admin import AdminClient
from android_sim.algorithm import algorithm_task, optimizer_over, settings_problem
from android_sim.builtin_data import builtin_workload, export, load_data, model_config
from android_sim.builtin_next_word import next_word_workload
from android_sim.central_data import central_only_rows
from android_sim.fleet import HELD_OUT, TRAINING, DeviceSpec, Fleet
from android_sim.profiles import draw_profiles
from android_sim.recommendations import held_out_hit_rates, seen_device_examples
from android_sim.run_config import (
    SHAKESPEARE,
    RunConfig,
    RunError,
    RunResult,
    check_fleet_size,
    round_settings,
    training_count,
)
from android_sim.run_report import write_report
from android_sim.session import admin_call, run_fleet
from android_sim.workload import Workload, oldest_first, split_newest
from contracts.features import Examples
from contracts.manifest import Manifest, ManifestError, load_manifest
from contracts.mixing import MixingConfig, encode_examples
from contracts.params import ParamsError, decode_params
from contracts.task_config import SplitPolicy
from device_runtime.example_store import ExampleStore
from device_runtime.examples_table import TableError, read_examples_table, store_path
from model_export.in_subprocess import export_spec_in_subprocess

_ARGS_FILE = "model_args.json"  # beside an export of --model: the builder and arguments it was made with
FINAL_GLOBALS = "global_params.safetensors"  # in the work directory: the trained model's globals


def user_model(config: RunConfig) -> Path:
    """The user's export: `--model-dir` as it is, or `--model` exported into the work directory
    (reused when it already holds an export of the same builder and arguments)."""
    if config.model_dir is not None:
        return config.model_dir
    assert config.model is not None
    out = config.work_dir / "model"
    recorded, wanted = out / _ARGS_FILE, {"builder": config.model, "args": config.model_args}
    if recorded.is_file() and json.loads(recorded.read_text()) == wanted:
        with contextlib.suppress(ManifestError, OSError):
            load_manifest(out)
            return out
    recorded.unlink(missing_ok=True)
    try:
        export_spec_in_subprocess(config.model, out, config.model_args)
    except RuntimeError as e:
        raise RunError(str(e)) from None
    recorded.write_text(json.dumps(wanted))  # written last: an interrupted export is not reused
    return out


def user_workload(config: RunConfig, console: Console) -> Workload:
    """The user's model and examples table: each device id of the table a device."""
    t0 = time.monotonic()
    model_dir = user_model(config)
    try:
        manifest = load_manifest(model_dir)
    except ManifestError as e:
        raise RunError(f"{model_dir}: {e}") from None
    console.print(
        f"model: {manifest.task.kind} ({', '.join(f.name for f in manifest.features)}), "
        f"{len(manifest.global_params)} global and {len(manifest.local_params)} local tensors, "
        f"sha256 {manifest.model_sha256[:12]}... ({time.monotonic() - t0:.1f} s)"
    )
    assert config.examples is not None
    try:
        table = read_examples_table(config.examples, manifest, marker_column=config.held_out_column)
    except TableError as e:
        raise RunError(str(e)) from None
    shares = manifest.task.kind == "ranking" and manifest.task.negative_sampling
    devices = [oldest_first(d) for d in table.devices.values()]
    held_out = None
    if config.held_out_column is not None:
        held_out = frozenset(i for i, d in enumerate(devices) if d.device_id in table.marked)
        if not held_out:
            raise RunError(
                f"--held-out-column {config.held_out_column}: no device has 1 in it; expected 1 on "
                "the rows of the devices to hold out"
            )
    if config.held_out is not None:
        from android_sim.simulation.ranking import read_held_out  # it imports this module

        try:
            held_out = frozenset(read_held_out(config.held_out, [d.device_id for d in devices]))
        except ValueError as e:
            raise RunError(str(e)) from None
    return Workload(
        source=f"{config.examples} ({table.num_rows:,} rows)",
        name=model_dir.resolve().name,
        model_dir=model_dir,
        manifest=manifest,
        devices=devices,
        held_out=held_out,
        **(SHARES_DEFAULTS if shares else {}),
    )


# A ranking model on shares (implicit feedback), whoever's: the main job's lessons
# (`builtin_data.task_defaults`, `server_default`). Every share serves as support and query (a
# device holds a few) against 8 sampled negatives each, the reconstruction against 4; the server
# steps 10x the mean delta, since a sparse row's mean is diluted by every report that never
# touched it. On the generated sticker table (android_sim.stickers, 100 rounds of 20) they took
# FedRecon's held-out hit rate@10 from the model without locals' and most-shared's (41.0% against
# 41.0% and 40.1%) to 45.0% against 38.9% and 40.1%, paired +6.1 [+2.5, ...] and +4.9 [+0.9, ...]
# (docs/benchmarks.md, "Ranking on a user's own table").
SHARES_DEFAULTS: dict[str, Any] = {
    "task": {"split": SplitPolicy.REUSE.value, "negatives_per_positive": 8, "reconstruction_negatives": 4},
    "server_optimizer": {"name": "sgd", "learning_rate": 10.0},
}


def load_workload(
    config: RunConfig, console: Console, check_training: Callable[[int], None] = lambda count: None
) -> Workload:
    """The run's model and per-device examples: the user's, or a built-in data set's.
    `check_training(count)` refuses a number of training devices (before a built-in model is exported)."""
    if config.model_dir is not None or config.model is not None:
        workload = user_workload(config, console)
        console.print(
            f"data: {workload.source}: {len(workload.devices)} devices, {workload.num_examples:,} examples"
        )
        check_training(training_count(config, len(workload.devices)))
        return workload
    if config.data == SHAKESPEARE:
        return next_word_workload(config, console, check_training)
    data = load_data(config)
    console.print(f"data: {data.source}: {len(data.devices)} devices, {data.num_events:,} examples")
    check_training(training_count(config, len(data.devices)))
    model = model_config(data)
    t0 = time.monotonic()
    model_dir = export(model, config.work_dir / "model")
    workload = builtin_workload(config, data, model_dir)
    console.print(
        f"model: {model.num_items} x {model.embedding_dim}, {model.feedback.value} feedback, "
        f"sha256 {workload.manifest.model_sha256[:12]}... ({time.monotonic() - t0:.1f} s)"
    )
    return workload


def population_settings(config: RunConfig, workload: Workload, training_devices: int) -> dict[str, Any]:
    """The model's training defaults, the data's over them, then the run's options."""
    base = {
        **workload.manifest.training_defaults,
        "split": SplitPolicy.ALTERNATE.value,
        **workload.task,
        "min_examples": config.min_examples,
    }
    task = algorithm_task(base, config.task)
    optimizer = optimizer_over(workload.server_optimizer, config.server_optimizer)
    return round_settings(config, task, optimizer, training_devices)


@dataclass(frozen=True)
class Devices:
    specs: list[DeviceSpec]
    future: dict[int, Examples]  # held-out device index -> the examples it has next (kept out of its store)


def prepare_devices(config: RunConfig, workload: Workload, store_dir: Path) -> Devices:
    """One example store per device; some devices held out (none in a stateful population, which
    evaluates on its seen devices' newest examples). A held-out device of a ranking model on
    implicit feedback keeps its newest shares (`future_count`) out of its store, to score its
    top-k against."""
    rng = np.random.default_rng(config.seed)
    store_dir.mkdir(parents=True, exist_ok=True)
    count = len(workload.devices)
    if workload.held_out is not None:
        held_out = set(workload.held_out)
    else:
        fraction = 0.0 if config.stateful else config.held_out_fraction
        held_out = set(rng.permutation(count)[: round(fraction * count)].tolist())
    profiles = draw_profiles(count, config.device_mix, rng)
    specs: list[DeviceSpec] = []
    future: dict[int, Examples] = {}
    for i, device in enumerate(workload.devices):
        stored = device
        if i in held_out and workload.ranks_shares and device.examples.num_examples >= 2:
            stored, future[i] = split_newest(device, future_count(device.examples.num_examples))
        path = store_path(store_dir, device.device_id)
        write_store(path, stored, workload)
        role = HELD_OUT if i in held_out else TRAINING
        specs.append(DeviceSpec(role, profiles[i], path, stored.examples.num_examples, new_store=True))
    return Devices(specs, future)


FUTURE_FRACTION = 0.2


def future_count(examples: int) -> int:
    """How many of a held-out device's newest shares are kept aside to score: a fifth, at least
    one, and never all (a device of one share keeps it and is scored on its expected hit rate)."""
    return 0 if examples < 2 else max(1, round(FUTURE_FRACTION * examples))


def write_store(path: Path, device: Any, workload: Workload) -> None:
    """A new example store at `path` (replacing any) holding the device's examples."""
    path.unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    with ExampleStore(path, workload.manifest.features, durable=False) as store:
        store.add_examples(device.examples, device.timestamps)


async def run_async(config: RunConfig, console: Console) -> RunResult:
    started = time.monotonic()
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    workload = await asyncio.to_thread(load_workload, config, console, lambda n: check_fleet_size(config, n))
    manifest = workload.manifest
    initial = None if config.initial_globals is None else initial_globals(config.initial_globals, manifest)
    devices = await asyncio.to_thread(prepare_devices, config, workload, work / "devices")
    held_out = sum(1 for spec in devices.specs if spec.role == HELD_OUT)
    console.print(f"fleet: {len(devices.specs) - held_out} training devices, {held_out} held-out devices")
    name = config.population or f"{workload.name}-{manifest.model_sha256[:8]}"
    central = central_dataset(config, workload, devices)
    settings = population_settings(config, workload, len(devices.specs) - held_out)
    if central is not None:
        strategy = MixingConfig.from_json(config.mixing).strategy
        rows = central_only_rows(strategy, central[2], manifest.task.negative_sampling)
        settings["task_config"] = {**settings["task_config"], "central_only_items": list(rows)}
    problem = settings_problem(settings)  # the whole settings, before the server starts
    if problem:
        raise RunError(problem)

    async def serve(fleet: Fleet, status: dict[str, Any]) -> Any:
        await save_globals(fleet, name, status, work / FINAL_GLOBALS)
        if workload.report is not None:
            return await workload.report.serve(fleet, name, status, config.show_devices)
        if manifest.task.kind != "ranking":
            return None, []  # the final evaluation's metrics say how the model does
        if config.stateful:
            return await seen_device_examples(fleet, name, status, config.show_devices)
        return await held_out_hit_rates(fleet, devices.future, name, status, workload, config.show_devices)

    async def attach(admin: AdminClient) -> dict[str, Any] | None:
        return await attach_mixing(config, workload, central, admin, name, console)

    session = await run_fleet(
        config, name, workload.model_dir, devices.specs, settings, serve, console, attach, initial
    )
    result = write_report(
        config,
        session.attached,
        workload,
        session.fleet,
        session.status,
        session.rounds,
        session.final,
        session.served,
        started,
        console,
    )
    if (work / FINAL_GLOBALS).is_file():
        console.print(f"trained global parameters: {work / FINAL_GLOBALS}")
    return result


def initial_globals(path: Path, manifest: Manifest) -> bytes:
    """`--initial-globals`' bytes, checked against the manifest's global tensors (names, shapes)."""
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise RunError(f"--initial-globals {path}: cannot read it ({e.strerror or e})") from None
    try:
        decode_params(blob, manifest.global_params, f"--initial-globals {path}")
    except ParamsError as e:
        raise RunError(f"{e} (expected this export's globals, e.g. simulate's {FINAL_GLOBALS})") from None
    return blob


async def save_globals(fleet: Fleet, population: str, status: dict[str, Any], path: Path) -> None:
    """The trained globals, as a device downloads them, for serving from the command line
    (`python -m device_runtime recommend --globals`)."""
    enrolled = next((d for d in fleet.devices if d.device_id), None)
    if enrolled is not None:
        blob = await enrolled.client.global_params_at(population, int(status["current_version"]))
        path.write_bytes(blob)


def central_dataset(
    config: RunConfig, workload: Workload, devices: Devices
) -> tuple[Examples, np.ndarray, np.ndarray] | None:
    """The data's centralized dataset for the run's mixing (examples, their public accounts, the
    items no training device holds); None without mixing."""
    if MixingConfig.from_json(config.mixing).strategy == "none":
        return None
    if workload.central is None:
        raise RunError("mixing needs a centralized dataset: run it with a built-in data set (--data)")
    return workload.central([i for i, spec in enumerate(devices.specs) if spec.role == TRAINING])


async def attach_mixing(
    config: RunConfig,
    workload: Workload,
    central: tuple[Examples, np.ndarray, np.ndarray] | None,
    admin: AdminClient,
    name: str,
    console: Console,
) -> dict[str, Any] | None:
    """Attach the run's mixing strategy and the data's centralized dataset to the population."""
    if central is None:
        return None
    examples, accounts, new_items = central
    blob = encode_examples(examples, workload.manifest.features, accounts)
    attached = await admin_call(admin.attach_mixing(name, config.mixing, blob))
    console.print(
        f"mixing: {attached['mixing']['strategy']} over {examples.num_examples} centralized examples "
        f"of {len(np.unique(accounts))} public accounts ({len(blob):,} bytes; "
        f"{len(new_items)} items no training device holds)"
    )
    return {**attached, "dataset_bytes": len(blob), "new_items": len(new_items)}


def run(config: RunConfig, console: Console | None = None) -> RunResult:
    return asyncio.run(run_async(config, console or Console()))
