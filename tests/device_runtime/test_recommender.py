"""On-device top-k: exclusions, the local-parameter cache and its refresh, the cold start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from device_runtime.example_store import Event, ExampleStore
from device_runtime.recommender import Recommender
from model_export.config import Feedback, ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED, IMPLICIT, SMALL, perturbed_globals


class CountingModel(TFLiteModel):
    """The real model, counting reconstructions (the expensive step the cache avoids) and keeping
    the last support batches it was given."""

    reconstructions = 0
    support = None

    def reconstruct(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.reconstructions += 1
        self.support = args[0]
        return super().reconstruct(*args, **kwargs)


@pytest.fixture
def setup(export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    model = CountingModel(export(BIASED), backend=backend)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    store.add(Event({"item": i, "label": float(1 + i % 5)}, float(i)) for i in range(0, 40, 2))
    return model, store, perturbed_globals(model.get_global(), seed=3)


def test_top_k_excludes_used_and_listed_items_and_is_sorted(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    recommender = Recommender(model, store, globals_)

    top = recommender.recommend(10, exclude=[41, 43])
    everything = recommender.recommend(200, exclude_used=False)

    assert top.source == "personalized"
    assert len(top.items) == 10
    assert not set(top.items) & (set(range(0, 40, 2)) | {41, 43})
    assert np.all(np.diff(top.scores) <= 0)
    # The same ranking as scoring everything and filtering afterwards.
    allowed = [i for i in everything.items if i not in set(range(0, 40, 2)) | {41, 43}]
    assert list(top.items) == allowed[:10]
    assert len(everything.items) == 200


def test_local_parameters_are_cached_and_refreshed_when_the_store_changes(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    recommender = Recommender(model, store, globals_)

    recommender.recommend(10)
    recommender.recommend(10)
    assert model.reconstructions == 1

    store.add([Event({"item": 101, "label": 5.0}, 100.0), Event({"item": 103, "label": 5.0}, 101.0)])
    after_new_data = recommender.recommend(10)
    assert model.reconstructions == 2
    assert not {101, 103} & set(after_new_data.items)

    recommender.set_global(perturbed_globals(globals_, seed=4))
    recommender.recommend(10)
    assert model.reconstructions == 3


def test_cache_survives_an_app_restart(setup, export: Callable[[ModelConfig], Path], backend: str) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    before = Recommender(model, store, globals_).recommend(10)

    restarted = CountingModel(export(BIASED), backend=backend)
    after = Recommender(restarted, store, globals_).recommend(10)

    assert restarted.reconstructions == 0
    np.testing.assert_array_equal(after.items, before.items)


def test_a_damaged_cache_is_rebuilt(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    expected = Recommender(model, store, globals_).recommend(10)
    key = store.load_local_state("recommender.local_params").partition(b"\n")[0]
    store.save_local_state("recommender.local_params", key + b"\n" + b"garbage")

    fresh = Recommender(model, store, globals_)
    model.reconstructions = 0
    result = fresh.recommend(10)

    assert model.reconstructions == 1
    np.testing.assert_array_equal(result.items, expected.items)


def test_cold_start_ranks_by_item_bias(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, _, globals_ = setup
    empty = ExampleStore(tmp_path / "new-phone.sqlite", model.manifest.features)

    top = Recommender(model, empty, globals_).recommend(5, exclude=[int(np.argmax(globals_["item_bias"]))])

    assert top.source == "popularity"
    assert list(top.items) == list(np.argsort(-globals_["item_bias"])[1:6])
    assert model.reconstructions == 0


TOPICS = tuple(i % 3 for i in range(60))
TOPICAL = ModelConfig(
    num_items=60,
    embedding_dim=8,
    batch_size=4,
    max_batches=6,
    top_k=20,
    feedback=Feedback.IMPLICIT,
    item_bias=True,
    item_groups=TOPICS,
    group_embeddings=True,
    group_bias=True,
    group_rate=0.25,
)


def test_cold_start_ranks_by_item_and_topic_bias(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    """A user with no examples sees what the model scores for a user it knows nothing about: each
    item's bias plus its topic's, not the item biases alone."""
    model = TFLiteModel(export(TOPICAL), backend=backend)
    globals_ = model.get_global()
    globals_["item_bias"] = np.linspace(1.0, 0.0, 60, dtype=np.float32)  # item 0 the most popular alone
    globals_["group_bias"] = np.array([0.0, 0.0, 6.0], np.float32)  # x sqrt(0.25): topic 2 +3
    empty = ExampleStore(tmp_path / "new-phone.sqlite", model.manifest.features)

    top = Recommender(model, empty, globals_).recommend(5)

    assert top.source == "popularity"
    assert list(top.items) == [2, 5, 8, 11, 14]  # topic 2's items, by their own bias
    np.testing.assert_allclose(top.scores, globals_["item_bias"][top.items] + 3.0, rtol=1e-5)


def test_cold_start_without_item_bias_says_so(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    model = TFLiteModel(export(SMALL))

    store = ExampleStore(tmp_path / "s.sqlite", model.manifest.features)

    top = Recommender(model, store, model.get_global()).recommend(5)

    assert top.source == "unavailable"
    assert len(top.items) == 0
    assert "no popularity parameter" in top.message


def test_bad_requests(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    recommender = Recommender(model, store, globals_)

    with pytest.raises(ValueError, match=r"k must be in \[1, 200\]"):
        recommender.recommend(0)
    with pytest.raises(ValueError, match="excluded item ids"):
        recommender.recommend(5, exclude=[200])


def test_implicit_reconstruction_samples_negatives_as_training_does(
    export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path
) -> None:
    model = CountingModel(export(IMPLICIT), backend=backend)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    shared = list(range(3, 30, 3))
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(shared))

    Recommender(model, store, model.get_global()).recommend(10)

    support = model.support
    assert support is not None
    real = support.weights > 0
    items, labels = support.rows["item"][support.features["item"]][real], support.features["label"][real]
    assert sorted(items[labels == 1.0].tolist()) == shared
    negatives = items[labels == 0.0]
    assert len(negatives) == 4 * len(shared)  # the task config's negatives per share
    assert not set(negatives.tolist()) & set(shared)
