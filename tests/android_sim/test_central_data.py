"""The fleet's centralized dataset: public accounts' shares, each example with its account's id."""

from __future__ import annotations

import numpy as np

from android_sim.central_data import (
    MIXING_STRATEGIES,
    SHARES_PER_NEW_EXPRESSION,
    central_only_rows,
    centralized_examples,
)
from android_sim.device_data import expression_fleet
from android_sim.expressions import SyntheticConfig
from model_export.config import ITEM


def test_every_public_share_carries_its_account_and_new_items_are_shared_by_several_accounts() -> None:
    # Prepare: a few devices train; the rest only appear in the trending data.
    data = expression_fleet(SyntheticConfig(num_expressions=200, num_users=300))
    training = data.devices[:20]

    # Execute
    central = centralized_examples(data, training, data.devices, count=400, seed=1)

    # Assert: one account id per example, in account order; accounts about a device's mean
    # history long; each new item in SHARES_PER_NEW_EXPRESSION distinct accounts (more if also trending).
    items, accounts = central.examples[ITEM], central.accounts
    assert accounts.shape == (central.examples.num_examples,) and accounts.dtype == np.int64
    assert np.all(np.diff(accounts) >= 0)
    mean_history = np.mean([len(d) for d in data.devices])
    num_accounts = len(np.unique(accounts))
    assert abs(400 / num_accounts - mean_history) <= mean_history / 2
    assert len(central.new_items) > 0
    for item in central.new_items:
        assert len(np.unique(accounts[items == item])) >= SHARES_PER_NEW_EXPRESSION


def test_mixing_declares_the_items_only_the_centralized_data_holds_and_nothing_else_does() -> None:
    # Prepare: the items no training device holds.
    data = expression_fleet(SyntheticConfig(num_expressions=200, num_users=300))
    new_items = centralized_examples(data, data.devices[:20], data.devices, count=400, seed=1).new_items
    assert len(new_items) > 0

    # Execute / Assert: every mixing strategy declares them (sorted, once each); no mixing, the
    # benchmarks' all-data run, or a model that samples no negatives declares none.
    for strategy in MIXING_STRATEGIES:
        rows = central_only_rows(strategy, new_items[::-1], samples_negatives=True)
        assert rows == tuple(int(i) for i in np.sort(new_items))
        assert central_only_rows(strategy, new_items, samples_negatives=False) == ()
    assert central_only_rows("none", new_items, samples_negatives=True) == ()
    assert central_only_rows("all_data", new_items, samples_negatives=True) == ()
