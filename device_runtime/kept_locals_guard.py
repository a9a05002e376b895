"""What one training task may do to a device's kept local parameters, decided by the device.

A server chooses a stateful task's learning rates, steps and globals within wide ranges
(`TASK_CONFIG_MAXIMA`), and the device trains its kept locals with them. One task with the
largest local learning rate and three steps pushes a user vector of norm 1 to 3e9, finite, and
every later honest task starts from there: the device's own serving is ruined, and a server
could do it to one device on purpose. So the device, never the server, bounds each task:

- non-finite locals are refused;
- the task's change is scaled down (its direction kept) to at most `max_relative_change` times the
  kept locals' norm, or `min_change` when they are smaller (fresh locals are zeros);
- the result is scaled down to an absolute norm of `max_norm`;
- and the last good copy (the locals the task started from) stays when the task's own validation
  examples, a small split it did not train on, say the new ones are worse by more than
  `tolerance` (relative loss).

The validation is measured with the task's globals, which the server chose: against globals
crafted to make bad locals look good the bounds, not the validation, are what hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from contracts.params import Params
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel


@dataclass(frozen=True)
class KeptLocalsBounds:
    """The device's bounds on one task's kept locals (the app's; no task config changes them).

    - `max_relative_change`, `min_change`: a task's change is scaled down to at most the first
      times the kept norm, or the second when that is larger.
    - `max_norm`: the kept locals' norm is scaled down to this.
    - `validation_fraction`: the share of a task's training examples held back to validate its
      new locals (none below `min_validation_examples`).
    - `tolerance`: how much higher (relative) the new locals' validation loss may be than the last
      good copy's before the device keeps the last good copy.
    """

    max_relative_change: float = 1.0
    min_change: float = 1.0
    max_norm: float = 100.0
    validation_fraction: float = 0.1
    min_validation_examples: int = 10  # training examples below which a task validates nothing
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be a finite number > 0, got {value}"
            for name, value in (
                ("max_relative_change", self.max_relative_change),
                ("min_change", self.min_change),
                ("max_norm", self.max_norm),
            )
            if not (math.isfinite(value) and value > 0)
        ]
        if not 0 <= self.validation_fraction < 1:
            problems.append(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.min_validation_examples < 2:
            problems.append(
                f"min_validation_examples must be >= 2 (one to train on, one to validate), "
                f"got {self.min_validation_examples}"
            )
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            problems.append(f"tolerance must be a finite number >= 0, got {self.tolerance}")
        if problems:
            raise ValueError("invalid kept-locals bounds: " + "; ".join(problems))

    def validation_count(self, training_examples: int) -> int:
        """How many of a task's training examples it holds back to validate its new locals."""
        if not self.validation_fraction or training_examples < self.min_validation_examples:
            return 0
        return max(1, round(training_examples * self.validation_fraction))


def params_norm(params: Params) -> float:
    """L2 norm of every tensor together (float64 sums)."""
    return math.sqrt(sum(float(np.vdot(v, v)) for v in (np.asarray(t, np.float64) for t in params.values())))


@dataclass(frozen=True)
class Bounded:
    params: Params | None  # None: refused (non-finite)
    note: str  # what the bounds did ("" when nothing)
    change_norm: float  # of the task's change before the bounds


def bound_change(kept: Params, trained: Params, bounds: KeptLocalsBounds) -> Bounded:
    """`trained` with its change from `kept` and its norm within `bounds`, and what was done."""
    change = {k: np.asarray(trained[k], np.float64) - np.asarray(v, np.float64) for k, v in kept.items()}
    change_norm = params_norm(change)
    if not math.isfinite(change_norm):
        return Bounded(None, "refused: the task's local parameters are not finite", change_norm)
    notes = []
    kept_norm = params_norm(kept)
    allowed = max(bounds.max_relative_change * kept_norm, bounds.min_change)
    if change_norm > allowed:
        scale = allowed / change_norm
        change = {k: v * scale for k, v in change.items()}
        notes.append(f"the task's change of norm {change_norm:.3g} scaled to {allowed:.3g}")
    result = {k: np.asarray(v, np.float64) + change[k] for k, v in kept.items()}
    norm = params_norm(result)
    if norm > bounds.max_norm:
        result = {k: v * (bounds.max_norm / norm) for k, v in result.items()}
        notes.append(f"the local parameters' norm {norm:.3g} scaled to the cap {bounds.max_norm:.3g}")
    params = {k: v.astype(np.asarray(kept[k]).dtype) for k, v in result.items()}
    return Bounded(params, "; ".join(notes), change_norm)


def worse(new_loss: float, last_good_loss: float, bounds: KeptLocalsBounds) -> bool:
    """Whether validation says the new locals are worse than the last good copy beyond tolerance."""
    if not math.isfinite(new_loss):
        return True
    return new_loss > last_good_loss + bounds.tolerance * abs(last_good_loss)


@dataclass(frozen=True)
class Verdict:
    params: Params  # the locals to keep: the bounded new ones, or the last good copy
    note: str  # what the device did and why ("" when the new ones were kept as trained)


def _loss(model: TFLiteModel, params: Params, batches: TaskBatches) -> float:
    model.set_local(params)
    return model.evaluate(batches).metrics()["loss"]


def guard(
    model: TFLiteModel, last_good: Params, trained: Params, validation: TaskBatches, bounds: KeptLocalsBounds
) -> Verdict:
    """What a task keeps of its `trained` locals, measured on `validation` (no examples: the bounds
    only) with the globals installed in `model`; leaves other locals in the interpreter."""
    bounded = bound_change(last_good, trained, bounds)
    if bounded.params is None:
        return Verdict(last_good, f"kept the last good local parameters: {bounded.note}")
    if validation.num_examples:
        new, old = _loss(model, bounded.params, validation), _loss(model, last_good, validation)
        if worse(new, old, bounds):
            return Verdict(
                last_good,
                f"kept the last good local parameters: on {validation.num_examples} validation examples "
                f"the new ones' loss is {new:.4g}, the last good ones' {old:.4g}"
                + (f" ({bounded.note})" if bounded.note else ""),
            )
    return Verdict(bounded.params, f"bounded: {bounded.note}" if bounded.note else "")
