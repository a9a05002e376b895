"""The speed baseline's numpy FedRecon does the exported model's maths: on a tiny MF, its
reconstruction, update and ReconEval agree with the TFLite signatures' to float32 precision."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from android_sim.simulation.protocol import pack_support_query
from android_sim.simulation.rounds import SupportQuery
from benchmarks import numpy_fedrecon
from benchmarks.quality_methods import protocol_model
from contracts.features import Examples
from contracts.task_config import TaskConfig
from model_export.config import ITEM, LABEL, ModelConfig
from model_runtime.support_query import num_steps, reconstruct_locals
from model_runtime.tflite_model import EvaluationSums, TFLiteModel

TINY = protocol_model(40, embedding_dim=6, batch_size=4, max_batches=5, top_k=10)
CONFIG = TaskConfig(l2_global=0.01, l2_local=0.02, reconstruction_max_steps=7, update_max_steps=9)


def clients(seed: int, count: int, manifest) -> list[SupportQuery]:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(count):
        n = int(rng.integers(3, 30))
        examples.append(
            Examples(
                {
                    ITEM: rng.integers(0, 40, n).astype(np.int32),
                    LABEL: rng.integers(1, 6, n).astype(np.float32),
                }
            )
        )
    return pack_support_query(examples, manifest, CONFIG)


@pytest.fixture
def model(export: Callable[[ModelConfig], Path]) -> TFLiteModel:
    model = TFLiteModel(export(TINY))
    params = model.get_global()
    rng = np.random.default_rng(1)
    model.set_global({k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in params.items()})
    return model


def test_a_client_task_agrees_with_the_signatures(model: TFLiteModel) -> None:
    items = model.get_global()["item_embeddings"]
    for client in clients(0, 6, model.manifest):
        reconstruct_locals(model, client.support, CONFIG)
        steps = num_steps(client.query.num_batches, CONFIG.update_max_epochs, CONFIG.update_max_steps)
        update = model.update_rows(
            client.query,
            steps,
            CONFIG.update_learning_rate,
            l2_global=CONFIG.l2_global,
            l2_local=CONFIG.l2_local,
        )

        rows, delta, weight = numpy_fedrecon.client_delta(items, client, CONFIG)

        np.testing.assert_allclose(
            model.get_local()["user_embedding"],
            numpy_fedrecon.reconstruct(
                items,
                client.support,
                num_steps(client.support.num_batches, 5, CONFIG.reconstruction_max_steps),
                CONFIG.reconstruction_learning_rate,
                CONFIG.l2_local,
            ),
            rtol=1e-4,
            atol=1e-5,
        )
        assert rows.tolist() == update.rows["item_embeddings"].tolist()
        np.testing.assert_allclose(delta, update.delta["item_embeddings"], rtol=1e-3, atol=1e-5)
        assert weight == client.query.num_examples


def test_recon_eval_agrees_with_the_evaluate_signature(model: TFLiteModel) -> None:
    items = model.get_global()["item_embeddings"]
    found = clients(3, 5, model.manifest)
    total = EvaluationSums.zero()
    for client in found:
        reconstruct_locals(model, client.support, CONFIG)
        total = total + model.evaluate(client.query)

    rmse = numpy_fedrecon.recon_eval(items, found, CONFIG)

    assert rmse == pytest.approx(total.metrics()["rmse"], rel=1e-4)
