"""A centralized (public, server-side) dataset for mixing (contracts.mixing), built from the fleet's data.

What a keyboard's server has: trending usage of public accounts. Here: shares drawn by each
expression's popularity over the whole population (the held-out devices' futures included, as
trending data sees everyone), plus the expressions that no training device holds, e.g. new
releases, each shared by a few public accounts; every share carries its account's id. For
MovieLens: movies drawn by popularity, with their mean rating (an editorial score).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from android_sim.device_data import DeviceData, FleetData
from contracts.features import Examples
from contracts.mixing import STRATEGIES
from model_export.config import ITEM, LABEL, Feedback

# The strategies that mix centralized data in (all but "none").
MIXING_STRATEGIES = tuple(s for s in STRATEGIES if s != "none")

# Each new expression appears this many times in the public data.
SHARES_PER_NEW_EXPRESSION = 4


@dataclass(frozen=True)
class CentralData:
    examples: Examples
    new_items: np.ndarray  # catalog rows no training device holds, present in the examples
    # int64, one per example: the public account that shared it (the dataset's group ids,
    # contracts.mixing.GROUP_TENSOR), so that the server's pseudo-users are accounts.
    accounts: np.ndarray


def centralized_examples(
    data: FleetData, training: list[DeviceData], everyone: list[DeviceData], count: int, seed: int
) -> CentralData:
    """`count` public examples (plus the new items' shares), account by account: public accounts
    of a device's mean history length, each a sample of the trending shares; each new item is
    shared by SHARES_PER_NEW_EXPRESSION distinct accounts (as many as there are, at most)."""
    rng = np.random.default_rng(seed + 7)
    held = np.unique(np.concatenate([d.item_ids for d in training])) if training else np.zeros(0, np.int64)
    new_items = np.setdiff1d(np.arange(data.num_items), held)
    shared = np.concatenate([d.item_ids for d in everyone])
    labels = np.concatenate([d.labels for d in everyone])
    popularity = np.bincount(shared, minlength=data.num_items).astype(np.float64)
    trending = rng.choice(data.num_items, size=count, p=popularity / popularity.sum())
    num_accounts = max(1, -(-count * len(everyone) // max(len(shared), 1)))
    per_new = min(SHARES_PER_NEW_EXPRESSION, num_accounts)
    accounts = np.concatenate(
        [
            rng.integers(num_accounts, size=count),
            *(rng.choice(num_accounts, size=per_new, replace=False) for _ in new_items),
        ]
    ).astype(np.int64)
    items = np.concatenate([trending, np.repeat(new_items, per_new)]).astype(np.int32)
    if data.feedback is Feedback.IMPLICIT:
        values = np.ones(len(items), np.float32)
    else:
        sums = np.bincount(shared, weights=labels, minlength=data.num_items)
        mean = np.where(popularity > 0, sums / np.maximum(popularity, 1), data.label_mean)
        values = np.round(mean[items]).astype(np.float32)
    order = np.lexsort((items, accounts))
    return CentralData(Examples({ITEM: items[order], LABEL: values[order]}), new_items, accounts[order])


def central_only_rows(strategy: str, new_items: np.ndarray, samples_negatives: bool) -> tuple[int, ...]:
    """The catalog rows a run's task declares central-only (`task_config.central_only_items`): with a
    mixing strategy, the items only the centralized data holds, as an operator who knows which rows
    are new would declare them, so that no device draws them as negatives against its own shares
    (each would otherwise be a sampled negative several times a round, unlearning what mixing
    teaches). Without mixing (`none`, or the benchmarks' `all_data`), or for a model that samples no
    negatives: none."""
    if strategy not in MIXING_STRATEGIES or not samples_negatives:
        return ()
    return tuple(int(i) for i in np.unique(np.asarray(new_items, np.int64)))
