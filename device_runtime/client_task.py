"""A device's part of a FedRecon round: split, reconstruct, update, return the delta.

Mirrors Algorithm 1 of Federated Reconstruction: local parameters start fresh, are fitted
on the support set with the globals frozen, then the globals are trained on the query set
with the locals frozen. The delta and `|query|` go back to the server; the local
parameters are discarded. Every run returns a `TaskResult` with an explicit `Outcome`
(as the federated compute client's plan outcomes do) instead of raising through the caller.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from contracts.features import Examples, per_example
from contracts.manifest import Manifest
from contracts.params import Params, ParamsError
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.example_store import ExampleStore, Selection
from device_runtime.kept_locals_guard import guard
from device_runtime.local_state import LocalStateStore
from model_runtime.support_query import (
    add_negatives,
    negative_weights,
    not_negatives,
    num_steps,
    reconstruct_locals,
    shares,
    split_support_query,
    with_support_negatives,
)
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import EvaluationSums, RowUpdate, SparseGradient, TFLiteModel, Update


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
class SupportQuery:
    support: list[Examples]
    query: list[Examples]
    num_examples: int
    outside_catalog: int


def within_model(examples: Examples, manifest: Manifest) -> np.ndarray:
    """Which examples the model can take: every indexing feature within its tables' rows.

    A store may hold values the model does not know yet (e.g. expressions newer than the model).
    """
    keep = np.ones(examples.num_examples, bool)
    for feature in manifest.features:
        if feature.tables and feature.value_range is not None:
            values = per_example(examples[feature.name])
            low, high = feature.value_range
            keep &= np.all((values >= low) & (values <= high), axis=1)
    return keep


def incompatible_store(store: ExampleStore, manifest: Manifest) -> TaskResult | None:
    """The result of a task whose store does not fit the model (named, before anything starts)."""
    mismatch = store.mismatch(manifest.features)
    return None if mismatch is None else TaskResult(Outcome.INCOMPATIBLE_STORE, message=mismatch)


def newest_examples(store: ExampleStore, manifest: Manifest, config: TaskConfig) -> tuple[Examples, int]:
    """The newest `max_examples` examples, newest first, without those outside the model's tables
    (left out and counted, rather than failing the task)."""
    examples = store.examples(Selection(limit=config.max_examples))
    known = within_model(examples, manifest)
    return examples.select(known), int(examples.num_examples - known.sum())


def select_examples(store: ExampleStore, manifest: Manifest, config: TaskConfig) -> tuple[Examples, int]:
    """The task's examples (newest `max_examples`, optionally shuffled); drops unknown values."""
    examples, outside = newest_examples(store, manifest, config)
    if config.shuffle_seed is not None:
        examples = shuffled(examples, config.shuffle_seed)
    return examples, outside


# A stateful device's StandardEval examples: the newest tenth of what its task selects.
HOLDOUT_FRACTION = 0.1


def hold_out_newest(newest_first: Examples) -> tuple[Examples, Examples]:
    """(training, held out): the newest `HOLDOUT_FRACTION` held out, at least one example when there
    are two or more, so a stateful device is measured on examples its kept locals never trained on."""
    n = newest_first.num_examples
    held = max(1, round(n * HOLDOUT_FRACTION)) if n >= 2 else 0
    return newest_first.select(slice(held, None)), newest_first.select(slice(None, held))


def shuffled(examples: Examples, seed: int) -> Examples:
    """The examples in an order fixed by `seed` (the protocol's per-user shuffle)."""
    return examples.select(np.random.default_rng(seed).permutation(examples.num_examples))


def with_central(
    query: list[Examples],
    central: Examples,
    manifest: Manifest,
    config: TaskConfig,
    seed: int,
    weights: np.ndarray | None = None,
) -> list[Examples]:
    """Example transfer (Algorithm 3 of Augenstein et al.): the query batches with the centralized
    examples mixed in, shuffled, as many as fit one update call next to the device's own, and at
    least half of the call (the device's own examples beyond the rest sit out this update). Only
    the update sees them: they are not in the store, not in the support set, and not in the
    reported weight. Under FedRecon they train the globals with this
    device's reconstructed locals, as its own examples do. Implicit labels: they get sampled
    negatives as the device's shares do (drawn by `weights`, `negative_weights`), never among the
    device's own shares."""
    own = Examples.concat(query, manifest.features)
    rng = np.random.default_rng(seed + 1)
    negatives = config.negatives_per_positive if manifest.task.negative_sampling else 0
    # The room left by the device's own examples, and at least half of the call: a device whose
    # own examples fill the call (a third of MovieLens' devices) would otherwise mix in none.
    free = max(0, manifest.max_examples - own.num_examples)
    room = max(free, manifest.max_examples // 2) // (1 + negatives)
    taken = central.select(rng.permutation(central.num_examples)[:room])
    if negatives:
        taken = add_negatives(taken, manifest, negatives, rng, shares(own, manifest), weights)
    # The device's own examples (shuffled) beyond what the call takes next to them: dropped, as
    # split_support_query drops those beyond one call.
    own = own.select(slice(None, manifest.max_examples - taken.num_examples))
    mixed = Examples.concat([own, taken.validated(manifest.features)], manifest.features)
    return split_batches(mixed.select(rng.permutation(mixed.num_examples)), manifest.batch_size)


def prepare(
    store: ExampleStore, manifest: Manifest, config: TaskConfig, seed: int, weights: np.ndarray | None = None
) -> SupportQuery:
    """The task's examples split into support and query; implicit labels add sampled negatives,
    drawn by `weights` (`negative_weights`; None: uniformly)."""
    examples, outside = select_examples(store, manifest, config)
    num_examples = examples.num_examples
    rng = np.random.default_rng(seed)
    own = shares(examples, manifest) if manifest.task.negative_sampling else None
    if manifest.task.negative_sampling and config.negatives_per_positive:
        examples = add_negatives(
            examples, manifest, config.negatives_per_positive, rng, not_negatives(config), weights
        )
    support, query = split_support_query(examples, manifest, config)
    support = with_support_negatives(support, manifest, config, rng, not_negatives(config, own), weights)
    return SupportQuery(support, query, num_examples, outside)


# tflite_runtime saturates an overflow at float32's maximum where LiteRT gives inf/NaN;
# anything this large is an overflow either way.
_SATURATED = 1e30


def diverged(update: Update | RowUpdate) -> bool:
    return not (math.isfinite(update.loss) and update.max_abs_change < _SATURATED)


def delta_norm(delta: Params) -> float:
    """L2 norm of a whole delta, every tensor together (float64 sums)."""
    return math.sqrt(sum(float(np.vdot(v, v)) for v in (np.asarray(t, np.float64) for t in delta.values())))


# Clipping aims this much below the bound, so that the float32 result's norm, as the server
# computes it (float64 sums in another order), is within the bound too.
_CLIP_MARGIN = 1 - 2**-20


def clip_delta(delta: Params, clip_norm: float) -> tuple[Params, bool]:
    """The delta scaled so that its whole L2 norm (all tensors together) is <= `clip_norm`,
    and whether it already was (then it is returned unchanged). The direction is kept:
    DP-FedAvg's per-device clipping."""
    norm = delta_norm(delta)
    if norm <= clip_norm * _CLIP_MARGIN:
        return delta, True
    scale = clip_norm * _CLIP_MARGIN / norm
    return {name: (np.asarray(t, np.float64) * scale).astype(np.float32) for name, t in delta.items()}, False


def _start(
    model: TFLiteModel, store: ExampleStore, global_params: Params, config: TaskConfig, seed: int
) -> tuple[SupportQuery, TaskBatches, TaskBatches] | TaskResult:
    """What every task does first: select and split the examples, pack them, install the globals;
    or the INSUFFICIENT_DATA result when the device has too few."""
    data = prepare(
        store, model.manifest, config, seed, negative_weights(model.manifest, config, global_params)
    )
    if data.num_examples < config.min_examples:
        return TaskResult(
            Outcome.INSUFFICIENT_DATA,
            metrics={"num_examples": data.num_examples, "outside_catalog": data.outside_catalog},
            message=f"{data.num_examples} usable examples, the task needs at least {config.min_examples}",
        )
    support = TaskBatches.pack(data.support, model.manifest)
    query = TaskBatches.pack(data.query, model.manifest)
    model.set_global(global_params)
    return data, support, query


def _clipped(delta: Params, config: TaskConfig) -> tuple[Params, dict[str, float]]:
    """DP-FedAvg: the whole delta clipped to the task's clip norm (unchanged without one), and the
    metrics the server asked for about it."""
    if config.clip_norm is None:
        return delta, {}
    clipped, within = clip_delta(delta, config.clip_norm)
    # Adaptive clipping (Andrew et al. 2021) needs the count of unclipped devices; the server adds
    # noise to the round's sum of it before using it. Only when asked: it is a bit about the update.
    return clipped, ({"dp_within_clip": float(within)} if config.report_within_clip else {})


def run_training_task(
    model: TFLiteModel,
    store: ExampleStore,
    global_params: Params,
    config: TaskConfig,
    *,
    should_continue: Callable[[], bool] = lambda: True,
    seed: int = 0,
    kept: LocalStateStore | None = None,
    central_gradient: SparseGradient | None = None,
    weight: float = 0.0,
    central: Examples | None = None,
) -> TaskResult:
    """Reconstruct on support, update on query, and return the delta; locals are discarded.

    With `local_state: keep` (FURL) the device's kept locals (`kept`) train jointly with the
    globals instead, and are kept for its next task. Gradient transfer (Augenstein et al.,
    Algorithm 4): every update step adds `weight` times the server's `central_gradient` (rows of
    the globals, public data's gradient) to the gradient of the globals; the delta then covers
    the central gradient's rows too. The reported weight stays |query|. `central`: example transfer's
    centralized examples, mixed into the update steps only (`with_central`)."""
    try:
        mismatch = incompatible_store(store, model.manifest)
        if mismatch is not None:
            return mismatch
        if central is not None and central.num_examples and config.local_state is LocalState.KEEP:
            return TaskResult(
                Outcome.ERROR, message="example transfer mixes into FedRecon's update; local_state is 'keep'"
            )
        if config.local_state is LocalState.KEEP:
            return _stateful_training(
                model, store, global_params, config, kept, should_continue, seed, central_gradient, weight
            )
        started = _start(model, store, global_params, config, seed)
        if isinstance(started, TaskResult):
            return started
        data, support, query = started
        if not should_continue():
            return TaskResult(Outcome.INTERRUPTED, message="conditions changed before reconstruction")
        reconstruction_loss = reconstruct_locals(model, support, config)
        before = model.evaluate(query)
        if not should_continue():
            return TaskResult(Outcome.INTERRUPTED, message="conditions changed before the update")
        trained = query
        if central is not None and central.num_examples:
            trained = TaskBatches.pack(
                with_central(
                    data.query,
                    central,
                    model.manifest,
                    config,
                    seed,
                    negative_weights(model.manifest, config, global_params),
                ),
                model.manifest,
            )
        steps = num_steps(trained.num_batches, config.update_max_epochs, config.update_max_steps)
        update = model.update(
            trained,
            steps,
            config.update_learning_rate,
            local_learning_rate=config.local_learning_rate,  # 0: the locals stay frozen (Algorithm 1)
            l2_global=config.l2_global,
            l2_local=config.l2_local,
            central_gradient=central_gradient,
            central_gradient_weight=weight,
        )
        if diverged(update):
            return TaskResult(
                Outcome.ERROR, message="the update diverged (non-finite delta); learning rate too high?"
            )
        if not should_continue():
            return TaskResult(Outcome.INTERRUPTED, message="conditions changed before reporting")
        delta, clip_metrics = _clipped(update.delta, config)
        metrics = {
            "num_examples": float(data.num_examples),
            "num_support": float(support.num_examples),
            "num_query": float(query.num_examples),
            "outside_catalog": float(data.outside_catalog),
            **({} if reconstruction_loss is None else {"reconstruction_loss": reconstruction_loss}),
            "update_loss": update.loss,
            **{f"query_{k}": v for k, v in before.as_dict().items()},
            **clip_metrics,
        }
        return TaskResult(Outcome.COMPLETED, num_examples=query.num_examples, delta=delta, metrics=metrics)
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
    model: TFLiteModel,
    store: ExampleStore,
    global_params: Params,
    config: TaskConfig,
    *,
    seed: int = 0,
    kept: LocalStateStore | None = None,
) -> TaskResult:
    """ReconEval: reconstruct on the support set, measure on the query set; metrics only.

    With `local_state: keep`, StandardEval instead: the kept locals, measured on the held-out
    newest examples."""
    try:
        mismatch = incompatible_store(store, model.manifest)
        if mismatch is not None:
            return mismatch
        if config.local_state is LocalState.KEEP:
            return _stateful_evaluation(model, store, global_params, config, kept, seed)
        started = _start(model, store, global_params, evaluation_split(config), seed)
        if isinstance(started, TaskResult):
            return started
        _, support, query = started
        reconstruct_locals(model, support, config)
        sums: EvaluationSums = model.evaluate(query)
        return TaskResult(Outcome.COMPLETED, num_examples=query.num_examples, metrics=sums.as_dict())
    except (ParamsError, ValueError, RuntimeError) as e:
        return TaskResult(Outcome.ERROR, message=str(e))
    finally:
        model.reset_local()


# ---- stateful private parameters (FURL) --------------------------------------------------


def _stateful_start(
    model: TFLiteModel, store: ExampleStore, config: TaskConfig, kept: LocalStateStore | None
) -> tuple[Examples, Examples, int, LocalStateStore] | TaskResult:
    """A stateful task's examples (training, held out, outside the catalog) or why it cannot run."""
    if kept is None:
        return TaskResult(Outcome.ERROR, message="local_state 'keep' needs the device's local state storage")
    newest_first, outside = newest_examples(store, model.manifest, config)
    if newest_first.num_examples < config.min_examples:
        return TaskResult(
            Outcome.INSUFFICIENT_DATA,
            metrics={"num_examples": newest_first.num_examples, "outside_catalog": outside},
            message=(
                f"{newest_first.num_examples} usable examples, the task needs at least {config.min_examples}"
            ),
        )
    train, held_out = hold_out_newest(newest_first)
    return train, held_out, outside, kept


def _pack(
    examples: Examples,
    model: TFLiteModel,
    config: TaskConfig,
    seed: int,
    global_params: Params,
    shared: np.ndarray | None = None,
) -> TaskBatches:
    """One call's batches; implicit labels add sampled negatives (drawn as `negative_weights`
    says for these globals), never among `shared`."""
    manifest = model.manifest
    if manifest.task.negative_sampling and config.negatives_per_positive:
        examples = add_negatives(
            examples,
            manifest,
            config.negatives_per_positive,
            np.random.default_rng(seed),
            not_negatives(config, shared),
            negative_weights(manifest, config, global_params),
        )
    return TaskBatches.pack(split_batches(examples, manifest.batch_size)[: manifest.max_batches], manifest)


def _stateful_training(
    model: TFLiteModel,
    store: ExampleStore,
    global_params: Params,
    config: TaskConfig,
    kept: LocalStateStore | None,
    should_continue: Callable[[], bool],
    seed: int,
    central_gradient: SparseGradient | None = None,
    weight: float = 0.0,
) -> TaskResult:
    """FURL's client task: the kept locals and the globals train jointly on the training examples
    (all but the held-out newest and a validation split); the delta of the globals goes back, the
    locals stay here, within the device's bounds (`kept_locals_guard`)."""
    started = _stateful_start(model, store, config, kept)
    if isinstance(started, TaskResult):
        return started
    train, held_out, outside, storage = started
    # The validation split, another each task (by its seed), judges the new locals; the task does
    # not train on it.
    validating = np.zeros(train.num_examples, bool)
    validating[
        np.random.default_rng(seed).permutation(train.num_examples)[
            : storage.bounds.validation_count(train.num_examples)
        ]
    ] = True
    validation, train = train.select(validating), train.select(~validating)
    if config.shuffle_seed is not None:
        train = shuffled(train, config.shuffle_seed)
    # The held-out shares stand for the future: training does not know them, not even to avoid
    # sampling them as negatives.
    batches = _pack(train, model, config, seed, global_params)
    model.set_global(global_params)
    if not should_continue():
        return TaskResult(Outcome.INTERRUPTED, message="conditions changed before the update")
    locals_ = storage.load(model)
    model.set_local(locals_.params)
    before = model.evaluate(batches)
    steps = num_steps(batches.num_batches, config.update_max_epochs, config.update_max_steps)
    update = model.update(
        batches,
        steps,
        config.update_learning_rate,
        local_learning_rate=config.local_learning_rate,
        l2_global=config.l2_global,
        l2_local=config.l2_local,
        central_gradient=central_gradient,
        central_gradient_weight=weight,
    )
    if diverged(update):
        return TaskResult(
            Outcome.ERROR, message="the update diverged (non-finite delta); learning rate too high?"
        )
    if not should_continue():
        return TaskResult(Outcome.INTERRUPTED, message="conditions changed before reporting")
    # Kept only once the task finished: an interrupted task leaves the previous locals.
    trained = model.get_local()
    model.set_global(global_params)
    shared = shares(train, model.manifest) if model.manifest.task.negative_sampling else None
    checked = guard(
        model,
        locals_.params,
        trained,
        _pack(validation, model, config, seed, global_params, shared),
        storage.bounds,
    )
    storage.save(model, checked.params, locals_.tasks + 1)
    delta, clip_metrics = _clipped(update.delta, config)
    metrics = {
        "num_examples": float(train.num_examples + validation.num_examples + held_out.num_examples),
        "num_query": float(batches.num_examples),
        "num_held_out": float(held_out.num_examples),
        "outside_catalog": float(outside),
        "update_loss": update.loss,
        **{f"query_{k}": v for k, v in before.as_dict().items()},
        **clip_metrics,
    }
    return TaskResult(
        Outcome.COMPLETED,
        num_examples=batches.num_examples,
        delta=delta,
        metrics=metrics,
        message="; ".join(m for m in (locals_.note, checked.note) if m),
    )


def _stateful_evaluation(
    model: TFLiteModel,
    store: ExampleStore,
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
    batches = _pack(held_out, model, config, seed, global_params, shared)
    model.set_global(global_params)
    model.set_local(locals_.params)
    sums = model.evaluate(batches)
    return TaskResult(Outcome.COMPLETED, num_examples=batches.num_examples, metrics=sums.as_dict())
