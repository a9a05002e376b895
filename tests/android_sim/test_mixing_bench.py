"""The skewed-setup benchmark (mixing centralized data): who holds the new items, and a short run
of each strategy at a tiny size."""

from __future__ import annotations

import numpy as np
import pytest

from android_sim.bench.federated import Rounds
from android_sim.bench.mixing import (
    Harness,
    SkewedSetup,
    evaluation_cases,
    expressions_setup,
    run_strategy,
    train,
)
from android_sim.bench.models import ModelCache
from android_sim.expressions import SyntheticConfig

TINY = SyntheticConfig(num_expressions=120, num_users=200)


@pytest.fixture(scope="module")
def setup() -> SkewedSetup:
    return expressions_setup(TINY, new_fraction=0.05)


@pytest.fixture(scope="module")
def harness(setup: SkewedSetup, tmp_path_factory: pytest.TempPathFactory) -> Harness:
    models = ModelCache(tmp_path_factory.mktemp("models"))
    return Harness.build(setup, models, Rounds(rounds=3, clients_per_round=10, evaluate_every=3), workers=2)


def test_no_training_device_holds_a_new_item_but_public_data_and_test_futures_do(setup: SkewedSetup) -> None:
    held = np.concatenate([setup.device(u).item_ids for u in setup.train_users])
    public = np.concatenate([setup.data.devices[u].item_ids for u in setup.public_users])
    new_cases, overall_cases = evaluation_cases(setup)

    assert len(setup.new_items) == 6
    assert not np.isin(held, setup.new_items).any()
    assert np.isin(public, setup.new_items).any()
    assert not set(setup.public_users) & set(setup.train_users) and not set(setup.test_users) & set(
        setup.train_users + setup.public_users
    )
    assert new_cases and all(target in setup.new_items for _, target in new_cases)
    assert all(not np.isin(store.item_ids, setup.new_items).any() for store, _ in new_cases + overall_cases)
    # The upper bound's devices keep them.
    assert np.isin(
        np.concatenate([setup.device(u, keep_new=True).item_ids for u in setup.train_users]), setup.new_items
    ).any()


def test_gradient_transfer_moves_the_new_items_and_costs_bytes(harness: Harness) -> None:
    new = harness.setup.new_items

    plain, _, plain_bytes = train(harness, "none")
    mixed, refused, mixed_bytes = train(harness, "gradient_transfer", 1.0)

    assert refused == 0 and plain_bytes == 0 and mixed_bytes > 0
    # Public shares of the new items raise their biases; without mixing they are only negatives.
    assert mixed["item_bias"][new].mean() > plain["item_bias"][new].mean()


def test_each_strategy_is_one_call_with_scores_in_range(harness: Harness) -> None:
    result = run_strategy(harness, "all_data")

    for top in (result.new_items, result.overall):
        assert 0.0 <= top.ndcg <= top.hit_rate <= 1.0
    assert result.bytes_per_assignment == 0
    with pytest.raises(ValueError, match="unknown strategy 'parallel'"):
        run_strategy(harness, "parallel")
    with pytest.raises(ValueError, match="gradient_transfer takes a weight"):
        run_strategy(harness, "gradient_transfer")
