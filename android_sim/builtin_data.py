"""The built-in data sets as workloads: synthetic expression shares and MovieLens ratings.

Each is a matrix-factorization export (`model_config`, exported once per config into the work
directory) plus one device per user, with the data's defaults: implicit shares reuse a small
device's examples for support and query and take a large server step; ratings take neither.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.algorithm import algorithm_task, optimizer_over
from android_sim.central_data import centralized_examples
from android_sim.device_data import DeviceData, FleetData, expression_fleet, movielens_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.run_config import RunConfig, round_settings
from android_sim.workload import Workload
from contracts.features import Examples
from contracts.manifest import ManifestError, load_manifest
from contracts.task_config import SplitPolicy, TrainingDefaults
from device_runtime.examples_table import DeviceExamples
from model_export.config import ITEM, LABEL, Feedback, ModelConfig
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
            # Items start beside their topic's (the catalog's public topics): +0.3 to +0.7 points
            # of held-out expected hit rate@10 on seeds 0-2 (docs/benchmarks.md, "Quality: the
            # main job's held-out devices").
            item_groups=data.item_groups,
            group_init_scale=0.5,
            # A global embedding and bias per topic that every item's score uses, stepping at
            # 0.03 of the items' rate, with items' L2 3e-3 (their own part shrinks toward their
            # topic's): +0.7 to +1.1 points paired over seeds 0-2, each interval above zero.
            group_embeddings=bool(data.item_groups),
            group_bias=bool(data.item_groups),
            group_rate=0.03,
            # Tuned on the synthetic data (held-out hit rate@10 after 80-160 rounds of 40 clients).
            # The reconstruction takes twice the steps at half the rate of 0.5 for 5 epochs (the
            # same distance, smoother): +0.7 / +0.2 / +0.5 points paired over seeds 0-2
            # (docs/benchmarks.md, "Quality: the main job's held-out devices").
            training=TrainingDefaults(
                reconstruction_learning_rate=0.25,
                reconstruction_max_epochs=10,
                update_learning_rate=1.0,
                update_max_epochs=5,
                l2_global=3e-3 if data.item_groups else 1e-4,
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


def task_defaults(data: FleetData) -> dict[str, Any]:
    # Shares are few per device: training uses every one for both support and query (the
    # keyboard deployment's lesson, taken to every device size), against 8 sampled negatives
    # each. Over reusing only below 10 examples with 4 negatives, held-out expected hit rate@10
    # rose about 3 points (docs/benchmarks.md, "Quality: the main job's held-out devices").
    # ReconEval still splits alternate batches. The reconstruction (in rounds and when serving)
    # fits the device's vector against 4 of them: +1.2 to +1.5 points paired over seeds 0-2, each
    # interval above zero; 2 and 6 within a point of 4 (benchmarks/main_quality.py).
    # Serving ranks by 8 reconstructions, the one from every share and 7 on bootstrap resamples of
    # the shares, their catalog probabilities averaged: +0.5 / -0.1 / +0.5 points on seeds 0-2
    # (+0.4 / -0.0 on 3-4), mostly on devices with 2-4 shares.
    if data.feedback is Feedback.IMPLICIT:
        return {
            "split": SplitPolicy.REUSE.value,
            "negatives_per_positive": 8,
            "reconstruction_negatives": 4,
            "serving_resamples": 7,
        }
    return {"reuse_below": 0}


def server_default(data: FleetData) -> dict[str, Any]:
    # Each item row's delta is averaged over every client, most of which never touched it;
    # a server step larger than 1 makes up for that dilution of sparse rows (implicit data).
    return {"name": "sgd", "learning_rate": 10.0 if data.feedback is Feedback.IMPLICIT else 1.0}


def population_settings(
    config: RunConfig, data: FleetData, model: ModelConfig, training_devices: int = 0
) -> dict[str, Any]:
    """The population's settings for this data's model (the benchmarks' too)."""
    base = {
        **asdict(model.training),
        "split": SplitPolicy.ALTERNATE.value,
        **task_defaults(data),
        "min_examples": config.min_examples,
    }
    task = algorithm_task(base, config.task)
    optimizer = optimizer_over(server_default(data), config.server_optimizer)
    return round_settings(config, task, optimizer, training_devices)


def export(config: ModelConfig, out: Path) -> Path:
    """Export, unless `out` already holds an export of exactly this config."""
    config_file = out / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()) == config.to_json():
        with contextlib.suppress(ManifestError, OSError):
            load_manifest(out)
            return out
    return export_in_subprocess(config, out)


def device_examples(index: int, device: DeviceData) -> DeviceExamples:
    """A user of the data as a device: its (item, label) examples, oldest first."""
    examples = Examples({ITEM: device.item_ids.astype(np.int64), LABEL: device.labels.astype(np.float32)})
    return DeviceExamples(f"device-{index:05d}", examples, device.timestamps.astype(np.float64))


def builtin_workload(config: RunConfig, data: FleetData, model_dir: Path) -> Workload:
    """The data's users as devices of the export in `model_dir` (of `model_config(data)`)."""
    manifest = load_manifest(model_dir)

    def central(training: Any) -> tuple[Examples, np.ndarray, np.ndarray]:
        users = [data.devices[i] for i in training]
        found = centralized_examples(data, users, data.devices, config.central_examples, config.seed)
        return found.examples, found.accounts, found.new_items

    return Workload(
        source=data.source,
        name=config.data,
        model_dir=model_dir,
        manifest=manifest,
        devices=[device_examples(i, d) for i, d in enumerate(data.devices)],
        task=task_defaults(data),
        server_optimizer=server_default(data),
        item_labels=data.item_labels,
        central=central,
        truth=data.truth,
    )
