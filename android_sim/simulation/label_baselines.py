"""The cheap baselines a classification or regression model with locals must beat, on its own table.

Measured on exactly the examples the model's held-out figures are (each held-out device's ReconEval
query, `clients.evaluation_task`'s split of its selected examples), so that the model's difference
from each is paired over the same devices:
- classification: the training devices' **majority class**, and each device's **own majority** on
  its support examples (what its locals were reconstructed from; the majority class when it has none);
- regression: the training devices' **mean label**, and each device's **own mean** on its support.

A baseline's figure is the metric the model reports: accuracy from a `correct` metric, RMSE from a
`squared_error` one (`predictions.SHOWN`); a model reporting neither gets no baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from android_sim.simulation.clients import evaluation_task, selected
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.task_config import TaskConfig
from model_runtime.support_query import split_support_query
from model_runtime.tflite_model import EvaluationSums

CLASSIFICATION = ("majority class", "per-user majority")
REGRESSION = ("global mean", "per-user mean")


def label_of(batches: Sequence[Examples], label: str) -> np.ndarray:
    return np.concatenate([np.asarray(b[label]).reshape(-1) for b in batches] + [np.zeros(0)])


def held_out_labels(
    devices: Sequence[Examples], test: Sequence[int], manifest: Manifest, task: TaskConfig
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each held-out device's (support labels, query labels) as ReconEval splits its examples."""
    label = manifest.label_features[0].name
    config = evaluation_task(task)
    out = []
    for i in test:
        support, query = split_support_query(selected(devices[i], config), manifest, config)
        out.append((label_of(support, label), label_of(query, label)))
    return out


def training_labels(devices: Sequence[Examples], train: Sequence[int], manifest: Manifest) -> np.ndarray:
    label = manifest.label_features[0].name
    return np.concatenate([np.asarray(devices[i][label]).reshape(-1) for i in train] + [np.zeros(0)])


def baseline_sums(
    kind: str, train: np.ndarray, held: Sequence[tuple[np.ndarray, np.ndarray]]
) -> dict[str, list[EvaluationSums]]:
    """Per baseline, each held-out device's sums over its query labels (`correct_sum` or
    `squared_error_sum`, and `weight_sum`: one per example): `kind` is the manifest's task kind."""
    if kind == "classification":
        overall = _majority(train)
        names, metric = CLASSIFICATION, "correct_sum"
    elif kind == "regression":
        overall = float(train.mean()) if len(train) else 0.0
        names, metric = REGRESSION, "squared_error_sum"
    else:
        raise ValueError(f"label baselines are for classification and regression, not {kind!r}")
    out: dict[str, list[EvaluationSums]] = {name: [] for name in names}
    for support, query in held:
        own = (
            overall
            if not len(support)
            else _majority(support)
            if kind == "classification"
            else support.mean()
        )
        for name, guess in zip(names, (overall, own), strict=True):
            if kind == "classification":
                value = float(np.sum(query == guess))
            else:
                value = float(np.sum((query - guess) ** 2))
            out[name].append(EvaluationSums({metric: value, "weight_sum": float(len(query))}))
    return out


def _majority(labels: np.ndarray) -> float:
    """The most frequent label (the smallest of a tie); 0 when there is none."""
    if not len(labels):
        return 0.0
    values, counts = np.unique(labels, return_counts=True)
    return float(values[int(np.argmax(counts))])


def label_baselines(
    devices: Sequence[Examples],
    train: Sequence[int],
    test: Sequence[int],
    manifest: Manifest,
    task: TaskConfig,
) -> dict[str, list[EvaluationSums]]:
    """The baselines' per-device sums on the held-out devices `test`, from the training devices'
    labels and each held-out device's own support."""
    return baseline_sums(
        manifest.task.kind,
        training_labels(devices, train, manifest),
        held_out_labels(devices, test, manifest, task),
    )
