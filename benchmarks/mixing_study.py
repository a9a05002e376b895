"""The skewed setup of Augenstein et al. ("Mixing centralized and federated data"): items no training
device holds, which public centralized data and held-out users' future do.

`python -m benchmarks.mixing` (README, "Mixing centralized data: the skewed setup").

The setup, for implicit feedback (shares): users are split 80/10/10 (`split_users`); a tenth of the
training users are *public accounts* whose whole histories form the centralized dataset (they do
not train federatedly); a set of *new items* (popular ones, chosen at random) is removed from every
other training device. Held-out test devices are scored after training, as the implicit benchmark
does (`Recommender` over the device's own store): on the new items (a device's newest share of a
new item is the target, its shares of other items its store) and overall (its newest share is the
target, its older shares without new items its store). Hit rate@10 and NDCG@10.

Strategies, one function call each (`run_strategy`), the system's own functions on both sides:
- `none`: federated training on the skewed devices only;
- `all_data`: the upper bound, devices keep their shares of the new items;
- `parallel_training` (Algorithm 2): each round the server trains a copy of the globals on the
  centralized data for J steps (`orchestrator.populations.central_training.train_on_central`, through the
  exported model) and merges `(1 - alpha) * federated + alpha * central` (`merge`) before the
  server optimizer; nothing is added to an assignment;
- `example_transfer` (Algorithm 3): each assignment carries a sample of the centralized examples
  (`orchestrator.populations.mixing.assignment_examples`, seeded by the assignment) that the device mixes into
  its update batches (`device_runtime.client_task.with_central`), not counted in its weight; the
  bytes it adds are the route's encoding (`encode_examples`);
- `gradient_transfer` (Algorithm 4): each round the server computes the gradient of the
  centralized loss at the round's globals (`gradient_on_central`: each pseudo-user's locals
  reconstructed, the model's `gradient` signature), and every device adds `weight` times it to its
  update steps (`TFLiteModel.update_rows(central_gradient=...)`); the bytes it adds to an
  assignment are its wire encoding (`encode_sparse_delta`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.builtin_data import model_config, population_settings
from android_sim.central_data import MIXING_STRATEGIES, central_only_rows
from android_sim.device_data import DeviceData, FleetData, expression_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.fleet import write_store
from android_sim.intervals import bootstrap_ratio, resample_rows
from android_sim.run_config import RunConfig
from android_sim.simulation.protocol import split_users
from android_sim.simulation.rounds import Devices, Report, Rounds, Server, per_item_names, sparse_delta
from benchmarks.implicit import K, TopK, _newest_first, _with_negatives, movielens_shares, score
from benchmarks.model_cache import ModelCache
from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.mixing import CentralDataset, MixingConfig, encode_examples
from contracts.params import Params, encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.example_store import ExampleStore
from device_runtime.fedrecon_step import Halt, fedrecon_step
from device_runtime.recommender import Recommender
from device_runtime.task_examples import with_central
from model_export.config import ITEM, LABEL
from model_runtime.support_query import negative_weights, split_support_query
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import SparseGradient, TFLiteModel
from orchestrator.aggregation.central_merge import merge
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.populations.central_training import (
    CentralTrainingError,
    gradient_on_central,
    train_on_central,
)
from orchestrator.populations.mixing import assignment_examples

STRATEGIES = ("none", "all_data", "parallel_training", "example_transfer", "gradient_transfer")
WEIGHTED = MIXING_STRATEGIES
PARALLEL_WEIGHTS = (0.1, 0.3, 0.5)  # alpha
EXAMPLES_PER_ASSIGNMENT = (8, 16, 64)
GRADIENT_WEIGHTS = (0.1, 0.3, 1.0)
# Parallel training's J and rate: as many steps as one device's update at most, at its rate.
CENTRAL_STEPS = 50
CENTRAL_LEARNING_RATE = 1.0
# Keeps (round, device) seeds of example transfer's negatives apart.
_SEED_STRIDE = 1_000_003


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


def central_examples(setup: SkewedSetup, manifest: Manifest, account_ids: bool = True) -> CentralDataset:
    """The centralized dataset as an operator would attach it: the public accounts' shares,
    account by account and oldest first, with each share's account as its group id (unless not
    `account_ids`), so that the server's pseudo-users (`groups_of`) are the accounts."""
    devices = [setup.data.devices[u] for u in setup.public_users]
    examples = Examples(
        {
            ITEM: np.concatenate([d.item_ids for d in devices]),
            LABEL: np.concatenate([d.labels for d in devices]),
        }
    )
    accounts = np.repeat(np.arange(len(devices), dtype=np.int64), [len(d) for d in devices])
    return CentralDataset(examples.validated(manifest.features), accounts if account_ids else None)


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
    central: CentralDataset  # the centralized dataset (`central_examples`)
    central_steps: int = CENTRAL_STEPS  # parallel training's J
    central_learning_rate: float = CENTRAL_LEARNING_RATE
    # Parallel and gradient transfer, for a dataset without account ids; None: the default.
    examples_per_pseudo_user: int | None = None
    # The mixing strategies' task declares the new items central-only (`central_only_items`: the
    # devices never draw them as negatives for their own shares), as an operator who knows which
    # catalog rows are new would; False: it does not (they are sampled negatives like any row).
    declare_new_items: bool = True

    @classmethod
    def build(
        cls,
        setup: SkewedSetup,
        models: ModelCache,
        rounds: Rounds,
        workers: int,
        central_steps: int = CENTRAL_STEPS,
        central_learning_rate: float = CENTRAL_LEARNING_RATE,
        examples_per_pseudo_user: int | None = None,
        account_ids: bool = True,
        negative_popularity: float = 0.0,
        declare_new_items: bool = True,
    ) -> Harness:
        model = model_config(setup.data)
        settings = population_settings(RunConfig(work_dir=Path(".")), setup.data, model)
        model_dir = models.get(model)
        task = TaskConfig.from_json({**settings["task_config"], "negative_popularity": negative_popularity})
        return cls(
            setup,
            model_dir,
            task,
            ServerOptimizerConfig.from_json(settings["server_optimizer"]),
            rounds,
            workers,
            central_examples(setup, TFLiteModel(model_dir).manifest, account_ids),
            central_steps,
            central_learning_rate,
            examples_per_pseudo_user,
            declare_new_items,
        )

    def for_strategy(self, strategy: str) -> Harness:
        """The harness a strategy trains and is scored with: a mixing strategy's task declares the
        new items central-only (unless not `declare_new_items`); `none` and `all_data` never do
        (with all data the devices hold them)."""
        if not self.declare_new_items:
            return self
        samples_negatives = load_manifest(self.model_dir).task.negative_sampling
        rows = central_only_rows(strategy, self.setup.new_items, samples_negatives)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, central_only_items=rows))

    def trainers(self, keep_new: bool) -> tuple[list[int], list[DeviceData]]:
        """The training users with at least `min_examples` shares, and every user's device data."""
        devices = [self.setup.device(u, keep_new) for u in range(len(self.setup.data.devices))]
        users = [u for u in self.setup.train_users if len(devices[u]) >= self.config.min_examples]
        return users, devices

    def client_batches(
        self, manifest: Manifest, history: DeviceData, user: int, round_: int, weights: np.ndarray | None
    ) -> tuple[list[Examples], list[Examples]]:
        """A device's support and query batches for one participation: its shares plus fresh
        negatives (drawn by `weights`, `negative_weights` of the round's globals)."""
        rng = np.random.default_rng((self.rounds.sampling_seed, user, round_))
        examples = _with_negatives(_newest_first(history), manifest, self.config, rng, weights)
        return split_support_query(examples, manifest, self.config)


# ---- the strategies ------------------------------------------------------------------------


def mixing_config(harness: Harness, strategy: str, weight: float | None) -> MixingConfig:
    """The population's mixing config for a strategy of the table (`all_data` trains as `none`):
    `weight` is alpha for parallel training, the number of examples per assignment for example
    transfer, the gradient's weight for gradient transfer; the production config checks its range."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if (strategy in WEIGHTED) != (weight is not None):
        raise ValueError(f"{', '.join(WEIGHTED)} take a weight, the other strategies none")
    if strategy in ("none", "all_data"):
        return MixingConfig()
    assert weight is not None
    if strategy == "example_transfer":
        if weight != int(weight):
            raise ValueError(f"example_transfer's weight is a number of examples, got {weight}")
        return MixingConfig("example_transfer", examples_per_assignment=int(weight))
    if strategy == "parallel_training":
        return MixingConfig(
            "parallel_training",
            weight=weight,
            central_steps=harness.central_steps,
            central_learning_rate=harness.central_learning_rate,
            examples_per_pseudo_user=harness.examples_per_pseudo_user,
        )
    return MixingConfig(
        "gradient_transfer", weight=weight, examples_per_pseudo_user=harness.examples_per_pseudo_user
    )


def run_strategy(harness: Harness, strategy: str, weight: float | None = None) -> StrategyResult:
    """Train with one strategy and score the held-out devices."""
    mixing = mixing_config(harness, strategy, weight)
    harness = harness.for_strategy(strategy)
    started = time.perf_counter()
    trained = train(harness, mixing, keep_new=strategy == "all_data")
    new_items, overall = evaluate(harness, trained.params)
    extra = {"central_failed_rounds": trained.central_failed} if mixing.strategy != "none" else {}
    return StrategyResult(
        strategy,
        weight,
        new_items,
        overall,
        trained.bytes_per_assignment,
        time.perf_counter() - started,
        trained.refused,
        extra,
    )


@dataclass(frozen=True)
class Trained:
    params: Params  # the final globals
    refused: int  # diverged device updates the server left out
    bytes_per_assignment: float  # what mixing added to a training assignment, mean over assignments
    central_failed: int  # rounds whose central delta or gradient diverged (the round stayed federated)


def train(harness: Harness, mixing: MixingConfig, keep_new: bool = False) -> Trained:
    """150 rounds (or the harness's) of FedRecon with `mixing`; the devices keep the new items
    only with `keep_new` (the upper bound). The server's side of each strategy is the
    orchestrator's own functions: `train_on_central` and `merge` (parallel training),
    `assignment_examples` and `encode_examples` (example transfer), `gradient_on_central` and
    `encode_sparse_delta` (gradient transfer); the device's side is `with_central` and
    `TFLiteModel.update_rows(central_gradient=...)`."""
    rounds = harness.rounds
    users, histories = harness.trainers(keep_new)
    rng = np.random.default_rng(rounds.sampling_seed)
    population = np.asarray(users)
    per_round = min(rounds.clients_per_round, len(population))
    refused, failed, sent_bytes, assignments = 0, 0, 0, 0
    with Devices(harness.model_dir, harness.workers) as devices:
        manifest = devices.manifest
        per_item = per_item_names(manifest)
        server_model = TFLiteModel(harness.model_dir)  # the server's own interpreter
        server = Server(server_model.get_global(), harness.optimizer)
        for r in range(1, rounds.rounds + 1):
            devices.set_global(server.params)
            clients = rng.choice(population, size=per_round, replace=False).tolist()
            assignments += len(clients)
            gradient: SparseGradient | None = None
            examples: dict[int, Examples] = {}
            if mixing.strategy == "gradient_transfer":
                try:
                    gradient = gradient_on_central(
                        server_model,
                        server.params,
                        harness.central,
                        harness.config,
                        r,
                        mixing.examples_per_pseudo_user,
                    ).gradient
                    sent_bytes += len(encode_sparse_delta(gradient)) * len(clients)
                except CentralTrainingError:  # the route answers 503; the devices train without it
                    failed += 1
            elif mixing.strategy == "example_transfer":
                for user in clients:
                    examples[user] = assignment_examples(
                        harness.central.examples, mixing, f"round-{r}-device-{user}"
                    )
                    sent_bytes += len(encode_examples(examples[user], manifest.features))
            work = _client_work(harness, histories, per_item, r, gradient, mixing.weight, examples)
            reports = devices.map(work, clients)
            merge_central = None
            if mixing.strategy == "parallel_training":
                try:
                    central = train_on_central(
                        server_model, server.params, harness.central, mixing, harness.config, seed=r
                    )
                    merge_central = functools.partial(merge, central=central.delta, alpha=mixing.weight)
                except CentralTrainingError:  # as the orchestrator does: the round stays federated
                    failed += 1
            refused += server.commit(reports, merge_central)
    return Trained(server.params, refused, sent_bytes / max(assignments, 1), failed)


def _client_work(
    harness: Harness,
    histories: Sequence[DeviceData],
    per_item: frozenset[str],
    round_: int,
    gradient: SparseGradient | None,
    gradient_weight: float,
    central: Mapping[int, Examples],
) -> Callable[[TFLiteModel, Params, int], Report]:
    """FedRecon's client task (Algorithm 1) as `run_training_task` does it: the assignment's
    centralized examples (example transfer) mixed into the update's batches, the central gradient
    (gradient transfer) added to each update step; the reported weight is the device's own query."""
    config = harness.config

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        manifest = model.manifest
        weights = negative_weights(manifest, config, params)
        support, query = harness.client_batches(manifest, histories[user], user, round_, weights)
        own = TaskBatches.pack(query, manifest)
        trained = own
        if user in central:
            seed = round_ * _SEED_STRIDE + user
            trained = TaskBatches.pack(
                with_central(query, central[user], manifest, config, seed, weights), manifest
            )
        step = fedrecon_step(
            model,
            TaskBatches.pack(support, manifest),
            trained,
            config,
            central_gradient=gradient,
            weight=gradient_weight if gradient is not None else 0.0,
        )
        if isinstance(step, Halt):
            return None
        shapes = {k: tuple(v.shape) for k, v in params.items()}
        return sparse_delta(step.trained.update, shapes, per_item), float(own.num_examples)

    return work


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
    runs: Sequence[tuple[str, float | None]],
    central_steps: int = CENTRAL_STEPS,
    central_learning_rate: float = CENTRAL_LEARNING_RATE,
    examples_per_pseudo_user: int | None = None,
    account_ids: bool = True,
    negative_popularity: float = 0.0,
    declare_new_items: bool = True,
) -> list[dict[str, Any]]:
    """Every (strategy, weight) of `runs` on every setup; prints each row as it comes."""
    rows = []
    for setup in setups:
        harness = Harness.build(
            setup,
            models,
            rounds,
            workers,
            central_steps,
            central_learning_rate,
            examples_per_pseudo_user,
            account_ids,
            negative_popularity,
            declare_new_items,
        )
        ceiling: StrategyResult | None = None
        for strategy, weight in runs:
            result = run_strategy(harness, strategy, weight)
            if strategy == CEILING:
                ceiling = result
            rows.append({"data": setup.name, **result.to_json(), **ceiling_share(result, ceiling)})
            print(table_line(rows[-1]), flush=True)
    return rows


CEILING = "all_data"  # the ceiling of every other row: its devices keep the new items


def ceiling_share(result: StrategyResult, ceiling: StrategyResult | None) -> dict[str, Any]:
    """Which row is the ceiling, and (once it ran) this row's new-items hit rate as a share of the
    ceiling's with its 95% interval: every row scores the same devices, so both rows' devices are
    resampled together (paired)."""
    if result.strategy == CEILING:
        return {"ceiling": None, "is_ceiling": True}
    out: dict[str, Any] = {"ceiling": CEILING}
    top = None if ceiling is None else ceiling.new_items
    if top is None or not top.hits or sum(top.hits) <= 0 or len(top.hits) != len(result.new_items.hits):
        return out
    rows = resample_rows(len(top.hits), np.random.default_rng(0))
    share = bootstrap_ratio(np.asarray(result.new_items.hits), np.asarray(top.hits), rows)
    return {
        **out,
        "share_of_ceiling_new_items": share.value,
        "share_of_ceiling_new_items_95": [share.low, share.high],
    }


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
    f"95% intervals over the scored devices; the ceiling is the {CEILING} row (its devices keep the "
    "new items)\n"
    f"| data | strategy | weight | new items HR@{K} [95%] | new items NDCG@{K} [95%] | "
    f"overall HR@{K} [95%] | overall NDCG@{K} [95%] | new items HR, share of the ceiling's [95%] | "
    "extra bytes / assignment | "
    "seconds |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_line(row: dict[str, Any]) -> str:
    if row.get("is_ceiling"):
        share = "(the ceiling)"
    elif "share_of_ceiling_new_items" in row:
        low, high = row["share_of_ceiling_new_items_95"]
        share = f"{row['share_of_ceiling_new_items']:.2f} [{low:.2f}, {high:.2f}]"
    else:
        share = f"({CEILING} not run)"
    return (
        f"| {row['data']} | {row['strategy']} | {setting(row['strategy'], row['weight'])} | "
        f"{_shown(row['new_items'])} | {_shown(row['new_items'], 'ndcg')} | "
        f"{_shown(row['overall'])} | {_shown(row['overall'], 'ndcg')} | {share} | "
        f"{_bytes(row['bytes_per_assignment'])} | {row['seconds']:.0f} |"
    )


def _shown(scored: dict[str, Any], metric: str = "hit_rate") -> str:
    low, high = scored.get(f"{metric}@{K}_95", (math.nan, math.nan))
    return f"{scored[f'{metric}@{K}']:.3f} [{low:.3f}, {high:.3f}]"


def setting(strategy: str, weight: float | None) -> str:
    """The weight column: alpha, examples per assignment, or the gradient's weight."""
    if weight is None:
        return ""
    if strategy == "parallel_training":
        return f"alpha {weight:g}"
    if strategy == "example_transfer":
        return f"{weight:g} examples"
    return f"{weight:g}"


def _bytes(n: float) -> str:
    if n <= 0:
        return "0"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{math.ceil(n)} B"
