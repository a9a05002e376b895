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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from device_runtime.example_store import ExampleStore, Selection
from device_runtime.model import DeviceModel, EvaluationSums, RowUpdate, Update
from device_runtime.task_batches import Examples, TaskBatches, split_batches
from model_export.manifest import Manifest
from model_export.params import Params, ParamsError


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    INSUFFICIENT_DATA = "insufficient_data"
    INTERRUPTED = "interrupted"
    ERROR = "error"


class SplitPolicy(enum.StrEnum):
    ALTERNATE = "alternate"  # even batches support, odd batches query (the paper's default)
    REUSE = "reuse"  # every example in both support and query


@dataclass(frozen=True)
class TaskConfig:
    """What the server asks a device to do; defaults follow the FedRecon MovieLens protocol."""

    split: SplitPolicy = SplitPolicy.ALTERNATE
    reuse_below: int = 0  # fewer examples than this: reuse all for support and query (deployment lesson)
    min_examples: int = 1
    max_examples: int = 300
    shuffle_seed: int | None = 42  # None keeps the store's order (newest first)
    reconstruction_learning_rate: float = 0.1
    reconstruction_max_epochs: int = 5
    reconstruction_max_steps: int = 50
    update_learning_rate: float = 0.5
    update_max_epochs: int = 1
    update_max_steps: int = 50
    l2_global: float = 0.0
    l2_local: float = 0.0
    negatives_per_positive: int = 4  # implicit feedback: sampled non-shared items per share
    clip_norm: float | None = None  # DP-FedAvg: the whole delta is clipped to this L2 norm before reporting
    # Adaptive clipping: also report whether the delta was within clip_norm (metric dp_within_clip).
    # Only when asked: it is one bit about the update that the server would otherwise not see.
    report_within_clip: bool = False

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "SplitPolicy" or (value is None and f.type.endswith("| None")):
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    problems.append(f"{f.name} must be true or false, got {value!r}")
                continue
            kinds = (int,) if f.type.startswith("int") else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                problems.append(f"{f.name} must be {f.type.split(' ')[0]}, got {value!r}")
            elif not math.isfinite(value) or value < 0:
                problems.append(f"{f.name} must be finite and >= 0, got {value}")
        if self.clip_norm == 0:
            problems.append(f"clip_norm must be > 0 (or null for no clipping), got {self.clip_norm}")
        if self.min_examples < 1:
            problems.append(f"min_examples must be >= 1, got {self.min_examples}")
        if self.max_examples < self.min_examples:
            problems.append(
                f"max_examples ({self.max_examples}) must be >= min_examples ({self.min_examples})"
            )
        if problems:
            raise ValueError("invalid task config: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["split"] = self.split.value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TaskConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown task config fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(data)
        if "split" in values:
            values["split"] = SplitPolicy(values["split"])
        return cls(**values)

    @classmethod
    def from_manifest(cls, manifest: Manifest, **overrides: Any) -> TaskConfig:
        """Defaults recorded at export, then `overrides`."""
        known = {f.name for f in fields(cls)}
        defaults = {k: v for k, v in manifest.training_defaults.items() if k in known}
        return cls.from_json({**defaults, **overrides})


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


def select_examples(store: ExampleStore, manifest: Manifest, config: TaskConfig) -> tuple[Examples, int]:
    """The task's examples (newest `max_examples`, optionally shuffled); drops unknown items.

    Items outside the model's catalog (e.g. expressions newer than the model) are left out
    and counted, rather than failing the task.
    """
    examples = store.examples(Selection(limit=config.max_examples))
    known = (examples.item_ids >= 0) & (examples.item_ids < manifest.num_items)
    outside = int(len(examples) - known.sum())
    examples = examples[known]
    if config.shuffle_seed is not None:
        examples = shuffled(examples, config.shuffle_seed)
    return examples, outside


def shuffled(examples: Examples, seed: int) -> Examples:
    """The examples in an order fixed by `seed` (the protocol's per-user shuffle)."""
    return examples[np.random.default_rng(seed).permutation(len(examples))]


def add_negatives(
    examples: Examples, num_items: int, per_positive: int, rng: np.random.Generator
) -> Examples:
    """Implicit feedback: each share gets `per_positive` items the user never shared, label 0."""
    positives = np.unique(examples.item_ids[examples.labels > 0])
    count = len(positives) * per_positive
    candidates = np.setdiff1d(np.arange(num_items), positives, assume_unique=True)
    if count == 0 or candidates.size == 0:
        return examples
    negatives = rng.choice(candidates, size=min(count, candidates.size), replace=False)
    mixed = Examples.concat(
        [examples, Examples(negatives.astype(np.int64), np.zeros(len(negatives), np.float32))]
    )
    return mixed[rng.permutation(len(mixed))]


def split_support_query(
    examples: Examples, manifest: Manifest, config: TaskConfig
) -> tuple[list[Examples], list[Examples]]:
    batches = split_batches(examples, manifest.batch_size)
    if config.split is SplitPolicy.REUSE or len(examples) < config.reuse_below or len(batches) < 2:
        # Too few to split: reuse everything for both sets, as the keyboard deployment did.
        return batches[: manifest.max_batches], batches[: manifest.max_batches]
    return batches[0::2][: manifest.max_batches], batches[1::2][: manifest.max_batches]


def prepare(store: ExampleStore, manifest: Manifest, config: TaskConfig, seed: int) -> SupportQuery:
    examples, outside = select_examples(store, manifest, config)
    num_examples = len(examples)
    if manifest.feedback == "implicit" and config.negatives_per_positive:
        examples = add_negatives(
            examples, manifest.num_items, config.negatives_per_positive, np.random.default_rng(seed)
        )
    support, query = split_support_query(examples, manifest, config)
    return SupportQuery(support, query, num_examples, outside)


def num_steps(num_batches: int, max_epochs: int, max_steps: int) -> int:
    return min(max_steps, max_epochs * num_batches)


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


def reconstruct_locals(model: DeviceModel, support: TaskBatches, config: TaskConfig) -> float:
    """Fresh local parameters fitted on the support batches, globals frozen; the mean batch loss."""
    model.reset_local()
    steps = num_steps(support.num_batches, config.reconstruction_max_epochs, config.reconstruction_max_steps)
    return model.reconstruct(support, steps, config.reconstruction_learning_rate, config.l2_local)


def _start(
    model: DeviceModel, store: ExampleStore, global_params: Params, config: TaskConfig, seed: int
) -> tuple[SupportQuery, TaskBatches, TaskBatches] | TaskResult:
    """What every task does first: select and split the examples, pack them, install the globals;
    or the INSUFFICIENT_DATA result when the device has too few."""
    data = prepare(store, model.manifest, config, seed)
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


def run_training_task(
    model: DeviceModel,
    store: ExampleStore,
    global_params: Params,
    config: TaskConfig,
    *,
    should_continue: Callable[[], bool] = lambda: True,
    seed: int = 0,
) -> TaskResult:
    """Reconstruct on support, update on query, and return the delta; locals are discarded."""
    try:
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
        steps = num_steps(query.num_batches, config.update_max_epochs, config.update_max_steps)
        update = model.update(
            query, steps, config.update_learning_rate, l2_global=config.l2_global, l2_local=config.l2_local
        )
        if diverged(update):
            return TaskResult(
                Outcome.ERROR, message="the update diverged (non-finite delta); learning rate too high?"
            )
        if not should_continue():
            return TaskResult(Outcome.INTERRUPTED, message="conditions changed before reporting")
        delta, clip_metrics = update.delta, {}
        if config.clip_norm is not None:
            delta, within = clip_delta(update.delta, config.clip_norm)
            if config.report_within_clip:
                # Adaptive clipping (Andrew et al. 2021) needs the count of unclipped devices; the
                # server adds noise to the round's sum of it before using it.
                clip_metrics = {"dp_within_clip": float(within)}
        metrics = {
            "num_examples": float(data.num_examples),
            "num_support": float(support.num_examples),
            "num_query": float(query.num_examples),
            "outside_catalog": float(data.outside_catalog),
            "reconstruction_loss": reconstruction_loss,
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


def run_evaluation_task(
    model: DeviceModel,
    store: ExampleStore,
    global_params: Params,
    config: TaskConfig,
    *,
    seed: int = 0,
) -> TaskResult:
    """ReconEval: reconstruct on the support set, measure on the query set; metrics only."""
    try:
        started = _start(model, store, global_params, config, seed)
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
