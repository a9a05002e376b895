"""How a task's examples become training: support and query batches, sampled negatives, step counts,
and reconstruction of the local parameters.

Shared by the device's client task and the server's training on centralized data (parallel
training), so that both treat examples the same way.
"""

from __future__ import annotations

import numpy as np

from contracts.features import Examples, per_example
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import SplitPolicy, TaskConfig
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import TFLiteModel


def shares(examples: Examples, manifest: Manifest) -> np.ndarray:
    """A ranking model with implicit labels: the distinct catalog rows with a positive label."""
    catalog, label = manifest.task.catalog_feature, manifest.label_features[0].name
    assert catalog is not None
    found: np.ndarray = np.unique(examples[catalog][examples[label] > 0])
    return found


def negative_weights(manifest: Manifest, config: TaskConfig, global_params: Params) -> np.ndarray | None:
    """How likely each catalog row is to be drawn as a negative: proportional to
    exp(negative_popularity x popularity), the popularity being the model's popularity global
    (e.g. item biases) in `global_params`; None: uniform (negative_popularity 0, or a model
    without a popularity global, which the server refuses a positive negative_popularity for).

    Uniform negatives are drawn about as often for an item nobody holds as for the most shared
    one, so an item known only from a few examples (e.g. centralized data) is pushed down every
    round by hundreds of devices; drawn by popularity, it is a negative about as often as it
    is a positive. Ranking adds negative_popularity x popularity back (`logq_correction`)."""
    name = manifest.task.popularity
    if not _by_popularity(manifest, config) or name is None or name not in global_params:
        return None
    logits = config.negative_popularity * np.asarray(global_params[name], np.float64).reshape(-1)
    if not np.all(np.isfinite(logits)):
        return None  # a diverged popularity: uniform rather than nothing
    weights = np.exp(logits - logits.max())  # no overflow whatever the biases
    total: np.ndarray = weights / weights.sum()
    return total


def logq_correction(manifest: Manifest, config: TaskConfig, global_params: Params) -> np.ndarray | None:
    """What ranking adds to each catalog row's logit when negatives were drawn by popularity: the
    log of its sampling weight, negative_popularity x popularity (the logQ correction). With
    sampled negatives a logistic model learns log(P(item | user) / q(item)) up to a constant,
    q being how often the item is drawn as a negative, so adding log q back ranks by P(item |
    user). None: nothing to add (uniform negatives)."""
    name = manifest.task.popularity
    if not _by_popularity(manifest, config) or name is None or name not in global_params:
        return None
    correction: np.ndarray = config.negative_popularity * np.asarray(global_params[name], np.float32)
    return correction.reshape(-1)


def not_negatives(config: TaskConfig, shared: np.ndarray | None = None) -> np.ndarray | None:
    """What a device never draws as a negative for its own shares: `shared` (e.g. all of its
    shares) and the task's `central_only_items`, which it could not have shared; None: nothing."""
    if not config.central_only_items:
        return shared
    central_only = np.asarray(config.central_only_items, np.int64)
    return central_only if shared is None else np.union1d(np.asarray(shared, np.int64), central_only)


def _by_popularity(manifest: Manifest, config: TaskConfig) -> bool:
    return manifest.task.negative_sampling and config.negative_popularity > 0


def add_negatives(
    examples: Examples,
    manifest: Manifest,
    per_positive: int,
    rng: np.random.Generator,
    also_shared: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> Examples:
    """A ranking model with implicit labels: each share gets `per_positive` catalog rows the user
    never shared, label 0 (never one of `examples`' shares nor of `also_shared`, e.g. shares
    outside the examples). `weights` (`negative_weights`): each row is drawn with probability
    proportional to its weight, with replacement (so that the probability is exactly the
    weight's, which the ranking's correction relies on); None: uniformly, without replacement.

    A model with context (e.g. the hour) ranks (item, context) pairs, so each share's negatives are
    in its context: "at 21h the user shared this, not those", those being any item not shared in
    that same context (an item shared only at 8h is a negative at 21h), nor in `also_shared`."""
    if manifest.context_features:
        return _add_negatives_in_context(examples, manifest, per_positive, rng, also_shared, weights)
    catalog, label = manifest.task.catalog_feature, manifest.label_features[0].name
    assert catalog is not None
    positives = shares(examples, manifest)
    count = len(positives) * per_positive
    shared = positives if also_shared is None else np.union1d(positives, also_shared)
    candidates = np.setdiff1d(np.arange(manifest.catalog_size), shared, assume_unique=True)
    if count == 0 or candidates.size == 0:
        return examples
    if weights is None:
        negatives = rng.choice(candidates, size=min(count, candidates.size), replace=False)
    else:
        negatives = rng.choice(candidates, size=count, replace=True, p=_normalized(weights[candidates]))
    sampled = Examples(
        {catalog: negatives.astype(examples[catalog].dtype), label: np.zeros(len(negatives), np.float32)}
    )
    mixed = Examples.concat([examples, sampled], manifest.features)
    return mixed.select(rng.permutation(mixed.num_examples))


def _add_negatives_in_context(
    examples: Examples,
    manifest: Manifest,
    per_positive: int,
    rng: np.random.Generator,
    also_shared: np.ndarray | None,
    weights: np.ndarray | None,
) -> Examples:
    catalog, label = manifest.task.catalog_feature, manifest.label_features[0].name
    assert catalog is not None
    context = manifest.context_features
    positive = np.flatnonzero(examples[label] > 0)
    if per_positive < 1 or positive.size == 0:
        return examples
    # Positive rows grouped by their context's values (one group per distinct context).
    keys = np.concatenate(
        [per_example(examples[f.name][positive]).astype(np.float64) for f in context], axis=1
    )
    _, group = np.unique(keys, axis=0, return_inverse=True)
    group = group.reshape(-1)
    never = np.zeros(0, np.int64) if also_shared is None else np.asarray(also_shared, np.int64)
    parts = [examples]
    for g in range(int(group.max()) + 1):
        rows = positive[group == g]
        shared = np.union1d(examples[catalog][rows], never)
        candidates = np.setdiff1d(np.arange(manifest.catalog_size), shared)
        if candidates.size == 0:
            continue
        count = rows.size * per_positive
        # An item may stand against several shares of a context when the catalog is short of them.
        if weights is None:
            negatives = rng.choice(candidates, size=count, replace=count > candidates.size)
        else:
            negatives = rng.choice(candidates, size=count, replace=True, p=_normalized(weights[candidates]))
        columns = {
            catalog: negatives.astype(examples[catalog].dtype),
            label: np.zeros(count, np.float32),
            **{f.name: np.repeat(examples[f.name][rows], per_positive, axis=0) for f in context},
        }
        parts.append(Examples(columns))
    mixed = Examples.concat(parts, manifest.features)
    return mixed.select(rng.permutation(mixed.num_examples))


def _normalized(weights: np.ndarray) -> np.ndarray:
    total = float(weights.sum())
    if not total > 0:  # every candidate's weight underflowed: uniform among them
        return np.full(weights.size, 1.0 / weights.size)
    normalized: np.ndarray = weights / total
    return normalized


def support_negatives(config: TaskConfig) -> int:
    """The sampled negatives per share that reconstruction fits the locals against."""
    if config.reconstruction_negatives is None:
        return config.negatives_per_positive
    return config.reconstruction_negatives


def with_support_negatives(
    support: list[Examples],
    manifest: Manifest,
    config: TaskConfig,
    rng: np.random.Generator,
    also_shared: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> list[Examples]:
    """The support batches with their shares' negatives drawn anew, `reconstruction_negatives` a
    share (never one of `also_shared`: give all of the device's shares), when the task sets it;
    otherwise unchanged (the support keeps the update's count)."""
    if config.reconstruction_negatives is None or not manifest.task.negative_sampling or not support:
        return support
    label = manifest.label_features[0].name
    joined = Examples.concat(support, manifest.features)
    positives = joined.select(joined[label] > 0)
    resampled = add_negatives(positives, manifest, config.reconstruction_negatives, rng, also_shared, weights)
    return split_batches(resampled, manifest.batch_size)[: manifest.max_batches]


def split_support_query(
    examples: Examples, manifest: Manifest, config: TaskConfig
) -> tuple[list[Examples], list[Examples]]:
    batches = split_batches(examples, manifest.batch_size)
    if not manifest.local_params:
        # Nothing to reconstruct (plain FedAvg): every example trains, or is measured.
        return [], batches[: manifest.max_batches]
    if config.split is SplitPolicy.REUSE or examples.num_examples < config.reuse_below or len(batches) < 2:
        # Too few to split: reuse everything for both sets, as the keyboard deployment did.
        return batches[: manifest.max_batches], batches[: manifest.max_batches]
    return batches[0::2][: manifest.max_batches], batches[1::2][: manifest.max_batches]


def num_steps(num_batches: int, max_epochs: int, max_steps: int) -> int:
    return min(max_steps, max_epochs * num_batches)


def reconstruct_locals(model: TFLiteModel, support: TaskBatches, config: TaskConfig) -> float | None:
    """Fresh local parameters fitted on the support batches, globals frozen; the mean batch loss
    (None for a model without local parameters: nothing to reconstruct)."""
    if not model.manifest.local_params:
        return None
    model.reset_local()
    steps = num_steps(support.num_batches, config.reconstruction_max_epochs, config.reconstruction_max_steps)
    return model.reconstruct(support, steps, config.reconstruction_learning_rate, config.l2_local)
