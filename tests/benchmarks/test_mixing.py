"""The skewed-setup benchmark (mixing centralized data): who holds the new items, what each strategy
adds through the system's own functions, and a short run of each at a tiny size."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from android_sim.expressions import SyntheticConfig
from android_sim.simulation.rounds import Rounds, per_item_names
from benchmarks.mixing import main as mixing_main
from benchmarks.mixing_study import (
    Harness,
    SkewedSetup,
    _client_work,
    evaluation_cases,
    expressions_setup,
    mixing_config,
    run_strategy,
    train,
)
from benchmarks.model_cache import ModelCache
from contracts.mixing import CentralDataset, MixingConfig, encode_examples
from model_runtime.tflite_model import TFLiteModel
from orchestrator.populations.mixing import assignment_examples

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


def test_the_centralized_data_is_the_public_accounts_shares_account_by_account(harness: Harness) -> None:
    setup = harness.setup
    expected = np.concatenate([setup.data.devices[u].item_ids for u in setup.public_users])

    accounts = [i for i, u in enumerate(setup.public_users) for _ in range(len(setup.data.devices[u]))]

    np.testing.assert_array_equal(harness.central.examples["item"], expected)
    assert np.isin(setup.new_items, harness.central.examples["item"]).any()
    # Each share's account is its group id: the server's pseudo-users are the accounts.
    assert harness.central.groups is not None
    np.testing.assert_array_equal(harness.central.groups, accounts)


def test_gradient_transfer_moves_the_new_items_and_costs_bytes(harness: Harness) -> None:
    new = harness.setup.new_items

    plain = train(harness, MixingConfig())
    mixed = train(harness, mixing_config(harness, "gradient_transfer", 1.0))

    assert mixed.refused == 0 and plain.bytes_per_assignment == 0 and mixed.bytes_per_assignment > 0
    # Public shares of the new items raise their biases; without mixing they are only negatives.
    # The public accounts share the new items: their biases rise relative to the catalog's
    # (every item's moves: the accounts' sampled negatives push the others down).
    moved = mixed.params["item_bias"] - plain.params["item_bias"]
    assert moved[new].mean() > moved.mean()


def test_parallel_training_merges_the_central_delta_by_alpha_and_sends_nothing(harness: Harness) -> None:
    new = harness.setup.new_items

    plain = train(harness, MixingConfig())
    nothing = train(harness, mixing_config(harness, "parallel_training", 0.0))
    mixed = train(harness, mixing_config(harness, "parallel_training", 0.5))

    # alpha 0 merges none of the central delta: the federated rounds exactly.
    for name, value in plain.params.items():
        np.testing.assert_array_equal(nothing.params[name], value, err_msg=name)
    assert mixed.bytes_per_assignment == 0 and mixed.central_failed == 0
    # The public accounts share the new items: their biases rise relative to the catalog's
    # (every item's moves: the accounts' sampled negatives push the others down).
    moved = mixed.params["item_bias"] - plain.params["item_bias"]
    assert moved[new].mean() > moved.mean()


def test_example_transfer_sends_the_routes_bytes_and_moves_the_new_items(harness: Harness) -> None:
    new, features = harness.setup.new_items, TFLiteModel(harness.model_dir).manifest.features

    plain = train(harness, MixingConfig())
    mixed = train(harness, mixing_config(harness, "example_transfer", 8))

    # Every assignment carries 8 examples, encoded as the route encodes them (the same size whichever 8).
    assert mixed.bytes_per_assignment == len(
        encode_examples(harness.central.examples.select(slice(0, 8)), features)
    )
    # The public accounts share the new items: their biases rise relative to the catalog's
    # (every item's moves: the accounts' sampled negatives push the others down).
    moved = mixed.params["item_bias"] - plain.params["item_bias"]
    assert moved[new].mean() > moved.mean()


def test_transferred_examples_train_but_do_not_count_in_the_reported_weight(harness: Harness) -> None:
    # Prepare: one device's task with and without an assignment's centralized examples.
    users, histories = harness.trainers(keep_new=False)
    user = users[0]
    model = TFLiteModel(harness.model_dir)
    params = model.get_global()
    per_item = per_item_names(model.manifest)
    sample = assignment_examples(
        harness.central.examples, MixingConfig("example_transfer", examples_per_assignment=16), "a"
    )

    # Execute
    own = _client_work(harness, histories, per_item, 1, None, 0.0, {})(model, params, user)
    model.set_global(params)
    mixed = _client_work(harness, histories, per_item, 1, None, 0.0, {user: sample})(model, params, user)

    # Assert: the same weight; the update covers the central examples' items too.
    assert own is not None and mixed is not None
    assert mixed[1] == own[1]
    own_rows, mixed_rows = own[0]["item_bias"].rows, mixed[0]["item_bias"].rows
    assert set(own_rows) < set(mixed_rows) and set(sample["item"]) <= set(mixed_rows)


def test_each_strategy_is_one_call_with_scores_in_range(harness: Harness) -> None:
    result = run_strategy(harness, "all_data")

    for top in (result.new_items, result.overall):
        assert 0.0 <= top.ndcg <= top.hit_rate <= 1.0
    assert result.bytes_per_assignment == 0
    with pytest.raises(ValueError, match="unknown strategy 'parallel'"):
        run_strategy(harness, "parallel")
    with pytest.raises(ValueError, match="take a weight"):
        run_strategy(harness, "gradient_transfer")
    with pytest.raises(ValueError, match="a number of examples"):
        run_strategy(harness, "example_transfer", 2.5)


def test_account_ids_or_else_the_pseudo_user_size_reach_the_servers_functions(harness: Harness) -> None:
    without_ids = replace(harness, central=CentralDataset(harness.central.examples))
    sized = replace(without_ids, examples_per_pseudo_user=8)

    by_account = train(harness, mixing_config(harness, "gradient_transfer", 1.0))
    by_default = train(without_ids, mixing_config(without_ids, "gradient_transfer", 1.0))
    by_size = train(sized, mixing_config(sized, "gradient_transfer", 1.0))

    assert mixing_config(sized, "parallel_training", 0.3).examples_per_pseudo_user == 8
    # Other pseudo-users, another central gradient: other globals.
    bias = [t.params["item_bias"] for t in (by_account, by_default, by_size)]
    assert not np.allclose(bias[0], bias[1]) and not np.allclose(bias[1], bias[2])


def test_the_bench_refuses_a_pseudo_user_size_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    code = mixing_main(["--examples-per-pseudo-user", "8"])

    assert code == 2
    assert "add --without-account-ids" in capsys.readouterr().err


def test_mixing_strategies_declare_the_new_items_central_only_and_the_ceiling_does_not(
    harness: Harness,
) -> None:
    new = tuple(int(i) for i in harness.setup.new_items)

    for strategy in ("parallel_training", "example_transfer", "gradient_transfer"):
        assert harness.for_strategy(strategy).config.central_only_items == new
    for strategy in ("none", "all_data"):  # with all data the devices hold them
        assert harness.for_strategy(strategy).config.central_only_items == ()
    assert replace(harness, declare_new_items=False).for_strategy("example_transfer").config == harness.config

    # A device's batches of a declaring strategy never hold a new item, as a share or a negative.
    declaring = harness.for_strategy("example_transfer")
    users, histories = declaring.trainers(keep_new=False)
    manifest = TFLiteModel(harness.model_dir).manifest
    for user in users[:20]:
        support, query = declaring.client_batches(manifest, histories[user], user, 1, None)
        for batch in (*support, *query):
            assert not np.isin(batch["item"], harness.setup.new_items).any()
