"""The examples a device's task trains on: selected from its store, shuffled, split, with negatives.

What a task reads (the newest `max_examples` examples the model can take), how it orders them
(the protocol's per-user shuffle), and how FedRecon splits them into support and query; implicit
labels add sampled negatives. Example transfer mixes the server's centralized examples into the
query (`with_central`); a stateful (FURL) device holds out its newest examples for StandardEval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contracts.features import Examples, per_example
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from device_runtime.task_environment import ExampleSource, Selection
from model_runtime.support_query import (
    add_negatives,
    negative_weights,
    not_negatives,
    shares,
    split_support_query,
    with_support_negatives,
)
from model_runtime.task_batches import TaskBatches, split_batches


@dataclass(frozen=True)
class SupportQuery:
    support: list[Examples]
    query: list[Examples]
    num_examples: int
    outside_catalog: int


def within_model(examples: Examples, manifest: Manifest) -> np.ndarray:
    """Which examples the model can take: every indexing feature within its tables' rows.

    A store may hold values the model does not know yet (e.g. expressions newer than the model).
    """
    keep = np.ones(examples.num_examples, bool)
    for feature in manifest.features:
        if feature.tables and feature.value_range is not None:
            values = per_example(examples[feature.name])
            low, high = feature.value_range
            keep &= np.all((values >= low) & (values <= high), axis=1)
    return keep


def newest_examples(store: ExampleSource, manifest: Manifest, config: TaskConfig) -> tuple[Examples, int]:
    """The newest `max_examples` examples, newest first, without those outside the model's tables
    (left out and counted, rather than failing the task)."""
    examples = store.examples(Selection(limit=config.max_examples))
    known = within_model(examples, manifest)
    return examples.select(known), int(examples.num_examples - known.sum())


def select_examples(store: ExampleSource, manifest: Manifest, config: TaskConfig) -> tuple[Examples, int]:
    """The task's examples (newest `max_examples`, optionally shuffled); drops unknown values."""
    examples, outside = newest_examples(store, manifest, config)
    if config.shuffle_seed is not None:
        examples = shuffled(examples, config.shuffle_seed)
    return examples, outside


# A stateful device's StandardEval examples: the newest tenth of what its task selects.
HOLDOUT_FRACTION = 0.1


def hold_out_newest(newest_first: Examples) -> tuple[Examples, Examples]:
    """(training, held out): the newest `HOLDOUT_FRACTION` held out, at least one example when there
    are two or more, so a stateful device is measured on examples its kept locals never trained on."""
    n = newest_first.num_examples
    held = max(1, round(n * HOLDOUT_FRACTION)) if n >= 2 else 0
    return newest_first.select(slice(held, None)), newest_first.select(slice(None, held))


def shuffled(examples: Examples, seed: int) -> Examples:
    """The examples in an order fixed by `seed` (the protocol's per-user shuffle)."""
    return examples.select(np.random.default_rng(seed).permutation(examples.num_examples))


def with_central(
    query: list[Examples],
    central: Examples,
    manifest: Manifest,
    config: TaskConfig,
    seed: int,
    weights: np.ndarray | None = None,
) -> list[Examples]:
    """Example transfer (Algorithm 3 of Augenstein et al.): the query batches with the centralized
    examples mixed in, shuffled, as many as fit one update call next to the device's own, and at
    least half of the call (the device's own examples beyond the rest sit out this update). Only
    the update sees them: they are not in the store, not in the support set, and not in the
    reported weight. Under FedRecon they train the globals with this
    device's reconstructed locals, as its own examples do. Implicit labels: they get sampled
    negatives as the device's shares do (drawn by `weights`, `negative_weights`), never among the
    device's own shares."""
    own = Examples.concat(query, manifest.features)
    rng = np.random.default_rng(seed + 1)
    negatives = config.negatives_per_positive if manifest.task.negative_sampling else 0
    # The room left by the device's own examples, and at least half of the call: a device whose
    # own examples fill the call (a third of MovieLens' devices) would otherwise mix in none.
    free = max(0, manifest.max_examples - own.num_examples)
    room = max(free, manifest.max_examples // 2) // (1 + negatives)
    taken = central.select(rng.permutation(central.num_examples)[:room])
    if negatives:
        taken = add_negatives(taken, manifest, negatives, rng, shares(own, manifest), weights)
    # The device's own examples (shuffled) beyond what the call takes next to them: dropped, as
    # split_support_query drops those beyond one call.
    own = own.select(slice(None, manifest.max_examples - taken.num_examples))
    mixed = Examples.concat([own, taken.validated(manifest.features)], manifest.features)
    return split_batches(mixed.select(rng.permutation(mixed.num_examples)), manifest.batch_size)


def prepare(
    store: ExampleSource, manifest: Manifest, config: TaskConfig, seed: int, weights: np.ndarray | None = None
) -> SupportQuery:
    """The task's examples split into support and query; implicit labels add sampled negatives,
    drawn by `weights` (`negative_weights`; None: uniformly)."""
    examples, outside = select_examples(store, manifest, config)
    num_examples = examples.num_examples
    rng = np.random.default_rng(seed)
    own = shares(examples, manifest) if manifest.task.negative_sampling else None
    if manifest.task.negative_sampling and config.negatives_per_positive:
        examples = add_negatives(
            examples, manifest, config.negatives_per_positive, rng, not_negatives(config), weights
        )
    support, query = split_support_query(examples, manifest, config)
    support = with_support_negatives(support, manifest, config, rng, not_negatives(config, own), weights)
    return SupportQuery(support, query, num_examples, outside)


def one_call(
    examples: Examples,
    manifest: Manifest,
    config: TaskConfig,
    seed: int,
    global_params: Params,
    shared: np.ndarray | None = None,
) -> TaskBatches:
    """The examples as one call's batches (FURL's training, validation and held-out examples);
    implicit labels add sampled negatives (drawn as `negative_weights` says for these globals),
    never among `shared`."""
    if manifest.task.negative_sampling and config.negatives_per_positive:
        examples = add_negatives(
            examples,
            manifest,
            config.negatives_per_positive,
            np.random.default_rng(seed),
            not_negatives(config, shared),
            negative_weights(manifest, config, global_params),
        )
    return TaskBatches.pack(split_batches(examples, manifest.batch_size)[: manifest.max_batches], manifest)
