"""Federated rounds in one process, with the exported TFLite model doing every device's maths.

The transport is a function call (the quality benchmark measures the algorithm, not HTTP);
everything else is the system's own: each client task runs the `.tflite` signatures through
`TFLiteModel` (`reconstruct`, `update`, `evaluate`), and the server is the orchestrator's
aggregation stages (orchestrator/pipeline: the weighted mean over sparse deltas, robust clipping,
DP noise) followed by its server optimizer (`apply_update`).

Speed (500 rounds x 100 clients in about half a minute on 2 cores):
- every user's batches are packed once, before the first round;
- client tasks run on a pool of threads, each with its own interpreter (TFLite's invoke
  releases the GIL), and each thread installs a round's globals once, not once per task;
- updates come back as the task's rows (`RowUpdate`), never as a dense catalog-sized delta.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from contracts.manifest import Manifest
from contracts.params import Params, SparseTensor, row_shape
from contracts.task_config import TaskConfig
from device_runtime.fedrecon_step import Halt, fedrecon_step, recon_eval_step, train_globals
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import EvaluationSums, RowUpdate, TFLiteModel
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.differential_privacy import DPConfig
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.pipeline import Aggregate
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig, apply_update, init_state
from orchestrator.aggregation.weighted_mean import PartialSum, WeightedMean
from secure_aggregation.config import RoundParameters
from secure_aggregation.quantization import Layout, dequantize_sum, quantize

R = TypeVar("R")
T_co = TypeVar("T_co", covariant=True)
W_contra = TypeVar("W_contra", contravariant=True)

# A client's report as the orchestrator stores it (sparse delta, weight); None when it diverged.
Report = tuple[dict[str, SparseTensor], float] | None
ClientWork = Callable[[TFLiteModel, Params, int], Report]
EvaluationWork = Callable[[TFLiteModel, Params, int], EvaluationSums]


class ByUser(Protocol[T_co]):
    """Per-user data by user index: a list of every user's, or a dict of some users' (the shard
    of the devices a simulation's Ray worker holds)."""

    def __getitem__(self, user: int, /) -> T_co: ...


class ClientPool(Protocol[W_contra]):
    """Where a round's client tasks run: `Devices` (this process's threads, handed the work
    itself), or a simulation's pool that names the work its workers hold (`simulation.clients`)."""

    def set_global(self, params: Params) -> None: ...

    def map(self, work: W_contra, users: Sequence[int]) -> list[Any]: ...


@runtime_checkable
class SummingPool(Protocol[W_contra]):
    """A pool whose workers add up their share of a round's reports themselves (`summed`), so that
    the server gets one partial sum a worker instead of every report: what keeps the server's part
    of a round from growing with the round's clients (`android_sim.simulation.ray_clients.RayClients`)."""

    def map_summed(
        self, work: W_contra, users: Sequence[int], shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[list[PartialSum], int]:
        """The partial sums of `users`' reports (one a worker that has any) and how many diverged."""
        ...


def summed(reports: Iterable[Report], shapes: Mapping[str, tuple[int, ...]]) -> tuple[PartialSum | None, int]:
    """Reports added up as the server's weighted mean adds them (None: none to add), and how many
    diverged (left out, as the server leaves them out)."""
    mean = WeightedMean(shapes)
    refused = 0
    for report in reports:
        if report is None:
            refused += 1
        else:
            mean.add_sparse(*report)
    return (mean.partial() if mean.count else None), refused


@dataclass(frozen=True)
class SupportQuery:
    """A user's examples packed once: the protocol's alternating support and query batches."""

    support: TaskBatches
    query: TaskBatches


@dataclass(frozen=True)
class TimeSplit:
    """A seen user's examples split by time: oldest 80% train, next 10% validation, newest 10% test."""

    train: TaskBatches
    validation: TaskBatches
    test: TaskBatches


class Devices:
    """Tasks on `workers` threads, one `TFLiteModel` (interpreter) per thread.

    `map` hands every task its thread's model with the current globals installed; a thread
    re-installs them only when `set_global` has been given new ones since its last task.
    """

    def __init__(self, model_dir: Path, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.model_dir = model_dir
        self.manifest: Manifest = TFLiteModel(model_dir).manifest
        self._model_globals = {s.name for s in self.manifest.global_params}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="bench-device")
        self._local = threading.local()
        self._params: Params = {}
        self._version = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Devices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_global(self, params: Params) -> None:
        """The server's parameters for the next tasks (a server may hold more than the model,
        e.g. FedAvg's shared user vector; the model gets its own globals)."""
        self._params = params
        self._version += 1

    def _model(self) -> TFLiteModel:
        local = self._local
        if getattr(local, "model", None) is None:
            local.model = TFLiteModel(self.model_dir)
            local.version = -1
        model: TFLiteModel = local.model
        if local.version != self._version:
            model.set_global({k: v for k, v in self._params.items() if k in self._model_globals})
            local.version = self._version
        return model

    def map(self, work: Callable[[TFLiteModel, Params, int], R], users: Sequence[int]) -> list[R]:
        """`work(model, server params, user)` for every user, results in the users' order."""
        # A few tasks per future: a future per task costs more than a short task's Python side.
        chunk = 8
        params = self._params

        def run(start: int) -> list[R]:
            model = self._model()
            return [work(model, params, int(u)) for u in users[start : start + chunk]]

        results: list[R] = []
        for part in self._pool.map(run, range(0, len(users), chunk)):
            results.extend(part)
        return results

    def evaluate(self, work: EvaluationWork, users: Sequence[int]) -> EvaluationSums:
        total = EvaluationSums.zero()
        for sums in self.map(work, users):
            total = total + sums
        return total

    def metrics_of(self, params: Params, work: EvaluationWork, users: Sequence[int]) -> dict[str, float]:
        """Install `params` as the globals, then the example-weighted metrics of `work` over `users`."""
        self.set_global(params)
        return self.evaluate(work, users).metrics()


def per_item_names(manifest: Manifest) -> frozenset[str]:
    """The row-sparse globals: a client's update holds only its rows of these."""
    return frozenset(s.name for s in manifest.global_params if s.row_sparse is not None)


def sparse_delta(
    update: RowUpdate, shapes: Mapping[str, tuple[int, ...]], per_item: frozenset[str]
) -> dict[str, SparseTensor]:
    """A client's update as the orchestrator stores a report: the item rows it touched, the
    other tensors whole."""
    out: dict[str, SparseTensor] = {}
    for name, values in update.delta.items():
        if name in per_item:
            out[name] = SparseTensor(shapes[name], update.rows[name], values)
        else:
            out[name] = whole(values)
    return out


def whole(values: np.ndarray) -> SparseTensor:
    """A small tensor (global mean, a shared user vector) as a sparse tensor with every row."""
    rows = values.reshape(row_shape(values.shape))
    return SparseTensor(values.shape, np.arange(len(rows)), rows)


class Server:
    """The orchestrator's commit: the weighted mean of the round's reports, then the server optimizer;
    through the orchestrator's own pipeline object (orchestrator/aggregation: `Pipeline`), which
    stacks the same stages as a population's commit, for every aggregation mode.

    With `aggregation`, the orchestrator's robust aggregation (clipping, capped weights, optionally
    a trimmed mean or median). With `dp` (DP-FedAvg), as the orchestrator does: every report weighs
    the same and the mean is the noised mean of their sum; `rng` is seeded here so that a benchmark
    run can be repeated. With `secure` (secure aggregation's arithmetic), every report is flattened
    densely in `layout`'s order, clipped and quantized as a device does, the integers are summed
    modulo 2^bits and the sum is dequantized, as the server unmasks it (the masks cancel exactly in
    that sum, so they are left out); every report weighs the same, and with `dp` the sum is noised.
    """

    def __init__(
        self,
        params: Params,
        optimizer: ServerOptimizerConfig,
        aggregation: RobustAggregation | None = None,
        dp: DPConfig | None = None,
        rng: np.random.Generator | None = None,
        secure: tuple[RoundParameters, Layout] | None = None,
    ) -> None:
        self.params = {k: np.asarray(v, np.float32) for k, v in params.items()}
        self.optimizer = optimizer
        self.aggregation = aggregation
        self.norm_reference: NormReference | None = None
        self.state = init_state(optimizer, self.params)
        self.shapes = {k: tuple(v.shape) for k, v in self.params.items()}
        self.dp = dp
        self.rng = rng or np.random.default_rng(0)
        self.secure = secure
        if dp is not None and dp.adaptive:
            raise ValueError(
                "the simulated server keeps its clip norm fixed: adaptive clipping is the orchestrator's"
            )
        # The orchestrator's own pipeline object, built from the same parts as a population's
        # settings build it; its noise draws from this server's seeded `rng`.
        self.pipeline = Pipeline(self.shapes, aggregation, dp, rng=lambda: self.rng)

    def commit(self, reports: Sequence[Report], merge: Callable[[Params], Params] | None = None) -> int:
        """Apply one round; returns how many reports were refused (diverged). `merge` takes the
        round's mean delta before the server optimizer (parallel training's MERGEOPT)."""
        taken = [report for report in reports if report is not None]
        if not taken:
            return len(reports)
        if self.secure is not None:
            deltas = [delta for delta, _ in taken]
            aggregate = self.pipeline.aggregate(
                RoundInputs(0), secure=(self._secure_mean(deltas), len(deltas))
            )
        else:
            weights = [weight for _, weight in taken]
            inputs = RoundInputs(0, weights=weights, reference=self.norm_reference)
            aggregate = self.pipeline.aggregate(inputs, taken)
        self._apply(aggregate, merge)
        return len(reports) - len(taken)

    @property
    def sums_in_parts(self) -> bool:
        """Whether a round may come as partial sums (`commit_partials`): the plain weighted mean."""
        return self.secure is None and self.pipeline.sums_in_parts

    def commit_partials(self, partials: Sequence[PartialSum], refused: int) -> int:
        """Apply one round whose reports were added up where they were made (`summed`); returns
        `refused`, the diverged reports left out there."""
        if partials:
            self._apply(self.pipeline.aggregate(RoundInputs(0), partials=partials), None)
        return refused

    def _apply(self, aggregate: Aggregate, merge: Callable[[Params], Params] | None) -> None:
        mean_delta = aggregate.mean_delta
        if aggregate.norm_reference is not None:
            self.norm_reference = aggregate.norm_reference
        if merge is not None:
            mean_delta = merge(mean_delta)
        self.params, self.state = apply_update(self.optimizer, self.params, mean_delta, self.state)

    def _secure_mean(self, deltas: Sequence[dict[str, SparseTensor]]) -> Params:
        assert self.secure is not None
        parameters, layout = self.secure
        modulus = np.uint64(parameters.modulus_mask)
        total = np.zeros(parameters.vector_length, np.uint64)
        for delta in deltas:
            vector = layout.flatten({name: tensor.dense() for name, tensor in delta.items()})
            total = (total + quantize(vector, parameters, self.rng)) & modulus
        update_sum = layout.unflatten(dequantize_sum(total, parameters))
        return {name: (value / len(deltas)).astype(np.float32) for name, value in update_sum.items()}


@dataclass(frozen=True)
class Rounds:
    """How the simulated population trains: round count, clients per round, curve cadence."""

    rounds: int = 500
    clients_per_round: int = 100
    evaluate_every: int = 25  # validation metrics every this many rounds (and after the last)
    sampling_seed: int = 0  # clients are sampled uniformly without replacement, anew each round

    def __post_init__(self) -> None:
        for name in ("rounds", "clients_per_round", "evaluate_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class TrainingRun:
    params: Params
    curve: list[dict[str, float]] = field(default_factory=list)  # validation metrics by round
    seconds: float = 0.0  # wall time of the rounds, validation included
    refused: int = 0  # diverged client updates the server left out


def train_federated(
    devices: ClientPool[W_contra],
    server: Server,
    train_users: Sequence[int],
    work: W_contra,
    rounds: Rounds,
    validate: Callable[[Params], dict[str, float]],
) -> TrainingRun:
    """Run the rounds: sample clients, run their tasks, commit; validate every few rounds."""
    rng = np.random.default_rng(rounds.sampling_seed)
    population = np.asarray(train_users)
    per_round = min(rounds.clients_per_round, len(population))
    run = TrainingRun(server.params)
    started = time.perf_counter()
    run.curve.append({"round": 0, **validate(server.params)})
    for r in range(1, rounds.rounds + 1):
        clients = rng.choice(population, size=per_round, replace=False)
        devices.set_global(server.params)
        if server.sums_in_parts and isinstance(devices, SummingPool):
            partials, refused = devices.map_summed(work, clients.tolist(), server.shapes)
            run.refused += server.commit_partials(partials, refused)
        else:
            run.refused += server.commit(devices.map(work, clients.tolist()))
        if r % rounds.evaluate_every == 0 or r == rounds.rounds:
            run.curve.append({"round": r, **validate(server.params)})
    run.params = server.params
    run.seconds = time.perf_counter() - started
    return run


# ---- client work of each method -----------------------------------------------------------


def fedrecon_task(
    model: TFLiteModel,
    params: Params,
    support: TaskBatches,
    query: TaskBatches,
    config: TaskConfig,
    per_item: frozenset[str],
) -> Report:
    """FedRecon's client task (Algorithm 1): the device's own step (`fedrecon_step`: fresh locals
    fitted on support, globals trained on query, clipped under DP) on batches packed once."""
    step = fedrecon_step(model, support, query, config)
    if isinstance(step, Halt):
        return None
    return sparse_delta(step.trained.update, shapes(params), per_item), float(query.num_examples)


def fedrecon_work(clients: ByUser[SupportQuery], config: TaskConfig, per_item: frozenset[str]) -> ClientWork:
    """FedRecon on users whose batches were packed once."""

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        client = clients[user]
        return fedrecon_task(model, params, client.support, client.query, config, per_item)

    return work


def recon_eval_work(clients: ByUser[SupportQuery], config: TaskConfig) -> EvaluationWork:
    """ReconEval: reconstruct on support, measure on query."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        client = clients[user]
        return recon_eval_step(model, client.support, client.query, config)

    return work


def fedavg_work(examples: Sequence[TaskBatches], config: TaskConfig, per_item: frozenset[str]) -> ClientWork:
    """FedAvg with the user parameters global too: every client starts from the shared user
    vector, trains it jointly with the item parameters on all its examples, and reports both."""
    # The shared user vector trains at the globals' rate, without L2, and the report is unclipped.
    joint = replace(config, local_learning_rate=config.update_learning_rate, l2_local=0.0, clip_norm=None)

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        batches = examples[user]
        names = [s.name for s in model.manifest.local_params]
        model.set_local({k: params[k] for k in names})
        update = train_globals(model, batches, joint)
        if isinstance(update, Halt):
            return None
        delta = sparse_delta(update.update, shapes(params), per_item)
        trained = model.get_local()
        for k in names:
            delta[k] = whole(trained[k] - params[k])
        return delta, float(batches.num_examples)

    return work


def shared_locals_eval_work(clients: Sequence[SupportQuery]) -> EvaluationWork:
    """FedAvg's evaluation: the shared user vector, no reconstruction, measured on query."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        model.set_local({s.name: params[s.name] for s in model.manifest.local_params})
        return model.evaluate(clients[user].query)

    return work


class PrivateLocals:
    """Stateful private parameters (FURL; a centralized model's user embeddings): each user's own
    locals, kept across rounds; a user not seen yet has fresh (zero) ones."""

    def __init__(self, manifest: Manifest) -> None:
        self._fresh = {s.name: np.zeros(s.shape, np.float32) for s in manifest.local_params}
        self._by_user: dict[int, Params] = {}

    def get(self, user: int) -> Params:
        return self._by_user.get(user, self._fresh)

    def put(self, user: int, params: Params) -> None:
        self._by_user[user] = params

    def snapshot(self) -> dict[int, Params]:
        # `put` replaces a user's arrays and never writes into them, so a shallow copy is a snapshot.
        return dict(self._by_user)

    def restore(self, snapshot: dict[int, Params]) -> None:
        self._by_user = dict(snapshot)


def furl_work(
    users: ByUser[TimeSplit], locals_: PrivateLocals, config: TaskConfig, per_item: frozenset[str]
) -> ClientWork:
    """FURL (a population with `local_state: keep`): the device's own locals, trained jointly with
    the globals at `local_learning_rate` (the device's `train_globals`) and kept across rounds."""

    def work(model: TFLiteModel, params: Params, user: int) -> Report:
        batches = users[user].train
        model.set_local(locals_.get(user))
        trained = train_globals(model, batches, config)
        if isinstance(trained, Halt):
            return None
        locals_.put(user, model.get_local())
        return sparse_delta(trained.update, shapes(params), per_item), float(batches.num_examples)

    return work


def private_locals_eval_work(users: ByUser[TimeSplit], locals_: PrivateLocals, part: str) -> EvaluationWork:
    """Seen users' StandardEval: their kept locals, measured on their `part` ("validation" or "test")."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        model.set_local(locals_.get(user))
        batches: TaskBatches = getattr(users[user], part)
        return model.evaluate(batches)

    return work


def seen_recon_eval_work(users: Sequence[TimeSplit], config: TaskConfig, part: str) -> EvaluationWork:
    """FedRecon on a seen user: reconstruct on its training examples, measure on its `part`."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        batches: TaskBatches = getattr(users[user], part)
        return recon_eval_step(model, users[user].train, batches, config)

    return work


def initial_locals_eval_work(clients: Sequence[SupportQuery]) -> EvaluationWork:
    """A stateful model on a user who never trained: the model's initial locals, measured on query."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        model.reset_local()
        return model.evaluate(clients[user].query)

    return work


def shapes(params: Params) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in params.items()}
