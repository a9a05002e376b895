"""FedRecon for matrix factorization in plain, single-threaded numpy: the speed baseline.

The same maths as the exported model's signatures for the protocol's MF (`protocol_model`: a
score is <item_embeddings[item], user_embedding>, no biases, squared error), on the same packed
batches (`TaskBatches`), so that the fast simulation can be timed against it
(`benchmarks/speed_baseline.py`):
- `reconstruct`: the user vector from zeros, `num_steps` SGD steps over the support batches,
  cycling, each step on one batch's weighted mean loss plus l2_local x |u|^2, items frozen;
- `update`: `num_steps` steps on the task's item rows, the user vector frozen, each on one
  batch's weighted mean loss plus l2_global x the weighted mean of its rows' squared norms;
- the server: the weighted mean of the reports' deltas (weight: the query's examples), then SGD
  at rate `server_learning_rate`;
- ReconEval for validation: reconstruct on support, the weighted squared error on query.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from android_sim.simulation.rounds import SupportQuery
from contracts.task_config import TaskConfig
from model_export.config import ITEM, LABEL
from model_runtime.support_query import num_steps
from model_runtime.task_batches import TaskBatches


@dataclass(frozen=True)
class _Batch:
    slots: np.ndarray  # task-row slot of each example
    labels: np.ndarray
    weights: np.ndarray
    total: float  # the weights' sum (0: an all-padding batch, skipped)
    distinct: bool  # no slot twice: rows can be updated by plain indexing


def _batches(batches: TaskBatches) -> list[_Batch]:
    """The call's batches, read once (a step then costs a few small numpy operations)."""
    out = []
    for b in range(batches.num_batches):
        slots = batches.features[ITEM][b]
        weights = batches.weights[b]
        out.append(
            _Batch(
                slots,
                batches.features[LABEL][b].reshape(-1),
                weights,
                float(weights.sum()),
                len(np.unique(slots)) == len(slots),
            )
        )
    return out


def _task_rows(items: np.ndarray, batches: TaskBatches) -> tuple[np.ndarray, np.ndarray]:
    rows = batches.rows[ITEM][: batches.num_rows[ITEM]]
    return rows, items[rows]


def reconstruct(
    items: np.ndarray, batches: TaskBatches, steps: int, learning_rate: float, l2_local: float = 0.0
) -> np.ndarray:
    """The user vector fitted on `batches` with the item embeddings frozen."""
    _, rows = _task_rows(items, batches)
    read = _batches(batches)
    user = np.zeros(items.shape[1], np.float32)
    for step in range(steps if read else 0):
        batch = read[step % len(read)]
        if batch.total <= 0:
            continue
        vectors = rows[batch.slots]
        error = vectors @ user - batch.labels
        gradient = (2.0 / batch.total) * ((batch.weights * error) @ vectors)
        if l2_local:
            gradient += 2.0 * l2_local * user
        user = user - learning_rate * gradient
    return user


def update(
    items: np.ndarray,
    user: np.ndarray,
    batches: TaskBatches,
    steps: int,
    learning_rate: float,
    l2_global: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(task rows, their delta): the item rows of the task trained with the user vector frozen."""
    task_rows, start = _task_rows(items, batches)
    rows = start.copy()  # updated in place
    read = _batches(batches)
    for step in range(steps if read else 0):
        batch = read[step % len(read)]
        if batch.total <= 0:
            continue
        vectors = rows[batch.slots]
        error = vectors @ user - batch.labels
        scale = (2.0 * learning_rate / batch.total) * batch.weights
        change = (scale * error)[:, None] * user[None, :]
        if l2_global:
            change += (l2_global * scale)[:, None] * vectors
        if batch.distinct:
            rows[batch.slots] -= change
        else:  # a row twice in the batch: its gradients add up
            np.subtract.at(rows, batch.slots, change)
    return task_rows, rows - start


def client_delta(
    items: np.ndarray, client: SupportQuery, config: TaskConfig
) -> tuple[np.ndarray, np.ndarray, float]:
    """FedRecon's client task: (rows, their delta, weight)."""
    support, query = client.support, client.query
    user = reconstruct(
        items,
        support,
        num_steps(support.num_batches, config.reconstruction_max_epochs, config.reconstruction_max_steps),
        config.reconstruction_learning_rate,
        config.l2_local,
    )
    steps = num_steps(query.num_batches, config.update_max_epochs, config.update_max_steps)
    rows, delta = update(items, user, query, steps, config.update_learning_rate, config.l2_global)
    return rows, delta, float(query.num_examples)


def recon_eval(items: np.ndarray, clients: Sequence[SupportQuery], config: TaskConfig) -> float:
    """ReconEval's RMSE over `clients` (example-weighted)."""
    squared, weight = 0.0, 0.0
    for client in clients:
        steps = num_steps(
            client.support.num_batches, config.reconstruction_max_epochs, config.reconstruction_max_steps
        )
        user = reconstruct(items, client.support, steps, config.reconstruction_learning_rate, config.l2_local)
        _, rows = _task_rows(items, client.query)
        for batch in _batches(client.query):
            error = rows[batch.slots] @ user - batch.labels
            squared += float((batch.weights * error * error).sum())
            weight += batch.total
    return float(np.sqrt(squared / weight)) if weight > 0 else float("nan")


@dataclass
class NumpyRun:
    items: np.ndarray
    seconds: float
    rmse: float  # ReconEval on the validation clients after the last round


def train(
    items: np.ndarray,
    clients: Sequence[SupportQuery],
    train_users: Sequence[int],
    validation_users: Sequence[int],
    config: TaskConfig,
    rounds: int,
    clients_per_round: int,
    sampling_seed: int = 0,
    server_learning_rate: float = 1.0,
) -> NumpyRun:
    """`rounds` rounds of FedRecon, clients drawn as `train_federated` draws them; validated
    (ReconEval) before the first round and after the last, as the simulation does."""
    rng = np.random.default_rng(sampling_seed)
    population = np.asarray(train_users)
    per_round = min(clients_per_round, len(population))
    items = np.array(items, np.float32, copy=True)
    validation = [clients[u] for u in validation_users]
    started = time.perf_counter()
    recon_eval(items, validation, config)
    for _ in range(rounds):
        chosen = rng.choice(population, size=per_round, replace=False)
        total = np.zeros_like(items, dtype=np.float64)
        weight = 0.0
        for user in chosen.tolist():
            rows, delta, w = client_delta(items, clients[user], config)
            if not np.all(np.isfinite(delta)):
                continue
            np.add.at(total, rows, w * delta.astype(np.float64))
            weight += w
        if weight > 0:
            items = (items + server_learning_rate * total / weight).astype(np.float32)
    rmse = recon_eval(items, validation, config)
    return NumpyRun(items, time.perf_counter() - started, rmse)
