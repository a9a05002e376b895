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
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from android_sim.admin import AdminClient
from android_sim.algorithm import algorithm_task, optimizer_over, round_settings
from android_sim.central_data import centralized_examples
from android_sim.device_data import DeviceData, FleetData, expression_fleet, movielens_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.fleet import HELD_OUT, TRAINING, DeviceSpec, Fleet, write_store
from android_sim.profiles import draw_profiles
from android_sim.recommendations import HitRates, held_out_hit_rates, seen_device_examples
from android_sim.run_config import SHAKESPEARE, RunConfig, RunResult, check_fleet_size, training_count
from android_sim.run_report import write_report
from android_sim.session import admin_call, run_fleet
from contracts.manifest import Manifest, ManifestError, load_manifest
from contracts.mixing import MixingConfig, encode_examples
from contracts.task_config import SplitPolicy
from model_export.config import Feedback, ModelConfig, TrainingDefaults
from model_export.in_subprocess import export_in_subprocess


def load_data(config: RunConfig) -> FleetData:
    if config.data == "movielens":
        return movielens_fleet(config.ratings, config.devices)
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


def server_optimizer(config: RunConfig, data: FleetData) -> dict[str, Any]:
    # Each item row's delta is averaged over every client, most of which never touched it;
    # a server step larger than 1 makes up for that dilution of sparse rows (implicit data).
    default = {"name": "sgd", "learning_rate": 10.0 if data.feedback is Feedback.IMPLICIT else 1.0}
    return optimizer_over(default, config.server_optimizer)


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


async def run_async(config: RunConfig, console: Console) -> RunResult:
    if config.data == SHAKESPEARE:
        from android_sim.run_next_word import run_next_word

        return await run_next_word(config, console)
    started = time.monotonic()
    work = config.work_dir
    work.mkdir(parents=True, exist_ok=True)
    data = load_data(config)
    console.print(f"data: {data.source}: {len(data.devices)} devices, {data.num_events:,} examples")
    check_fleet_size(config, training_count(config, len(data.devices)))
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
    return write_report(
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
    attached = await admin_call(admin.attach_mixing(name, config.mixing, blob))
    console.print(
        f"mixing: {attached['mixing']['strategy']} over {central.examples.num_examples} centralized examples "
        f"of {len(np.unique(central.accounts))} public accounts ({len(blob):,} bytes; "
        f"{len(central.new_items)} items no training device holds)"
    )
    return {**attached, "dataset_bytes": len(blob), "new_items": len(central.new_items)}


def run(config: RunConfig, console: Console | None = None) -> RunResult:
    return asyncio.run(run_async(config, console or Console()))
