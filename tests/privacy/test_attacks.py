"""What a curious server can compute from what one device sends it, tried as an attacker would.

The real exported biased MovieLens model and the real device runtime: a device trains with
`run_training_task` and its report is what `OrchestratorClient.report_training` puts on the wire
(plaintext) or its masked input in a real secure round among several devices (secure). During
`update` the user embedding `u` is frozen, so each changed item row's delta is a multiple of `u`,
and with item biases that multiple is the row's bias delta: `delta_E[i] / delta_b[i] = u`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from contracts.params import decode_params, decode_sparse_delta, encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.client_task import Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_environment import Environment
from device_runtime.task_examples import prepare
from model_export.config import ModelConfig
from model_runtime.support_query import reconstruct_locals
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from secure_aggregation import server
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.quantization import Layout, decode_signed, quantize
from tests.conftest import MOVIELENS

UserData = list[tuple[np.ndarray, np.ndarray, np.ndarray]]
DEVICES = 6
TASK = {"update_learning_rate": 0.5, "reconstruction_learning_rate": 0.1}


@dataclass
class Trained:
    """One device's secret (its reconstructed user embedding and query items) and its delta."""

    user_embedding: np.ndarray
    query_items: set[int]
    delta: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def trained(
    export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Trained]]:
    model_dir = export(MOVIELENS)
    model = TFLiteModel(model_dir)
    manifest = model.manifest
    global_params = decode_params(
        (model_dir / "global_params.safetensors").read_bytes(), manifest.global_params, "globals"
    )
    config = TaskConfig.from_manifest(manifest, **TASK)
    out = []
    for u in range(DEVICES):
        items, ratings, times = movielens_users[u]
        store = ExampleStore(tmp_path_factory.mktemp("store") / "s.sqlite", manifest.features)
        store.add(
            Event({"item": int(i), "label": float(r)}, float(t))
            for i, r, t in zip(items, ratings, times, strict=True)
        )
        result = run_training_task(model, Environment.of(store), global_params, Task(config, seed=0))
        assert result.delta is not None, result.message
        # The device's secret, recomputed the way the task computed it (reconstruction is deterministic).
        data = prepare(store, manifest, config, seed=0)
        model.set_global(global_params)
        reconstruct_locals(model, TaskBatches.pack(data.support, manifest), config)
        query_items = {int(i) for batch in data.query for i in batch["item"]}
        out.append(Trained(model.get_local()["user_embedding"].ravel().copy(), query_items, result.delta))
        model.reset_local()
        store.close()
    return model_dir, out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def recover_embedding(item_embeddings: np.ndarray, item_bias: np.ndarray) -> np.ndarray:
    """The attack: the median over rows of delta_E[i] / delta_b[i] (rows with a nonzero bias delta)."""
    rows = np.flatnonzero(np.abs(item_bias) > 0)
    return np.asarray(np.median(item_embeddings[rows] / item_bias[rows, None], axis=0))


def plaintext_reports(devices: list[Trained]) -> list[dict[str, np.ndarray]]:
    """What the server decodes from each device's plaintext report."""
    return [
        {name: t.dense() for name, t in decode_sparse_delta(encode_sparse_delta(d.delta)).items()}
        for d in devices
    ]


def secure_inputs(model_dir: Path, devices: list[Trained]) -> list[dict[str, np.ndarray]]:
    """What the server holds from each device in a secure round: its masked input, read as the
    signed, dequantized vector the attacker would most like it to be."""
    layout = Layout.of(TFLiteModel(model_dir).manifest.global_params)
    params = RoundParameters("attack/1/x", layout.length, 32, 10.0, len(devices), 0, 0.5, 3)
    sessions = {i + 1: DeviceSession(params) for i in range(len(devices))}
    roster = {i: s.advertise() for i, s in sessions.items()}
    graph = round_graph(params, sorted(roster))
    shares = {i: s.share_keys(i, roster) for i, s in sessions.items()}
    rng = np.random.default_rng(0)
    received = []
    for i, session in sessions.items():
        quantized = quantize(layout.flatten(devices[i - 1].delta), params, rng)
        masked = session.masked_input(quantized, server.ciphertexts_for(i, graph, shares))
        received.append(layout.unflatten(decode_signed(masked, params) * (params.clip_norm / params.levels)))
    return received


def test_plaintext_reports_give_away_each_users_embedding(trained: tuple[Path, list[Trained]]) -> None:
    # Prepare
    _, devices = trained

    # Execute: the attack on each report
    recovered = [recover_embedding(r["item_embeddings"], r["item_bias"]) for r in plaintext_reports(devices)]

    # Assert: the risk plaintext mode carries; the user embedding is recovered
    for device, guess in zip(devices, recovered, strict=True):
        assert cosine(guess, device.user_embedding) > 0.999


def test_plaintext_reports_give_away_which_items_each_user_rated(trained: tuple[Path, list[Trained]]) -> None:
    _, devices = trained

    touched = [set(np.flatnonzero(np.abs(r["item_bias"]) > 0).tolist()) for r in plaintext_reports(devices)]

    for device, rows in zip(devices, touched, strict=True):
        assert rows == device.query_items


def test_secure_inputs_are_uncorrelated_with_the_delta_and_reveal_no_embedding(
    trained: tuple[Path, list[Trained]],
) -> None:
    # Prepare
    model_dir, devices = trained
    layout = Layout.of(TFLiteModel(model_dir).manifest.global_params)

    # Execute: the same attack on what the server receives under secure aggregation
    received = secure_inputs(model_dir, devices)
    recovered = [recover_embedding(r["item_embeddings"], r["item_bias"]) for r in received]
    correlations = [
        np.corrcoef(layout.flatten(r), layout.flatten(d.delta))[0, 1]
        for r, d in zip(received, devices, strict=True)
    ]

    # Assert: no correlation with the delta (28,594 coordinates: chance is about +-0.006), and the
    # recovered embedding is no closer than a random direction in 16 dimensions (|cosine| ~ 0.2)
    assert max(abs(c) for c in correlations) < 0.03, correlations
    cosines = [cosine(g, d.user_embedding) for g, d in zip(recovered, devices, strict=True)]
    assert abs(float(np.mean(cosines))) < 0.4 and max(abs(c) for c in cosines) < 0.8, cosines


def test_secure_inputs_do_not_reveal_which_items_were_rated(trained: tuple[Path, list[Trained]]) -> None:
    # Prepare
    model_dir, devices = trained
    num_items = MOVIELENS.num_items

    # Execute: the attacker guesses the |S| rows with the largest bias entries
    received = secure_inputs(model_dir, devices)
    hits, chance = [], []
    for r, device in zip(received, devices, strict=True):
        size = len(device.query_items)
        guess = set(np.argsort(-np.abs(r["item_bias"]))[:size].tolist())
        hits.append(len(guess & device.query_items) / size)
        chance.append(size / num_items)

    # Assert: every row looks alike (none is zero), and the guesses do no better than chance
    assert all(np.count_nonzero(r["item_bias"]) == num_items for r in received)
    assert float(np.mean(hits)) < 3 * float(np.mean(chance)) + 0.02, (hits, chance)
