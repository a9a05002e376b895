"""The next-word benchmark's ceiling: the same network trained centrally on the training roles.

Every training role's windows pooled and shuffled, then plain SGD over them through the exported
model's own `update` signature (so the network, its loss and its maths are the federated rows'):
each call takes `max_batches` batches and steps once through each, the globals and the OOV rows
(shared, as a centralized model has them) trained together. It is scored as the federated rows
are, on the held-out roles' newer half after reconstructing the OOV rows on their older half
(`held_out_work`), each figure with a 95% interval over the held-out roles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from android_sim.intervals import Interval, bootstrap_ratio, resample_rows
from android_sim.shakespeare import NextWordData
from android_sim.simulation.rounds import Devices, EvaluationWork
from contracts.features import Examples
from contracts.params import Params
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import EvaluationSums, TFLiteModel

CENTRAL_EPOCHS = 12  # 6 epochs: 11.4%, 12: 12.9% without OOV at 1,000 words (still rising)
CENTRAL_LEARNING_RATE = 1.0


@dataclass(frozen=True)
class Accuracies:
    """Accuracy without and with OOV targets over held-out roles, each with its interval."""

    without_oov: Interval
    with_oov: Interval
    # Per held-out role, in the roles' order: correct in-vocabulary targets and in-vocabulary
    # targets (what a paired comparison with another row on the same roles resamples).
    correct_in_vocab: tuple[float, ...] = ()
    in_vocab: tuple[float, ...] = ()


def train_centrally(
    model: TFLiteModel,
    data: NextWordData,
    epochs: int = CENTRAL_EPOCHS,
    learning_rate: float = CENTRAL_LEARNING_RATE,
    seed: int = 0,
) -> tuple[Params, float]:
    """The globals after `epochs` passes of SGD over every training role's windows, pooled and
    shuffled each epoch; and the last epoch's mean batch loss. A diverged step is an error."""
    if epochs < 1 or not learning_rate > 0:
        raise ValueError(f"epochs must be >= 1 and learning_rate > 0, got {epochs}, {learning_rate}")
    manifest = model.manifest
    pooled = Examples.concat([Examples(dict(role)) for role in data.train], manifest.features)
    if not pooled.num_examples:
        raise ValueError("no training windows to train on")
    rng = np.random.default_rng(seed)
    params = {k: np.array(v, np.float32, copy=True) for k, v in model.get_global().items()}
    model.reset_local()
    per_call = manifest.batch_size * manifest.max_batches
    loss = math.nan
    for _ in range(epochs):
        shuffled = pooled.select(rng.permutation(pooled.num_examples))
        losses = []
        for start in range(0, shuffled.num_examples, per_call):
            batches = split_batches(shuffled.select(slice(start, start + per_call)), manifest.batch_size)
            packed = TaskBatches.pack(batches, manifest)
            model.set_global(params)
            update = model.update(
                packed, packed.num_batches, learning_rate, local_learning_rate=learning_rate
            )
            if not (math.isfinite(update.loss) and update.max_abs_change < 1e30):
                raise ValueError(f"central training diverged at learning rate {learning_rate:g}; lower it")
            params = {k: params[k] + update.delta[k] for k in params}
            losses.append(update.loss)
        loss = float(np.mean(losses))
    return params, loss


def accuracies_with_intervals(
    devices: Devices, work: EvaluationWork, roles: Sequence[int], seed: int = 0
) -> Accuracies:
    """Token accuracy (without and with OOV targets) over `roles`, each role's counts kept apart
    so that the interval resamples roles (`android_sim.intervals`)."""
    sums: list[EvaluationSums] = devices.map(work, list(roles))
    rows = resample_rows(len(sums), np.random.default_rng(seed))

    def interval(correct: str, total: str) -> Interval:
        numerators = np.array([s.as_dict().get(correct, 0.0) for s in sums])
        denominators = np.array([s.as_dict().get(total, 0.0) for s in sums])
        if denominators.sum() <= 0:
            return Interval(math.nan, math.nan, math.nan, len(sums))
        return bootstrap_ratio(numerators, denominators, rows)

    return Accuracies(
        interval("correct_in_vocab_tokens_sum", "in_vocab_tokens_sum"),
        interval("correct_tokens_sum", "tokens_sum"),
        tuple(s.as_dict().get("correct_in_vocab_tokens_sum", 0.0) for s in sums),
        tuple(s.as_dict().get("in_vocab_tokens_sum", 0.0) for s in sums),
    )
