"""Implicit feedback (expressions): does FedRecon's personalized top-10 beat the global top-10?

Two data sets: MovieLens as shares (a rating >= 4 is a share; nothing else is known) and the
synthetic expression data (`android_sim.expressions`). Users are split 80/10/10 as in the
explicit protocol. Training devices hold their shares; each time a device takes part it
samples 4 non-shared items per share as negatives (`add_negatives`, as a device does), and
runs FedRecon's task with the logistic loss. Held-out (test) devices keep their newest share
aside; after training each one builds its store, reconstructs and ranks the catalog with the
device `Recommender`, and we score the kept share: hit rate@10 and NDCG@10, against the
global popularity top-10 (the items most shared on the training devices). MovieLens devices
never get an item they already have recommended (a movie is watched once), expression devices
do (expressions are re-shared); the popularity list follows the same rule.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.builtin_data import model_config, population_settings
from android_sim.device_data import DeviceData, FleetData, movielens_fleet
from android_sim.fleet import write_store
from android_sim.intervals import bootstrap_means, bootstrap_ratio, resample_rows
from android_sim.run_config import RunConfig
from android_sim.simulation.protocol import PROTOCOL_SEED, split_users
from android_sim.simulation.rounds import (
    ClientWork,
    Devices,
    Report,
    Rounds,
    Server,
    SupportQuery,
    fedrecon_task,
    per_item_names,
    recon_eval_work,
    train_federated,
)
from benchmarks.model_cache import ModelCache
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from device_runtime.example_store import ExampleStore
from device_runtime.recommender import Recommender
from device_runtime.task_examples import shuffled
from model_export.config import ITEM, LABEL, Feedback
from model_runtime.support_query import add_negatives, negative_weights, not_negatives, split_support_query
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig

K = 10
SHARE_RATING = 4.0


def movielens_shares(path: Path) -> FleetData:
    """MovieLens as implicit feedback: each rating >= 4 is a share; users without one are dropped."""
    ratings = movielens_fleet(path)
    devices = []
    for device in ratings.devices:
        shared = device.labels >= SHARE_RATING
        if shared.any():
            devices.append(
                DeviceData(
                    device.item_ids[shared], np.ones(int(shared.sum()), np.float32), device.timestamps[shared]
                )
            )
    return FleetData(
        source=f"{ratings.source}, ratings >= 4 as shares",
        feedback=Feedback.IMPLICIT,
        num_items=ratings.num_items,
        item_labels=ratings.item_labels,
        devices=devices,
        label_mean=1.0,
    )


def _newest_first(device: DeviceData) -> Examples:
    return Examples({ITEM: device.item_ids[::-1], LABEL: device.labels[::-1]})


def _with_negatives(
    examples: Examples,
    manifest: Manifest,
    config: TaskConfig,
    rng: np.random.Generator,
    weights: np.ndarray | None = None,
) -> Examples:
    selected = shuffled(examples.select(slice(None, config.max_examples)), PROTOCOL_SEED)
    per_share = config.negatives_per_positive
    return add_negatives(selected, manifest, per_share, rng, not_negatives(config), weights)


def implicit_work(
    histories: Sequence[Examples], config: TaskConfig, manifest: Manifest, seed: int
) -> ClientWork:
    """FedRecon's task on a device's shares plus negatives sampled anew at each participation."""
    per_item = per_item_names(manifest)
    participations: dict[int, int] = {}  # a user is in at most one task at a time

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        count = participations.get(user, 0)
        participations[user] = count + 1
        rng = np.random.default_rng((seed, user, count))
        weights = negative_weights(manifest, config, params)
        examples = _with_negatives(histories[user], manifest, config, rng, weights)
        support, query = split_support_query(examples, manifest, config)
        return fedrecon_task(
            model,
            params,
            TaskBatches.pack(support, manifest),
            TaskBatches.pack(query, manifest),
            config,
            per_item,
        )

    return work


@dataclass(frozen=True)
class TopK:
    hit_rate: float
    ndcg: float
    # 95% intervals over the scored devices (`android_sim.intervals`).
    hit_rate_interval: tuple[float, float] = (math.nan, math.nan)
    ndcg_interval: tuple[float, float] = (math.nan, math.nan)
    # Each scored device's hit (0 or 1) and gain (1 / log2(position + 2), 0 without a hit), in the
    # devices' order: what the intervals and a paired comparison resample.
    hits: tuple[float, ...] = ()
    gains: tuple[float, ...] = ()

    def to_json(self) -> dict[str, float | list[float]]:
        return {
            f"hit_rate@{K}": self.hit_rate,
            f"ndcg@{K}": self.ndcg,
            f"hit_rate@{K}_95": list(self.hit_rate_interval),
            f"ndcg@{K}_95": list(self.ndcg_interval),
        }

    def shown(self) -> str:
        """The hit rate with its interval, e.g. `0.116 [0.053, 0.179]`."""
        low, high = self.hit_rate_interval
        return f"{self.hit_rate:.3f} [{low:.3f}, {high:.3f}]"


def score(ranked: Sequence[np.ndarray], held_out: Sequence[int]) -> TopK:
    """Hit rate@K and NDCG@K of one held-out item per device (ideal DCG is 1), each with its 95%
    interval (a bootstrap over the devices)."""
    hits, gains = np.zeros(len(held_out)), np.zeros(len(held_out))
    for i, (items, target) in enumerate(zip(ranked, held_out, strict=True)):
        position = np.flatnonzero(np.asarray(items)[:K] == target)
        if position.size:
            hits[i] = 1.0
            gains[i] = 1.0 / math.log2(int(position[0]) + 2)
    if not len(held_out):
        return TopK(0.0, 0.0)
    rows = resample_rows(len(hits), np.random.default_rng(0))
    hit_rate, ndcg = bootstrap_means(hits, rows), bootstrap_means(gains, rows)
    return TopK(
        hit_rate.value,
        ndcg.value,
        (hit_rate.low, hit_rate.high),
        (ndcg.low, ndcg.high),
        tuple(hits.tolist()),
        tuple(gains.tolist()),
    )


def lift(mine: TopK, baseline: TopK, seed: int = 0) -> dict[str, Any]:
    """mine / baseline - 1 for the hit rate and NDCG, and mine - baseline (`difference`), each
    with its 95% interval: the two rankings are scored on the same devices, so the same devices
    are resampled in both (paired). With few baseline hits the ratio's interval is wide; the
    difference's is not."""
    out: dict[str, Any] = {
        f"hit_rate@{K}": _lift(mine.hit_rate, baseline.hit_rate),
        f"ndcg@{K}": _lift(mine.ndcg, baseline.ndcg),
        "difference": {
            f"hit_rate@{K}": mine.hit_rate - baseline.hit_rate,
            f"ndcg@{K}": mine.ndcg - baseline.ndcg,
        },
    }
    if len(mine.hits) != len(baseline.hits) or not mine.hits:
        return out
    rows = resample_rows(len(mine.hits), np.random.default_rng(seed))
    pairs = ((f"hit_rate@{K}", mine.hits, baseline.hits), (f"ndcg@{K}", mine.gains, baseline.gains))
    for name, a, b in pairs:
        if sum(b) > 0:
            found = bootstrap_ratio(np.asarray(a), np.asarray(b), rows, lambda x: x - 1)
            out[f"{name}_95"] = [found.low, found.high]
        gap = bootstrap_means(np.asarray(a) - np.asarray(b), rows)
        out["difference"][f"{name}_95"] = [gap.low, gap.high]
    return out


def popularity_top(counts: np.ndarray, used: np.ndarray | None) -> np.ndarray:
    scores = counts.astype(np.float64).copy()
    if used is not None and used.size:
        scores[used] = -np.inf
    return np.argsort(-scores, kind="stable")[:K]


def run_implicit(
    name: str, data: FleetData, rounds: Rounds, models: ModelCache, workers: int
) -> dict[str, Any]:
    """Train FedRecon on the training devices, then score held-out devices' next share.

    Model, device task and server step are the fleet main job's (`android_sim.run`), tuned
    there on the synthetic data; as its orchestrator does, devices with fewer than
    `min_examples` shares do not train."""
    model_dir = models.get(model_config(data))
    settings = population_settings(RunConfig(work_dir=Path(".")), data, model_config(data))
    config = TaskConfig.from_json(settings["task_config"])
    split = split_users(len(data.devices))
    trainers = [u for u in split.train if len(data.devices[u]) >= config.min_examples]
    exclude_used = name.startswith("movielens")
    with Devices(model_dir, workers) as devices:
        manifest = devices.manifest
        histories = [_newest_first(d) for d in data.devices]
        # Validation devices: a fixed negative sample, so the curve measures the model only.
        validation = [_validation_client(h, manifest, config, u) for u, h in enumerate(histories)]
        evaluation = recon_eval_work(validation, config)

        def validate(params: Params) -> dict[str, float]:
            return devices.metrics_of(params, evaluation, split.validation)

        optimizer = ServerOptimizerConfig.from_json(settings["server_optimizer"])
        server = Server(TFLiteModel(model_dir).get_global(), optimizer)
        work = implicit_work(histories, config, manifest, rounds.sampling_seed)
        run = train_federated(devices, server, trainers, work, rounds, validate)
    started = time.perf_counter()
    counts = np.bincount(
        np.concatenate([data.devices[u].item_ids for u in split.train]), minlength=data.num_items
    )
    personalized, popular, targets = [], [], []
    model = TFLiteModel(model_dir)
    with tempfile.TemporaryDirectory(prefix="bench-stores-") as stores:
        for user in split.test:
            device = data.devices[user]
            if len(device) < 2:
                continue
            past, future = device.split_future(1)
            path = Path(stores) / f"device-{user}.sqlite"
            write_store(path, past.events(), manifest.features)
            with ExampleStore(path) as store:
                recommender = Recommender(model, store, run.params, config)
                top = recommender.recommend(K, exclude_used=exclude_used)
            personalized.append(top.items)
            popular.append(popularity_top(counts, past.item_ids if exclude_used else None))
            targets.append(int(future[0]))
    mine, baseline = score(personalized, targets), score(popular, targets)
    return {
        "data": data.source,
        "users": {"train": len(split.train), "validation": len(split.validation), "test": len(split.test)},
        "devices_scored": len(targets),
        "fedrecon": mine.to_json(),
        "global_popularity": baseline.to_json(),
        "lift": lift(mine, baseline),
        # Global popularity is the baseline (a floor); the bench trains no ceiling for this task.
        "ceiling": None,
        "validation_curve": run.curve,
        "seconds": round(run.seconds + time.perf_counter() - started, 1),
        "task": config.to_json(),
        "server": settings["server_optimizer"],
        "training_devices": len(trainers),
    }


def _lift(mine: float, baseline: float) -> float:
    return mine / baseline - 1 if baseline > 0 else math.nan


def _validation_client(history: Examples, manifest: Manifest, config: TaskConfig, user: int) -> SupportQuery:
    examples = _with_negatives(history, manifest, config, np.random.default_rng((PROTOCOL_SEED, user)))
    support, query = split_support_query(examples, manifest, config)
    return SupportQuery(TaskBatches.pack(support, manifest), TaskBatches.pack(query, manifest))
