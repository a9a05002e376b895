"""The quality benchmark's methods: FedRecon with the paper's settings and ours, the baselines
(FedAvg with stateful or shared user parameters, centralized training) and how each is scored, on
a MovieLens-style split, through the exported model.

Every device-side number comes from the `.tflite` signatures (`TFLiteModel`); the server side is
the orchestrator's aggregation and server optimizer. `protocol.py` has the splits, `federated.py`
the rounds; `quality.py` runs these methods as the benchmark command.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.movielens import load_ratings
from android_sim.simulation.clients import evaluation_task, packed_clients
from android_sim.simulation.protocol import (
    UserSplit,
    all_batches,
    pack_support_query,
    time_split,
    user_examples,
)
from android_sim.simulation.rounds import (
    Devices,
    PrivateLocals,
    Rounds,
    Server,
    TrainingRun,
    fedavg_work,
    furl_work,
    per_item_names,
    private_locals_eval_work,
    recon_eval_work,
    shared_locals_eval_work,
    train_federated,
)
from android_sim.simulation.simulate import SimulationOptions, simulate
from benchmarks.figures import total, user_intervals
from benchmarks.model_cache import ModelCache
from benchmarks.quality_report import (
    MethodResult,
)
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.fedrecon_step import diverged
from model_export.config import ModelConfig
from model_runtime.support_query import num_steps
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import EvaluationSums, TFLiteModel
from orchestrator.aggregation.differential_privacy import DPConfig
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.quantization import Layout

# Model fields a run may change; the rest (catalog, batch shapes) the protocol fixes.
MODEL_CHOICES = (
    "embedding_dim",
    "item_bias",
    "user_bias",
    "global_mean",
    "global_mean_init",
    "init_stddev",
    "huber_delta",
    "clip_predictions",
)


def protocol_model(num_items: int, **changes: Any) -> ModelConfig:
    """Dimension 50, batch size 5, no biases; support and query take up to 30 batches each (300
    examples in all). Twice that bound doubles a FedRecon task's time: the update's per-step
    work is over the whole padded row table."""
    base = ModelConfig(
        num_items=num_items, embedding_dim=50, batch_size=5, max_batches=30, top_k=min(100, num_items)
    )
    return replace(base, **changes)


def whole_user_model(num_items: int, **changes: Any) -> ModelConfig:
    """The protocol's model taking all of a user's 300 examples in one call (FedAvg, FURL, centralized)."""
    return protocol_model(num_items, **{**changes, "max_batches": 60})


@dataclass(frozen=True)
class FedReconSettings:
    """What a FedRecon run can vary: model options, the device task, the server optimizer."""

    model: dict[str, Any] = field(default_factory=dict)  # MODEL_CHOICES over the protocol model
    task: TaskConfig = field(default_factory=TaskConfig)
    server: ServerOptimizerConfig = field(default_factory=lambda: ServerOptimizerConfig("sgd", 1.0))
    # None: the plain weighted mean, as the paper; else the orchestrator's robust aggregation.
    aggregation: RobustAggregation | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.model) - set(MODEL_CHOICES))
        if unknown:
            raise ValueError(f"unknown model settings {unknown}; a run may set {list(MODEL_CHOICES)}")
        protocol_model(1, **self.model)  # a bad value fails here, before any run, in one line

    def model_config(self, num_items: int) -> ModelConfig:
        return protocol_model(num_items, **self.model)

    def to_json(self) -> dict[str, Any]:
        out = {"model": dict(self.model), "task": self.task.to_json(), "server": self.server.to_json()}
        return out if self.aggregation is None else {**out, "aggregation": asdict(self.aggregation)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FedReconSettings:
        known = [f.name for f in fields(cls)]
        if not isinstance(data, dict) or set(data) - set(known):
            raise ValueError(f"settings must be a JSON object with keys from {known}")
        return cls(
            model=dict(data.get("model", {})),
            task=TaskConfig.from_json(data.get("task", {})),
            server=ServerOptimizerConfig.from_json(data.get("server", {"name": "sgd"})),
            aggregation=RobustAggregation(**data["aggregation"]) if "aggregation" in data else None,
        )


# The protocol's FedRecon (DESIGN.md): client SGD 0.5, server SGD 1.0, reconstruction SGD 0.1.
FAITHFUL = FedReconSettings()

# FedAvg with one user vector shared by everyone (not the paper's FedAvg): it trains jointly with
# the items, where client SGD 0.5 diverges; 0.1 had the best validation RMSE of {0.2, 0.1, 0.05}.
SHARED_USER = FedReconSettings(task=TaskConfig(update_learning_rate=0.1))

# The paper's FedAvg rows (= FURL, a population with `local_state: keep`): each device's own user
# vector, kept and trained jointly with the items at local rate 0.1 (the reconstruction rate).
# Without L2 its validation RMSE rises after round 75 (1.05 -> 1.16 at 300), an overfit
# typical of unregularized MF. L2 0.1 on both was the steadiest of
# {0.1/0.1, 0.01/0.01, 0.1 items/0.01 user} over 200 rounds.
FURL = FedReconSettings(
    task=TaskConfig(l2_global=0.1, l2_local=0.1, local_state=LocalState.KEEP, local_learning_rate=0.1)
)

# The project's best configuration, chosen on validation users (README, "Quality benchmark"):
# - biases and a global mean (started at the rating scale's midpoint and trained);
# - a Huber loss (delta 1): a few surprising ratings no longer drag the item rows, which
#   improved both validation RMSE and accuracy;
# - training reconstructs and updates on all of a device's examples (`reuse`); evaluation
#   still reconstructs on the support batches and measures on the query batches;
# - reconstruction SGD 0.1 for up to 10 epochs / 150 steps with L2 0.05 on the user
#   parameters (fitting harder without that L2 made validation RMSE rise over the rounds);
# - L2 0.1 on the item rows a batch uses; update at most 100 steps.
BETTER = FedReconSettings(
    model={
        "item_bias": True,
        "user_bias": True,
        "global_mean": True,
        "global_mean_init": 3.0,
        "huber_delta": 1.0,
    },
    task=TaskConfig(
        split=SplitPolicy.REUSE,
        reconstruction_learning_rate=0.1,
        reconstruction_max_epochs=10,
        reconstruction_max_steps=150,
        update_max_steps=100,
        l2_global=0.1,
        l2_local=0.05,
    ),
)


@dataclass(frozen=True)
class Dataset:
    name: str
    num_items: int
    examples: list[Examples]  # per user, newest first


def load_dataset(path: Path) -> Dataset:
    ratings = load_ratings(path)
    return Dataset(path.name, ratings.num_items, user_examples(ratings))


HELD_OUT = "held-out test users, ReconEval (reconstruct on support, measure on query)"
SEEN = "training users' newest 10% of ratings, StandardEval (their trained user parameters)"
SHARED = "held-out test users, the shared user vector (no reconstruction)"


def initial_globals(model_dir: Path) -> Params:
    return TFLiteModel(model_dir).get_global()


@dataclass(frozen=True)
class SecureQuantization:
    """Secure aggregation's arithmetic for a benchmark run: what the orchestrator would announce."""

    clip_norm: float
    bits: int
    max_summands: int  # the round's capacity: clients per round x oversampling

    def parameters(self, vector_length: int) -> RoundParameters:
        # Neighbours, threshold and survivors only concern the masks, which cancel in the sum.
        return RoundParameters(
            context="quality benchmark",
            vector_length=vector_length,
            bits=self.bits,
            clip_norm=self.clip_norm,
            max_summands=self.max_summands,
            neighbours=0,
            threshold=1.0,
            min_survivors=1,
        )


def run_fedrecon(
    data: Dataset,
    split: UserSplit,
    settings: FedReconSettings,
    rounds: Rounds,
    models: ModelCache,
    workers: int,
    method: str = "fedrecon",
    dp: DPConfig | None = None,
    secure: SecureQuantization | None = None,
) -> MethodResult:
    """FedRecon; with `dp`, DP-FedAvg: devices clip to `dp.clip_norm`, the server noises the sum.
    With `secure`, secure aggregation's quantization: dense deltas clipped to `secure.clip_norm`,
    quantized, summed modulo 2^bits and dequantized, every device weighing the same."""
    if dp is not None and secure is not None and dp.clip_norm != secure.clip_norm:
        raise ValueError(f"DP clip norm {dp.clip_norm} differs from secure clip norm {secure.clip_norm}")
    clip_norm = secure.clip_norm if secure is not None else dp.clip_norm if dp is not None else None
    if clip_norm is not None:
        settings = replace(settings, task=replace(settings.task, clip_norm=clip_norm))
    model_dir = models.get(settings.model_config(data.num_items))

    def make_server(initial: Params, manifest: Manifest) -> Server:
        layout = Layout.of(manifest.global_params)
        return Server(
            initial,
            settings.server,
            settings.aggregation,
            dp,
            np.random.default_rng(rounds.sampling_seed),
            None if secure is None else (secure.parameters(layout.length), layout),
        )

    options = SimulationOptions(rounds, settings.task, settings.server, settings.aggregation, workers)
    found = simulate(model_dir, data.examples, options, make_server, split)
    test = {k: v for k, v in found.held_out.items() if k != "devices"}
    run = TrainingRun(found.params, found.curve, found.seconds, found.refused)
    result = _result(method, HELD_OUT, test, run, len(split.test), settings.to_json())
    with Devices(model_dir, workers) as pool:
        held_out = {u: data.examples[u] for u in split.test}
        clients = packed_clients(held_out, pool.manifest, evaluation_task(settings.task))
        pool.set_global(found.params)
        sums = pool.map(recon_eval_work(clients, settings.task), split.test)
    return replace(result, intervals=user_intervals(sums), per_user=sums)


def _result(
    method: str,
    evaluated_on: str,
    test: dict[str, float],
    run: TrainingRun,
    users: int,
    settings: dict[str, Any],
) -> MethodResult:
    return MethodResult(
        method,
        evaluated_on,
        {**test, "users": users},
        run.curve,
        run.seconds,
        {**settings, "refused": run.refused},
    )


def _scored(
    method: str, evaluated_on: str, sums: list[EvaluationSums], run: TrainingRun, settings: dict[str, Any]
) -> MethodResult:
    """A row from its users' evaluation sums: the figures over all of them and their intervals."""
    result = _result(method, evaluated_on, total(sums).metrics(), run, len(sums), settings)
    return replace(result, intervals=user_intervals(sums), per_user=sums)


def run_shared_user(
    data: Dataset, split: UserSplit, rounds: Rounds, models: ModelCache, workers: int
) -> MethodResult:
    """FedAvg with the user vector global too, one for everyone, no reconstruction (TFF's plain
    FedAvg recipe applied to the whole model; not the paper's FedAvg, whose user vectors are private)."""
    settings = SHARED_USER
    model_dir = models.get(whole_user_model(data.num_items))
    with Devices(model_dir, workers) as devices:
        clients = pack_support_query(data.examples, devices.manifest, settings.task)
        every = [all_batches(e, devices.manifest, settings.task) for e in data.examples]
        evaluation = shared_locals_eval_work(clients)

        def validate(params: Params) -> dict[str, float]:
            return devices.metrics_of(params, evaluation, split.validation)

        shared_user = {s.name: np.zeros(s.shape, np.float32) for s in devices.manifest.local_params}
        server = Server({**initial_globals(model_dir), **shared_user}, settings.server)
        work = fedavg_work(every, settings.task, per_item_names(devices.manifest))
        run = train_federated(devices, server, split.train, work, rounds, validate)
        devices.set_global(run.params)
        sums = devices.map(evaluation, split.test)
    return _scored("fedavg_shared_user", SHARED, sums, run, settings.to_json())


def run_fedavg_stateful(
    data: Dataset, split: UserSplit, rounds: Rounds, models: ModelCache, workers: int
) -> tuple[MethodResult, MethodResult]:
    """The paper's FedAvg (= FURL): the training users keep their own user vectors and train them
    jointly with the items on their oldest 80%. One training, two rows: StandardEval on their
    newest 10% with the kept vectors, and ReconEval on the held-out test users. Validation curve:
    the training users' next 10% (StandardEval)."""
    settings = FURL
    model_dir = models.get(whole_user_model(data.num_items))
    with Devices(model_dir, workers) as devices:
        users = [time_split(e, devices.manifest) for e in data.examples]
        kept = PrivateLocals(devices.manifest)
        validation = private_locals_eval_work(users, kept, "validation")

        def validate(params: Params) -> dict[str, float]:
            return devices.metrics_of(params, validation, split.train)

        server = Server(initial_globals(model_dir), settings.server)
        work = furl_work(users, kept, settings.task, per_item_names(devices.manifest))
        run = train_federated(devices, server, split.train, work, rounds, validate)
        devices.set_global(run.params)
        seen = devices.map(private_locals_eval_work(users, kept, "test"), split.train)
        held_out = pack_support_query(data.examples, devices.manifest, FAITHFUL.task)
        unseen = devices.map(recon_eval_work(held_out, FAITHFUL.task), split.test)
    return (
        _scored("fedavg_standard_eval", SEEN, seen, run, settings.to_json()),
        _scored("fedavg_recon_eval", HELD_OUT, unseen, run, settings.to_json()),
    )


def train_centralized(
    model: TFLiteModel,
    params: Params,
    batches: Sequence[TaskBatches],
    users: Sequence[int],
    kept: PrivateLocals,
    config: TaskConfig,
    epochs: int,
    validate: Callable[[Params], dict[str, float]],
    seed: int = 0,
) -> TrainingRun:
    """Centralized matrix factorization: a server that holds every training rating runs SGD over
    them, one user at a time in a new order each epoch, with the model's `update` signature
    training user and item parameters jointly. Keeps the epoch with the best validation RMSE."""
    per_item = per_item_names(model.manifest)
    params = {k: v.copy() for k, v in params.items()}
    # The model keeps a reference and reads the arrays at every call: updating them in place
    # is what makes each user's step see the previous one's.
    model.set_global(params)
    rng = np.random.default_rng(seed)
    run = TrainingRun({k: v.copy() for k, v in params.items()})
    started = time.perf_counter()
    best_rmse = float("inf")
    best_locals = kept.snapshot()
    for epoch in range(1, epochs + 1):
        for user in rng.permutation(np.asarray(users)).tolist():
            user_batches = batches[user]
            model.set_local(kept.get(user))
            update = model.update_rows(
                user_batches,
                num_steps(user_batches.num_batches, 1, user_batches.num_batches),
                config.update_learning_rate,
                local_learning_rate=config.update_learning_rate,
                l2_global=config.l2_global,
                l2_local=config.l2_local,
            )
            if diverged(update):
                run.refused += 1
                continue
            kept.put(user, model.get_local())
            for name, delta in update.delta.items():
                if name in per_item:
                    params[name][update.rows[name]] += delta
                else:
                    params[name] += delta
        metrics = validate(params)
        run.curve.append({"round": epoch, **metrics})
        if metrics["rmse"] < best_rmse:
            best_rmse = metrics["rmse"]
            run.params = {k: v.copy() for k, v in params.items()}
            best_locals = kept.snapshot()
    kept.restore(best_locals)
    run.seconds = time.perf_counter() - started
    return run


def run_centralized_recon_eval(
    data: Dataset,
    split: UserSplit,
    config: TaskConfig,
    epochs: int,
    models: ModelCache,
    workers: int,
    like: FedReconSettings = FAITHFUL,
    method: str = "centralized_recon_eval",
) -> MethodResult:
    """Centralized MF on the training users' ratings, evaluated by ReconEval on held-out users;
    `like`: the FedRecon run whose model options and ReconEval (reconstruction) it shares, so
    that it is that run's ceiling."""
    model_dir = models.get(whole_user_model(data.num_items, **like.model))
    model = TFLiteModel(model_dir)
    task = evaluation_task(like.task)
    with Devices(model_dir, workers) as devices:
        clients = pack_support_query(data.examples, devices.manifest, task)
        evaluation = recon_eval_work(clients, task)

        def validate(params: Params) -> dict[str, float]:
            return devices.metrics_of(params, evaluation, split.validation)

        kept = PrivateLocals(devices.manifest)
        every = [all_batches(e, devices.manifest, config) for e in data.examples]
        run = train_centralized(
            model, initial_globals(model_dir), every, split.train, kept, config, epochs, validate
        )
        devices.set_global(run.params)
        sums = devices.map(evaluation, split.test)
    settings = {**_central_json(config, epochs), "model": dict(like.model), "evaluation": task.to_json()}
    return _scored(method, HELD_OUT, sums, run, settings)


def run_centralized_standard_eval(
    data: Dataset, split: UserSplit, config: TaskConfig, epochs: int, models: ModelCache, workers: int
) -> MethodResult:
    """Centralized MF on the training users' oldest 80%, evaluated on their newest 10%
    (StandardEval; the same users and ratings as FedAvg + StandardEval)."""
    model_dir = models.get(whole_user_model(data.num_items))
    model = TFLiteModel(model_dir)
    with Devices(model_dir, workers) as devices:
        users = [time_split(e, devices.manifest) for e in data.examples]
        everyone = split.train
        kept = PrivateLocals(devices.manifest)

        def validate(params: Params) -> dict[str, float]:
            return devices.metrics_of(params, private_locals_eval_work(users, kept, "validation"), everyone)

        train = [u.train for u in users]
        run = train_centralized(
            model, initial_globals(model_dir), train, everyone, kept, config, epochs, validate
        )
        devices.set_global(run.params)
        sums = devices.map(private_locals_eval_work(users, kept, "test"), everyone)
    return _scored("centralized_standard_eval", SEEN, sums, run, _central_json(config, epochs))


def _central_json(config: TaskConfig, epochs: int) -> dict[str, Any]:
    return {
        "epochs": epochs,
        "learning_rate": config.update_learning_rate,
        "l2_global": config.l2_global,
        "l2_local": config.l2_local,
    }


# Centralized SGD over users: unregularized at 0.1 it overfits within 4 epochs and diverges by
# the 12th; 0.05 with L2 0.1 had the best validation RMSE of the two regularized settings tried.
CENTRALIZED = TaskConfig(update_learning_rate=0.05, l2_global=0.1, l2_local=0.1)
