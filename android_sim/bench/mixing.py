"""The skewed setup of Augenstein et al. ("Mixing centralized and federated data"): items no training
device holds, which public centralized data and held-out users' future do.

`python -m android_sim.bench mixing` (README, "Mixing centralized data: the skewed setup").

The setup, for implicit feedback (shares): users are split 80/10/10 (`split_users`); a tenth of the
training users are *public accounts* whose whole histories form the centralized dataset (they do
not train federatedly); a set of *new items* (popular ones, chosen at random) is removed from every
other training device. Held-out test devices are scored after training, as the implicit benchmark
does (`Recommender` over the device's own store): on the new items (a device's newest share of a
new item is the target, its shares of other items its store) and overall (its newest share is the
target, its older shares without new items its store). Hit rate@10 and NDCG@10.

Strategies, one function call each (`run_strategy`):
- `none`: federated training on the skewed devices only;
- `all_data`: the upper bound, devices keep their shares of the new items;
- `gradient_transfer`: each round the server computes the gradient of the centralized loss at the
  round's globals through the exported model's `gradient` signature (each public account's
  locals reconstructed first, as a device would), and every device adds `weight` times it to its
  update steps (`TFLiteModel.update_rows(central_gradient=...)`); the bytes it adds to an
  assignment are its wire encoding (`encode_sparse_delta`).
Parallel training and example transfer belong to the server (`orchestrator.mixing`); they join the
table once that is on main, through the server's own functions.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.bench.federated import Devices, Report, Rounds, Server, per_item_names, sparse_delta
from android_sim.bench.implicit import K, TopK, _newest_first, _with_negatives, movielens_shares, score
from android_sim.bench.models import ModelCache
from android_sim.bench.protocol import split_users
from android_sim.device_data import DeviceData, FleetData, expression_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.fleet import write_store
from android_sim.run import RunConfig, model_config, population_settings
from contracts.manifest import Manifest
from contracts.params import Params, SparseTensor, encode_sparse_delta, sparse_rows
from contracts.task_config import TaskConfig
from device_runtime.client_task import diverged
from device_runtime.example_store import ExampleStore
from device_runtime.recommender import Recommender
from model_runtime.support_query import num_steps, reconstruct_locals, split_support_query
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import SparseGradient, TFLiteModel
from orchestrator.aggregation import ServerOptimizerConfig

# Public accounts draw their negatives from streams of their own, apart from the devices'.
_PUBLIC_STREAM = 1_000_000
STRATEGIES = ("none", "all_data", "gradient_transfer")
GRADIENT_WEIGHTS = (0.1, 0.3, 1.0)


@dataclass(frozen=True)
class SkewedSetup:
    """Who trains on what: `data` is every user's full history."""

    name: str
    data: FleetData
    new_items: np.ndarray  # sorted; no training device holds them (except with `all_data`)
    train_users: list[int]  # federated devices
    public_users: list[int]  # their histories are the centralized dataset
    test_users: list[int]

    def device(self, user: int, keep_new: bool = False) -> DeviceData:
        """A user's history, without the new items unless `keep_new`."""
        d = self.data.devices[user]
        if keep_new:
            return d
        keep = ~np.isin(d.item_ids, self.new_items)
        return DeviceData(d.item_ids[keep], d.labels[keep], d.timestamps[keep])


def skewed_setup(
    name: str, data: FleetData, new_fraction: float, seed: int = 0, public_fraction: float = 0.1
) -> SkewedSetup:
    """New items: `new_fraction` of the catalog, drawn among the most shared third (new releases
    that catch on); public accounts: `public_fraction` of the training users."""
    if not 0 < new_fraction < 1 or not 0 < public_fraction < 1:
        raise ValueError(
            f"new_fraction and public_fraction must be in (0, 1), got {new_fraction}, {public_fraction}"
        )
    split = split_users(len(data.devices))
    counts = np.bincount(np.concatenate([d.item_ids for d in data.devices]), minlength=data.num_items)
    popular = np.argsort(-counts, kind="stable")[: max(1, data.num_items // 3)]
    count = max(1, round(new_fraction * data.num_items))
    new_items = np.sort(np.random.default_rng(seed).choice(popular, size=count, replace=False))
    public = int(len(split.train) * public_fraction)
    return SkewedSetup(name, data, new_items, split.train[public:], split.train[:public], split.test)


def expressions_setup(config: SyntheticConfig, new_fraction: float = 0.05) -> SkewedSetup:
    return skewed_setup("expressions", expression_fleet(config), new_fraction, seed=config.seed)


def movielens_setup(path: Path, new_fraction: float = 0.03) -> SkewedSetup:
    return skewed_setup("movielens", movielens_shares(path), new_fraction)


@dataclass
class StrategyResult:
    strategy: str
    weight: float | None
    new_items: TopK
    overall: TopK
    bytes_per_assignment: float  # what mixing adds to an assignment, mean over rounds
    seconds: float
    refused: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "weight": self.weight,
            "new_items": self.new_items.to_json(),
            "overall": self.overall.to_json(),
            "bytes_per_assignment": self.bytes_per_assignment,
            "seconds": round(self.seconds, 1),
            "refused": self.refused,
            **self.extra,
        }


@dataclass(frozen=True)
class Harness:
    """What every strategy shares: the setup, the exported model, the device task, the rounds."""

    setup: SkewedSetup
    model_dir: Path
    config: TaskConfig
    optimizer: ServerOptimizerConfig
    rounds: Rounds
    workers: int

    @classmethod
    def build(cls, setup: SkewedSetup, models: ModelCache, rounds: Rounds, workers: int) -> Harness:
        model = model_config(setup.data)
        settings = population_settings(RunConfig(work_dir=Path(".")), setup.data, model)
        return cls(
            setup,
            models.get(model),
            TaskConfig.from_json(settings["task_config"]),
            ServerOptimizerConfig.from_json(settings["server_optimizer"]),
            rounds,
            workers,
        )

    def trainers(self, keep_new: bool) -> tuple[list[int], list[DeviceData]]:
        """The training users with at least `min_examples` shares, and every user's device data."""
        devices = [self.setup.device(u, keep_new) for u in range(len(self.setup.data.devices))]
        users = [u for u in self.setup.train_users if len(devices[u]) >= self.config.min_examples]
        return users, devices

    def client_batches(
        self, manifest: Manifest, history: DeviceData, user: int, round_: int
    ) -> tuple[TaskBatches, TaskBatches]:
        """A device's support and query for one participation: its shares plus fresh negatives."""
        rng = np.random.default_rng((self.rounds.sampling_seed, user, round_))
        examples = _with_negatives(_newest_first(history), manifest, self.config, rng)
        support, query = split_support_query(examples, manifest, self.config)
        return TaskBatches.pack(support, manifest), TaskBatches.pack(query, manifest)


# ---- the strategies ------------------------------------------------------------------------


def run_strategy(harness: Harness, strategy: str, weight: float | None = None) -> StrategyResult:
    """Train with one strategy and score the held-out devices."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if (strategy == "gradient_transfer") != (weight is not None):
        raise ValueError("gradient_transfer takes a weight, the other strategies none")
    started = time.perf_counter()
    params, refused, extra_bytes = train(harness, strategy, weight or 0.0)
    new_items, overall = evaluate(harness, params)
    return StrategyResult(
        strategy, weight, new_items, overall, extra_bytes, time.perf_counter() - started, refused
    )


def train(harness: Harness, strategy: str, weight: float = 0.0) -> tuple[Params, int, float]:
    """(final globals, refused reports, mean bytes mixing added per assignment)."""
    rounds = harness.rounds
    users, histories = harness.trainers(keep_new=strategy == "all_data")
    public = [u for u in harness.setup.public_users if len(harness.setup.data.devices[u]) >= 1]
    rng = np.random.default_rng(rounds.sampling_seed)
    population = np.asarray(users)
    per_round = min(rounds.clients_per_round, len(population))
    refused, sent_bytes = 0, 0.0
    with Devices(harness.model_dir, harness.workers) as devices:
        manifest = devices.manifest
        per_item = per_item_names(manifest)
        server = Server(TFLiteModel(harness.model_dir).get_global(), harness.optimizer)
        for r in range(1, rounds.rounds + 1):
            devices.set_global(server.params)
            central: SparseGradient | None = None
            if strategy == "gradient_transfer":
                central = central_gradient(devices, harness, public, r)
                sent_bytes += len(encode_sparse_delta(central))
            clients = rng.choice(population, size=per_round, replace=False).tolist()
            work = _client_work(harness, histories, per_item, r, central, weight)
            refused += server.commit(devices.map(work, clients))
    return server.params, refused, sent_bytes / rounds.rounds


def _client_work(
    harness: Harness,
    histories: Sequence[DeviceData],
    per_item: frozenset[str],
    round_: int,
    central: SparseGradient | None,
    weight: float,
) -> Callable[[TFLiteModel, Params, int], Report]:
    """FedRecon's client task (Algorithm 1), with the central gradient added to each update step."""
    config = harness.config

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        support, query = harness.client_batches(model.manifest, histories[user], user, round_)
        reconstruct_locals(model, support, config)
        update = model.update_rows(
            query,
            num_steps(query.num_batches, config.update_max_epochs, config.update_max_steps),
            config.update_learning_rate,
            local_learning_rate=config.local_learning_rate,
            l2_global=config.l2_global,
            l2_local=config.l2_local,
            central_gradient=central,
            central_gradient_weight=weight,
        )
        if diverged(update):
            return None
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        return sparse_delta(update, shapes, per_item), float(query.num_examples)

    return work


def central_gradient(
    devices: Devices, harness: Harness, public: Sequence[int], round_: int
) -> SparseGradient:
    """The gradient of the centralized loss at the installed globals: each public account's locals
    reconstructed on its support set, its gradient taken on its query set through the model's
    `gradient` signature, the mean weighted by examples. Negatives are drawn anew each round."""

    def work(model: TFLiteModel, params: Params, user: int) -> tuple[dict[str, np.ndarray], float]:
        support, query = harness.client_batches(
            model.manifest, harness.setup.data.devices[user], _PUBLIC_STREAM + user, round_
        )
        reconstruct_locals(model, support, harness.config)
        result = model.gradient(query)
        model.reset_local()
        return {k: _scaled_dense(g, result.weight_sum) for k, g in result.gradient.items()}, result.weight_sum

    parts = devices.map(work, list(public))
    total = sum(w for _, w in parts)
    summed: dict[str, np.ndarray] = {}
    for dense, _ in parts:
        for k, v in dense.items():
            summed[k] = summed[k] + v if k in summed else v
    return {k: sparse_rows(v / max(total, 1.0)) for k, v in summed.items()}


def _scaled_dense(tensor: SparseTensor, scale: float) -> np.ndarray:
    out = np.zeros(tensor.shape if tensor.shape else (1,), np.float64)
    out[tensor.rows] = tensor.values * scale
    return out.reshape(tensor.shape)


# ---- evaluation ----------------------------------------------------------------------------


def evaluation_cases(setup: SkewedSetup) -> tuple[list[tuple[DeviceData, int]], list[tuple[DeviceData, int]]]:
    """(new-item cases, overall cases): each a test device's store and its target share."""
    new_cases, overall_cases = [], []
    for user in setup.test_users:
        d = setup.data.devices[user]
        is_new = np.isin(d.item_ids, setup.new_items)
        old = setup.device(user)
        if is_new.any() and len(old) >= 1:
            new_cases.append((old, int(d.item_ids[np.flatnonzero(is_new)[-1]])))
        if len(d) >= 2:
            past, future = d.split_future(1)
            keep = ~np.isin(past.item_ids, setup.new_items)
            if keep.any():
                store = DeviceData(past.item_ids[keep], past.labels[keep], past.timestamps[keep])
                overall_cases.append((store, int(future[0])))
    return new_cases, overall_cases


def evaluate(harness: Harness, params: Params) -> tuple[TopK, TopK]:
    """Hit rate@10 and NDCG@10 of the held-out devices' targets: (new items, overall)."""
    new_cases, overall_cases = evaluation_cases(harness.setup)
    exclude_used = harness.setup.name == "movielens"  # a movie is watched once
    model = TFLiteModel(harness.model_dir)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-mixing-") as stores:
        for part, cases in (("new", new_cases), ("overall", overall_cases)):
            ranked, targets = [], []
            for i, (store_data, target) in enumerate(cases):
                path = Path(stores) / f"{part}-{i}.sqlite"
                write_store(path, store_data.events(), model.manifest.features)
                with ExampleStore(path) as store:
                    top = Recommender(model, store, params, harness.config).recommend(
                        K, exclude_used=exclude_used
                    )
                ranked.append(top.items)
                targets.append(target)
            results.append(score(ranked, targets))
    return results[0], results[1]


# ---- the table -----------------------------------------------------------------------------


def run_mixing(
    setups: Sequence[SkewedSetup],
    models: ModelCache,
    rounds: Rounds,
    workers: int,
    weights: Sequence[float] = GRADIENT_WEIGHTS,
) -> list[dict[str, Any]]:
    rows = []
    for setup in setups:
        harness = Harness.build(setup, models, rounds, workers)
        runs = [("none", None), ("all_data", None), *(("gradient_transfer", w) for w in weights)]
        for strategy, weight in runs:
            result = run_strategy(harness, strategy, weight)
            rows.append({"data": setup.name, **result.to_json()})
            print(table_line(rows[-1]), flush=True)
    return rows


def describe(setup: SkewedSetup) -> str:
    new_cases, overall_cases = evaluation_cases(setup)
    central = sum(len(setup.data.devices[u]) for u in setup.public_users)
    return (
        f"{setup.name}: {setup.data.source}; {len(setup.new_items)} new items held back from "
        f"{len(setup.train_users)} training devices; centralized data: {central} shares of "
        f"{len(setup.public_users)} public accounts; scored: {len(new_cases)} test devices on new items, "
        f"{len(overall_cases)} overall"
    )


TABLE_HEADER = (
    f"| data | strategy | weight | new items HR@{K} | new items NDCG@{K} | overall HR@{K} | "
    "extra bytes / assignment | seconds |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_line(row: dict[str, Any]) -> str:
    weight = "" if row["weight"] is None else f"{row['weight']:g}"
    return (
        f"| {row['data']} | {row['strategy']} | {weight} | {row['new_items'][f'hit_rate@{K}']:.3f} | "
        f"{row['new_items'][f'ndcg@{K}']:.3f} | {row['overall'][f'hit_rate@{K}']:.3f} | "
        f"{_bytes(row['bytes_per_assignment'])} | {row['seconds']:.0f} |"
    )


def _bytes(n: float) -> str:
    if n <= 0:
        return "0"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{math.ceil(n)} B"
