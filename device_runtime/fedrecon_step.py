"""One FedRecon client step, the same maths for the device, the fleet and the fast simulation.

Algorithm 1 of Federated Reconstruction on batches already packed: fresh locals fitted on the
support set with the globals frozen, then the globals trained on the query set (the locals
frozen at `local_learning_rate` 0). A diverged update is refused; under DP-FedAvg the whole
delta is clipped. FURL's task trains its kept locals with the globals in the same update
(`train_globals` alone). The model holds the round's globals when a step starts: the device
installs them per task, the simulation once per thread and round.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from contracts.params import Params
from contracts.task_config import TaskConfig
from model_runtime.support_query import num_steps, reconstruct_locals
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import EvaluationSums, RowUpdate, SparseGradient, TFLiteModel, Update


class Halt(enum.StrEnum):
    """Why a step returned no update (the value says it to the server)."""

    DIVERGED = "the update diverged (non-finite delta); learning rate too high?"
    INTERRUPTED = "conditions changed before the update"


@dataclass(frozen=True)
class TrainedGlobals:
    """The globals' update: the change of the task's rows (clipped under DP-FedAvg)."""

    update: RowUpdate
    within_clip: bool | None  # whether the delta was already within the clip norm; None: no clip

    def clip_metrics(self, config: TaskConfig) -> dict[str, float]:
        """Adaptive clipping (Andrew et al. 2021) needs the count of unclipped devices; the server
        adds noise to the round's sum of it before using it. Only when asked: it is a bit about the
        update."""
        if self.within_clip is None or not config.report_within_clip:
            return {}
        return {"dp_within_clip": float(self.within_clip)}


@dataclass(frozen=True)
class FedReconStep:
    trained: TrainedGlobals
    reconstruction_loss: float | None  # None: a model without locals reconstructs nothing
    before: EvaluationSums | None  # the measured batches' sums before the update, when asked


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


def train_globals(
    model: TFLiteModel,
    batches: TaskBatches,
    config: TaskConfig,
    central_gradient: SparseGradient | None = None,
    weight: float = 0.0,
) -> TrainedGlobals | Halt:
    """The task's update of the globals on `batches` (and of the locals at `local_learning_rate`),
    refused if it diverged, clipped to `clip_norm` if there is one. Gradient transfer: every step
    adds `weight` times `central_gradient` to the globals' gradient."""
    steps = num_steps(batches.num_batches, config.update_max_epochs, config.update_max_steps)
    update = model.update_rows(
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
        return Halt.DIVERGED
    if config.clip_norm is None:
        return TrainedGlobals(update, None)
    delta, within = clip_delta(update.delta, config.clip_norm)
    return TrainedGlobals(replace(update, delta=delta), within)


def fedrecon_step(
    model: TFLiteModel,
    support: TaskBatches,
    query: TaskBatches,
    config: TaskConfig,
    *,
    measured: TaskBatches | None = None,
    central_gradient: SparseGradient | None = None,
    weight: float = 0.0,
    should_continue: Callable[[], bool] = lambda: True,
) -> FedReconStep | Halt:
    """Reconstruct the locals on `support`, then train the globals on `query` (`train_globals`).
    `measured`: batches evaluated between the two (the device reports its query's loss before the
    update); `should_continue` is asked there too, before the update starts."""
    reconstruction_loss = reconstruct_locals(model, support, config)
    before = None if measured is None else model.evaluate(measured)
    if not should_continue():
        return Halt.INTERRUPTED
    trained = train_globals(model, query, config, central_gradient, weight)
    if isinstance(trained, Halt):
        return trained
    return FedReconStep(trained, reconstruction_loss, before)


def recon_eval_step(
    model: TFLiteModel, support: TaskBatches, query: TaskBatches, config: TaskConfig
) -> EvaluationSums:
    """ReconEval: fresh locals reconstructed on `support`, the model measured on `query`."""
    reconstruct_locals(model, support, config)
    return model.evaluate(query)
