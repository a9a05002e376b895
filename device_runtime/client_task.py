"""A device's part of a FedRecon round: split, reconstruct, update, return the delta.

Mirrors Algorithm 1 of Federated Reconstruction: local parameters start fresh, are fitted
on the support set with the globals frozen, then the globals are trained on the query set
with the locals frozen (`fedrecon_step`, the maths the simulation runs too). The delta and
`|query|` go back to the server; the local parameters are discarded. Every run returns a
`TaskResult` with an explicit `Outcome` (as the federated compute client's plan outcomes do)
instead of raising through the caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

import numpy as np

from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params, ParamsError
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.fedrecon_step import Halt, TrainedGlobals, fedrecon_step, recon_eval_step, train_globals
from device_runtime.kept_locals_guard import guard
from device_runtime.local_state import LocalStateStore
from device_runtime.task_environment import ExampleSource, TaskEnvironment
from device_runtime.task_examples import (
    SupportQuery,
    hold_out_newest,
    newest_examples,
    one_call,
    prepare,
    shuffled,
    with_central,
)
from model_runtime.support_query import negative_weights, shares
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import EvaluationSums, SparseGradient, TFLiteModel


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    INSUFFICIENT_DATA = "insufficient_data"
    INTERRUPTED = "interrupted"
    # The device's example store holds examples of another layout than the task's model (the
    # device's data is for another model): the assignment is aborted, nothing is read.
    INCOMPATIBLE_STORE = "incompatible_store"
    ERROR = "error"


@dataclass
class TaskResult:
    outcome: Outcome
    num_examples: int = 0  # the aggregation weight: |query|
    delta: Params | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""


@dataclass(frozen=True)
class Task:
    """What the server's assignment says of one task, besides the model and its globals."""

    config: TaskConfig = field(default_factory=TaskConfig)
    population: str = ""  # whose kept locals a `local_state: keep` task trains and keeps
    seed: int = 0  # the task's draws: shuffle, split, sampled negatives
    central: Examples | None = None  # example transfer's centralized examples
    central_gradient: SparseGradient | None = None  # gradient transfer's
    central_gradient_weight: float = 0.0

    def kept(self, environment: TaskEnvironment) -> LocalStateStore | None:
        """This population's kept locals in the environment's state (None without a population)."""
        return LocalStateStore(environment.state, self.population) if self.population else None


def incompatible_store(store: ExampleSource, manifest: Manifest) -> TaskResult | None:
    """The result of a task whose store does not fit the model (named, before anything starts)."""
    mismatch = store.mismatch(manifest.features)
    return None if mismatch is None else TaskResult(Outcome.INCOMPATIBLE_STORE, message=mismatch)


def _too_few(num_examples: int, outside: int, config: TaskConfig) -> TaskResult | None:
    """The INSUFFICIENT_DATA result of a device with fewer usable examples than the task needs."""
    if num_examples >= config.min_examples:
        return None
    return TaskResult(
        Outcome.INSUFFICIENT_DATA,
        metrics={"num_examples": num_examples, "outside_catalog": outside},
        message=f"{num_examples} usable examples, the task needs at least {config.min_examples}",
    )


def _interrupted(before: str) -> TaskResult:
    return TaskResult(Outcome.INTERRUPTED, message=f"conditions changed before {before}")


def _halted(halt: Halt) -> TaskResult:
    return TaskResult(Outcome.INTERRUPTED if halt is Halt.INTERRUPTED else Outcome.ERROR, message=halt.value)


def _start(
    model: TFLiteModel, store: ExampleSource, global_params: Params, config: TaskConfig, seed: int
) -> tuple[SupportQuery, TaskBatches, TaskBatches] | TaskResult:
    """What every FedRecon task does first: select and split the examples, pack them, install the
    globals; or the INSUFFICIENT_DATA result when the device has too few."""
    data = prepare(
        store, model.manifest, config, seed, negative_weights(model.manifest, config, global_params)
    )
    too_few = _too_few(data.num_examples, data.outside_catalog, config)
    if too_few is not None:
        return too_few
    support = TaskBatches.pack(data.support, model.manifest)
    query = TaskBatches.pack(data.query, model.manifest)
    model.set_global(global_params)
    return data, support, query


def _trained_batches(
    model: TFLiteModel,
    data: SupportQuery,
    query: TaskBatches,
    central: Examples | None,
    global_params: Params,
    config: TaskConfig,
    seed: int,
) -> TaskBatches:
    """The batches the update trains on: the query's, with example transfer's centralized examples
    mixed in when the server sent some (`with_central`)."""
    if central is None or not central.num_examples:
        return query
    weights = negative_weights(model.manifest, config, global_params)
    return TaskBatches.pack(
        with_central(data.query, central, model.manifest, config, seed, weights), model.manifest
    )


def _completed(
    model: TFLiteModel,
    trained: TrainedGlobals,
    before: EvaluationSums | None,
    config: TaskConfig,
    weight: int,
    counts: dict[str, float],
    message: str = "",
) -> TaskResult:
    """A finished task's report: the dense delta, `weight` (|query|), and its metrics."""
    metrics = {
        **counts,
        "update_loss": trained.update.loss,
        **({} if before is None else {f"query_{k}": v for k, v in before.as_dict().items()}),
        **trained.clip_metrics(config),
    }
    delta = model.dense_delta(trained.update)
    return TaskResult(Outcome.COMPLETED, num_examples=weight, delta=delta, metrics=metrics, message=message)


def run_training_task(
    model: TFLiteModel, environment: TaskEnvironment, global_params: Params, task: Task
) -> TaskResult:
    """Reconstruct on support, update on query, and return the delta; locals are discarded.

    With `local_state: keep` (FURL) the device's kept locals (the task's population's, in the
    environment's state) train jointly with the globals instead, and are kept for its next task.
    Gradient transfer (Augenstein et al., Algorithm 4): every update step adds
    `central_gradient_weight` times the server's `central_gradient` (rows of the globals, public
    data's gradient) to the gradient of the globals; the delta then covers the central gradient's
    rows too. The reported weight stays |query|. `central`: example transfer's centralized
    examples, mixed into the update steps only (`with_central`)."""
    config, store, should_continue = task.config, environment.examples, environment.should_continue
    try:
        # 1. The device's examples must fit the model.
        mismatch = incompatible_store(store, model.manifest)
        if mismatch is not None:
            return mismatch
        mixes_central = task.central is not None and task.central.num_examples > 0
        if mixes_central and config.local_state is LocalState.KEEP:
            return TaskResult(
                Outcome.ERROR, message="example transfer mixes into FedRecon's update; local_state is 'keep'"
            )
        if config.local_state is LocalState.KEEP:
            return _stateful_training(model, environment, global_params, task)
        # 2. Select and split the examples (support, query), install the globals.
        started = _start(model, store, global_params, config, task.seed)
        if isinstance(started, TaskResult):
            return started
        data, support, query = started
        if not should_continue():
            return _interrupted("reconstruction")
        # 3. Reconstruct the locals on the support set, then train the globals on the query set.
        step = fedrecon_step(
            model,
            support,
            _trained_batches(model, data, query, task.central, global_params, config, task.seed),
            config,
            measured=query,
            central_gradient=task.central_gradient,
            weight=task.central_gradient_weight,
            should_continue=should_continue,
        )
        if isinstance(step, Halt):
            return _halted(step)
        if not should_continue():
            return _interrupted("reporting")
        # 4. The report: the globals' delta, weighted by |query|, and the task's metrics.
        counts = {
            "num_examples": float(data.num_examples),
            "num_support": float(support.num_examples),
            "num_query": float(query.num_examples),
            "outside_catalog": float(data.outside_catalog),
            **({} if step.reconstruction_loss is None else {"reconstruction_loss": step.reconstruction_loss}),
        }
        return _completed(model, step.trained, step.before, config, query.num_examples, counts)
    except (ParamsError, ValueError, RuntimeError) as e:
        return TaskResult(Outcome.ERROR, message=str(e))
    finally:
        # Local parameters never outlive a training task (FedRecon is stateless on the device).
        model.reset_local()


def evaluation_split(config: TaskConfig) -> TaskConfig:
    """ReconEval's split whatever training's is: alternating support and query batches, reused
    only when the device has a single batch. Reconstructing on the query (training's `reuse`)
    would measure on what the locals were just fitted to."""
    return replace(config, split=SplitPolicy.ALTERNATE, reuse_below=0)


def run_evaluation_task(
    model: TFLiteModel, environment: TaskEnvironment, global_params: Params, task: Task
) -> TaskResult:
    """ReconEval: reconstruct on the support set, measure on the query set; metrics only.

    With `local_state: keep`, StandardEval instead: the kept locals, measured on the held-out
    newest examples."""
    config, store = task.config, environment.examples
    try:
        mismatch = incompatible_store(store, model.manifest)
        if mismatch is not None:
            return mismatch
        if config.local_state is LocalState.KEEP:
            return _stateful_evaluation(
                model, store, global_params, config, task.kept(environment), task.seed
            )
        started = _start(model, store, global_params, evaluation_split(config), task.seed)
        if isinstance(started, TaskResult):
            return started
        _, support, query = started
        sums = recon_eval_step(model, support, query, config)
        return TaskResult(Outcome.COMPLETED, num_examples=query.num_examples, metrics=sums.as_dict())
    except (ParamsError, ValueError, RuntimeError) as e:
        return TaskResult(Outcome.ERROR, message=str(e))
    finally:
        model.reset_local()


# ---- stateful private parameters (FURL) --------------------------------------------------


def _stateful_start(
    model: TFLiteModel, store: ExampleSource, config: TaskConfig, kept: LocalStateStore | None
) -> tuple[Examples, Examples, int, LocalStateStore] | TaskResult:
    """A stateful task's examples (training, held out, outside the catalog) or why it cannot run."""
    if kept is None:
        return TaskResult(
            Outcome.ERROR,
            message="local_state 'keep' needs the device's local state storage for a population",
        )
    newest_first, outside = newest_examples(store, model.manifest, config)
    too_few = _too_few(newest_first.num_examples, outside, config)
    if too_few is not None:
        return too_few
    train, held_out = hold_out_newest(newest_first)
    return train, held_out, outside, kept


def _validation_split(train: Examples, storage: LocalStateStore, seed: int) -> tuple[Examples, Examples]:
    """(validation, training): the validation split, another each task (by its seed), judges the
    new locals; the task does not train on it."""
    validating = np.zeros(train.num_examples, bool)
    count = storage.bounds.validation_count(train.num_examples)
    validating[np.random.default_rng(seed).permutation(train.num_examples)[:count]] = True
    return train.select(validating), train.select(~validating)


def _stateful_training(
    model: TFLiteModel, environment: TaskEnvironment, global_params: Params, task: Task
) -> TaskResult:
    """FURL's client task: the kept locals and the globals train jointly on the training examples
    (all but the held-out newest and a validation split); the delta of the globals goes back, the
    locals stay here, within the device's bounds (`kept_locals_guard`)."""
    config, seed, should_continue = task.config, task.seed, environment.should_continue
    started = _stateful_start(model, environment.examples, config, task.kept(environment))
    if isinstance(started, TaskResult):
        return started
    train, held_out, outside, storage = started
    validation, train = _validation_split(train, storage, seed)
    if config.shuffle_seed is not None:
        train = shuffled(train, config.shuffle_seed)
    # The held-out shares stand for the future: training does not know them, not even to avoid
    # sampling them as negatives.
    batches = one_call(train, model.manifest, config, seed, global_params)
    model.set_global(global_params)
    if not should_continue():
        return _interrupted("the update")
    locals_ = storage.load(model)
    model.set_local(locals_.params)
    before = model.evaluate(batches)
    trained = train_globals(model, batches, config, task.central_gradient, task.central_gradient_weight)
    if isinstance(trained, Halt):
        return _halted(trained)
    if not should_continue():
        return _interrupted("reporting")
    # Kept only once the task finished: an interrupted task leaves the previous locals.
    new_locals = model.get_local()
    model.set_global(global_params)
    shared = shares(train, model.manifest) if model.manifest.task.negative_sampling else None
    validating = one_call(validation, model.manifest, config, seed, global_params, shared)
    checked = guard(model, locals_.params, new_locals, validating, storage.bounds)
    storage.save(model, checked.params, locals_.tasks + 1)
    counts = {
        "num_examples": float(train.num_examples + validation.num_examples + held_out.num_examples),
        "num_query": float(batches.num_examples),
        "num_held_out": float(held_out.num_examples),
        "outside_catalog": float(outside),
    }
    message = "; ".join(m for m in (locals_.note, checked.note) if m)
    return _completed(model, trained, before, config, batches.num_examples, counts, message)


def _stateful_evaluation(
    model: TFLiteModel,
    store: ExampleSource,
    global_params: Params,
    config: TaskConfig,
    kept: LocalStateStore | None,
    seed: int,
) -> TaskResult:
    """StandardEval on a seen device: its kept locals, measured on its held-out newest examples."""
    started = _stateful_start(model, store, config, kept)
    if isinstance(started, TaskResult):
        return started
    train, held_out, _, storage = started
    if not held_out.num_examples:
        return TaskResult(
            Outcome.INSUFFICIENT_DATA, message="no held-out examples: StandardEval needs at least 2 examples"
        )
    locals_ = storage.load(model)
    if not locals_.trained:
        return TaskResult(
            Outcome.INSUFFICIENT_DATA,
            message=f"StandardEval measures kept local parameters and this device has none ({locals_.note})",
        )
    shared = shares(train, model.manifest) if model.manifest.task.negative_sampling else None
    batches = one_call(held_out, model.manifest, config, seed, global_params, shared)
    model.set_global(global_params)
    model.set_local(locals_.params)
    sums = model.evaluate(batches)
    return TaskResult(Outcome.COMPLETED, num_examples=batches.num_examples, metrics=sums.as_dict())
