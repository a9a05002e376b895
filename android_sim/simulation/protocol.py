"""The quality benchmark protocol (see docs/benchmarks.md): who trains, who is held out, which examples.

- Users are shuffled with seed 42 and split 80/10/10 into train/validation/test users, the
  same way as TensorFlow Federated's MovieLens tutorial (`np.random.seed(42)` and a shuffle
  of the user list, then `int(n * 0.8)` and `int(n * 0.9)` cut points).
- Each user's examples are what a device would select: the newest 300, shuffled with seed
  42 (`device_runtime.task_examples.shuffled`); then batches of the model's batch size, and
  support/query = alternating batches (`split_support_query`).
- For methods evaluated on seen users (StandardEval, FURL): each user's ratings ordered by
  time, the oldest 80% for training, the next 10% for validation, the newest 10% for test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from android_sim.movielens import Ratings
from android_sim.simulation.rounds import SupportQuery, TimeSplit
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.task_config import TaskConfig
from device_runtime.task_examples import shuffled
from model_export.config import ITEM, LABEL
from model_runtime.support_query import split_support_query
from model_runtime.task_batches import TaskBatches, split_batches

PROTOCOL_SEED = 42


@dataclass(frozen=True)
class UserSplit:
    train: list[int]  # user indices
    validation: list[int]
    test: list[int]


def split_users(num_users: int, seed: int = PROTOCOL_SEED) -> UserSplit:
    """80/10/10 train/validation/test users, shuffled with `seed` as TFF's tutorial does."""
    order = np.random.RandomState(seed).permutation(num_users)
    train_end, validation_end = int(num_users * 0.8), int(num_users * 0.9)
    users = order.tolist()
    return UserSplit(users[:train_end], users[train_end:validation_end], users[validation_end:])


def user_examples(ratings: Ratings, labels: np.ndarray | None = None) -> list[Examples]:
    """Each user's examples, newest first (the order a device's store hands them out)."""
    values = ratings.rating if labels is None else labels
    out = []
    for rows in ratings.by_user():
        newest_first = rows[np.argsort(-ratings.timestamp[rows], kind="stable")]
        out.append(Examples({ITEM: ratings.item[newest_first], LABEL: values[newest_first]}))
    return out


def _selected(examples: Examples, config: TaskConfig) -> Examples:
    return shuffled(examples.select(slice(None, config.max_examples)), PROTOCOL_SEED)


def support_query(examples: Examples, manifest: Manifest, config: TaskConfig) -> SupportQuery:
    """One user's batches as a device selects and splits them (capped, shuffled, alternating)."""
    support, query = split_support_query(_selected(examples, config), manifest, config)
    return SupportQuery(TaskBatches.pack(support, manifest), TaskBatches.pack(query, manifest))


def all_batches(examples: Examples, manifest: Manifest, config: TaskConfig) -> TaskBatches:
    """All of one user's selected examples in one call, for methods that train on everything."""
    batches = split_batches(_selected(examples, config), manifest.batch_size)
    if len(batches) > manifest.max_batches:
        raise ValueError(
            f"{len(batches)} batches do not fit a model that takes {manifest.max_batches} per call; "
            "export with max_batches >= max_examples / batch_size"
        )
    return TaskBatches.pack(batches, manifest)


def time_parts(examples: Examples, manifest: Manifest) -> tuple[Examples, Examples, Examples]:
    """Oldest 80% / next 10% / newest 10% of a user's examples (at least one of each when it has 3);
    `examples` newest first. Training: the newest of the oldest 80% that fit one call, in the
    device's shuffled order."""
    oldest_first = examples.select(slice(None, None, -1))
    n = oldest_first.num_examples
    held = max(1, round(n * 0.1)) if n >= 3 else 0
    train_end = n - 2 * held
    train = shuffled(
        oldest_first.select(slice(max(0, train_end - manifest.max_examples), train_end)), PROTOCOL_SEED
    )
    return train, oldest_first.select(slice(train_end, n - held)), oldest_first.select(slice(n - held, None))


def time_split(examples: Examples, manifest: Manifest) -> TimeSplit:
    """`time_parts` packed, one call each."""
    packed = [
        TaskBatches.pack(split_batches(part, manifest.batch_size)[: manifest.max_batches], manifest)
        for part in time_parts(examples, manifest)
    ]
    return TimeSplit(*packed)


def seen_support_query(examples: Examples, manifest: Manifest, config: TaskConfig) -> SupportQuery:
    """FedRecon's batches of a seen user's training part (`time_parts`): alternating support/query."""
    support, query = split_support_query(time_parts(examples, manifest)[0], manifest, config)
    return SupportQuery(TaskBatches.pack(support, manifest), TaskBatches.pack(query, manifest))


def pack_support_query(
    examples: Sequence[Examples], manifest: Manifest, config: TaskConfig
) -> list[SupportQuery]:
    return [support_query(e, manifest, config) for e in examples]
