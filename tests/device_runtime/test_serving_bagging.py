"""Serving from a bagged reconstruction (`Bagging`): several reconstructions on bootstrap
resamples of the device's examples, ranked by their averaged softmax probabilities."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.task_config import TaskConfig
from device_runtime.example_store import Event, ExampleStore
from device_runtime.recommender import Bagging, Recommender, average_members
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import IMPLICIT, perturbed_globals

# Re-shares included: a resample draws among the examples, duplicates and all.
SHARED = [3, 7, 7, 12, 40, 41, 90, 120, 121]


class SupportModel(TFLiteModel):
    """The real model, keeping every support set it reconstructs from."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.supports: list = []  # type: ignore[type-arg]

    def reconstruct(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.supports.append(args[0])
        return super().reconstruct(*args, **kwargs)


@pytest.fixture
def setup(export: Callable[[ModelConfig], Path], backend: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    model = SupportModel(export(IMPLICIT), backend=backend)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    store.add(Event({"item": i, "label": 1.0}, float(t)) for t, i in enumerate(SHARED))
    return model, store, perturbed_globals(model.get_global(), seed=5)


def test_one_member_with_the_full_history_is_plain_serving(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    plain = Recommender(model, store, globals_).recommend(20, exclude_used=False)
    one = Bagging(members=1, include_full=True)
    bagged = Recommender(model, store, globals_, bagging=one).recommend(20, exclude_used=False)

    assert bagged.local_params == "bagged"
    assert bagged.items.tolist() == plain.items.tolist()
    # The log of one softmax: the scores less their log-sum-exp, the same gaps between items.
    np.testing.assert_allclose(np.diff(bagged.scores), np.diff(plain.scores), atol=1e-4)


def test_the_ranking_is_the_mean_of_the_members_probabilities(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    bagging = Bagging(members=3)
    recommender = Recommender(model, store, globals_, bagging=bagging)
    top = recommender.recommend(10, exclude_used=False)

    members = recommender._members
    assert members is not None and len(members[1]) == 3
    probabilities = []
    for local in members[1]:
        model.set_local(local)
        scores = model.infer().scores.astype(np.float64)
        probabilities.append(np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum())
    expected = np.log(np.mean(probabilities, axis=0))
    assert top.items.tolist() == np.argsort(-expected, kind="stable")[:10].tolist()
    np.testing.assert_allclose(top.scores, expected[top.items], rtol=1e-5)
    # The members differ (their resamples and negatives): it is not one reconstruction thrice.
    assert not np.allclose(probabilities[0], probabilities[1])


def test_members_fit_resamples_of_the_shares_and_never_a_share_as_a_negative(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    Recommender(model, store, globals_, bagging=Bagging(members=4)).recommend(10)

    assert len(model.supports) == 4
    positives_seen = []
    for support in model.supports:
        real = support.weights > 0
        items = support.rows["item"][support.features["item"]][real]
        labels = support.features["label"][real]
        positives = items[labels == 1.0]
        assert len(positives) == len(SHARED)  # a resample as large as the history
        assert set(positives.tolist()) <= set(SHARED)
        assert not set(items[labels == 0.0].tolist()) & set(SHARED)  # left-out shares too
        positives_seen.append(sorted(positives.tolist()))
    assert any(p != sorted(SHARED) for p in positives_seen)  # with replacement: some differ


def test_the_same_store_ranks_the_same_and_the_members_are_cached(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    bagging = Bagging(members=4)
    recommender = Recommender(model, store, globals_, bagging=bagging)
    first = recommender.recommend(10)
    again = recommender.recommend(10)
    assert len(model.supports) == 4  # the second call reconstructs nothing
    other = Recommender(model, store, globals_, bagging=bagging).recommend(10)

    assert first.items.tolist() == again.items.tolist() == other.items.tolist()
    np.testing.assert_array_equal(first.scores, other.scores)
    reseeded = Recommender(model, store, globals_, bagging=Bagging(members=4, seed=1)).recommend(10)
    assert not np.array_equal(first.scores, reseeded.scores)


def test_averaging_probabilities_is_not_averaging_scores() -> None:
    # One member is sure of item 0, the other likes item 1 and item 2 alike: the mean of the
    # scores puts item 1 first, the mean of the probabilities item 0.
    members = [np.array([10.0, 6.0, 0.0]), np.array([0.0, 6.0, 5.0])]

    by_probability = average_members(members, "probabilities")
    by_score = average_members(members, "scores")

    assert int(np.argmax(by_score)) == 1 and int(np.argmax(by_probability)) == 0
    softmax = [np.exp(m - m.max()) / np.exp(m - m.max()).sum() for m in members]
    np.testing.assert_allclose(by_probability, np.log((softmax[0] + softmax[1]) / 2))
    np.testing.assert_allclose(by_score, [5.0, 6.0, 2.5])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"members": 0}, r"members must be in \[1, 64\], got 0"),
        ({"members": 65}, r"members must be in \[1, 64\], got 65"),
        ({"members": True}, "members must be an integer, got True"),
        ({"members": 4.0}, "members must be an integer, got 4.0"),
        ({"resample": "yes"}, "resample must be true or false, got 'yes'"),
        ({"average": "median"}, r"average must be one of \['probabilities', 'scores'\], got 'median'"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\), got -1"),
        ({"member": 4}, r"unknown serving bagging fields \['member'\]"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        Bagging.from_json(settings)
    assert "\n" not in str(raised.value)


def test_settings_round_trip() -> None:
    bagging = Bagging(members=16, resample=False, include_full=True, average="scores", seed=3)
    assert Bagging.from_json(bagging.to_json()) == bagging
    assert Bagging.from_json({}) == Bagging()


def test_the_task_configs_serving_resamples_bag_the_full_reconstruction_and_the_resamples(setup) -> None:  # type: ignore[no-untyped-def]
    model, store, globals_ = setup
    plain = Recommender(model, store, globals_, TaskConfig()).recommend(10)
    assert plain.local_params == "reconstructed"
    recommender = Recommender(model, store, globals_, TaskConfig(serving_resamples=3))
    bagged = recommender.recommend(10)

    assert bagged.local_params == "bagged"
    assert recommender.bagging == Bagging(members=4, include_full=True)
    # The first member is the plain reconstruction (its support, negatives and all); then 3 resamples.
    assert len(model.supports) == 1 + 4
    np.testing.assert_array_equal(model.supports[1].features["item"], model.supports[0].features["item"])
    same = Bagging(members=4, include_full=True)
    explicit = Recommender(model, store, globals_, TaskConfig(), bagging=same).recommend(10)
    assert bagged.items.tolist() == explicit.items.tolist()


@pytest.mark.parametrize("bad", [-1, 64, 2.0, True])
def test_a_bad_serving_resamples_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="serving_resamples must be") as raised:
        TaskConfig.from_json({"serving_resamples": bad})
    assert "\n" not in str(raised.value)
    assert TaskConfig.from_json(TaskConfig(serving_resamples=7).to_json()).serving_resamples == 7
