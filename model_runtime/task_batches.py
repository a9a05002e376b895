"""Examples packed into the padded, weighted arrays that the training signatures take.

The layout is the manifest's (`contracts.manifest.Manifest.training_inputs`): per feature
`[max_batches, batch_size, *shape]`; a feature that indexes row-sparse globals becomes
*slots* into the task's rows of those globals (its distinct values, then padding), which
the model gathers from the globals; `weights` are 1 for an example and 0 for padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contracts.features import Examples, InvalidExamples
from contracts.manifest import NUM_BATCHES, WEIGHTS, Manifest


def split_batches(examples: Examples, batch_size: int) -> list[Examples]:
    n = examples.num_examples
    return [examples.select(slice(i, i + batch_size)) for i in range(0, n, batch_size)]


@dataclass(frozen=True)
class TaskBatches:
    """Up to `max_batches` batches as the signatures want them."""

    features: dict[str, np.ndarray]  # [max_batches, batch_size, *shape]; slots for row-sparse features
    rows: dict[str, np.ndarray]  # row-sparse feature -> [max_rows] int32: its distinct values, then padding
    num_rows: dict[str, int]  # row-sparse feature -> distinct values actually used
    weights: np.ndarray  # [max_batches, batch_size] float32: 1 real, 0 padding
    num_batches: int

    @property
    def num_examples(self) -> int:
        return int(self.weights.sum())

    def used_rows(self, feature: str) -> np.ndarray:
        """The distinct values of a row-sparse feature in these batches, increasing."""
        return self.rows[feature][: self.num_rows[feature]]

    def with_rows(self, extra: dict[str, np.ndarray], manifest: Manifest) -> TaskBatches:
        """These batches with each row-sparse feature's task rows widened to the union of its used
        rows and `extra[feature]` (e.g. the rows a central gradient touches, so that `update`
        trains them too); the examples' slots are renumbered, the examples are the same."""
        rows, num_rows, features = dict(self.rows), dict(self.num_rows), dict(self.features)
        for feature, wanted in extra.items():
            if feature not in self.rows:
                raise ValueError(
                    f"{feature!r} indexes no row-sparse global; row-sparse features: {sorted(self.rows)}"
                )
            used = self.used_rows(feature)
            union = np.union1d(used, np.asarray(wanted, np.int64)).astype(np.int32)
            limit = manifest.max_rows(feature)
            if union.size > limit:
                raise ValueError(
                    f"{union.size} task rows of {feature!r} ({used.size} used by the examples, the rest "
                    f"added); one call of the model takes at most {limit}"
                )
            # Each slot's row, then that row's slot in the union (padding slots stay in range).
            slot_rows = self.rows[feature][self.features[feature]]
            slots = np.minimum(np.searchsorted(union, slot_rows), limit - 1).astype(np.int32)
            padded = np.zeros(limit, np.int32)
            padded[: union.size] = union
            rows[feature], num_rows[feature], features[feature] = padded, int(union.size), slots
        return TaskBatches(features, rows, num_rows, self.weights, self.num_batches)

    def inputs(self) -> dict[str, np.ndarray]:
        """The batch inputs of a training/evaluation signature (the globals come from the model)."""
        return {**self.features, WEIGHTS: self.weights, NUM_BATCHES: np.array(self.num_batches, np.int32)}

    @classmethod
    def pack(cls, batches: Sequence[Examples], manifest: Manifest) -> TaskBatches:
        """Pad each batch to `batch_size` and map row-sparse features to slots; validates the examples."""
        b, s = manifest.batch_size, manifest.max_batches
        if len(batches) > s:
            raise InvalidExamples(f"{len(batches)} batches given; this model takes at most {s} per call")
        for batch in batches:
            if batch.num_examples > b:
                raise InvalidExamples(
                    f"a batch has {batch.num_examples} examples; the model's batch size is {b}"
                )
        flat = Examples.concat(list(batches), manifest.features).validated(manifest.features)
        counts = [batch.num_examples for batch in batches]
        # Where each example goes in the padded [max_batches, batch_size] grid.
        grid_rows = np.repeat(np.arange(len(counts)), counts)
        grid_cols = np.concatenate([np.arange(n) for n in counts]) if counts else np.zeros(0, np.int64)
        rows: dict[str, np.ndarray] = {}
        num_rows: dict[str, int] = {}
        features: dict[str, np.ndarray] = {}
        for feature in manifest.features:
            column = flat[feature.name]
            if feature.name in manifest.row_sparse_features:
                unique, column = np.unique(column, return_inverse=True)
                padded = np.zeros(manifest.max_rows(feature.name), np.int32)
                padded[: unique.size] = unique
                rows[feature.name], num_rows[feature.name] = padded, int(unique.size)
                column = column.reshape(flat[feature.name].shape)
            packed = np.zeros((s, b, *feature.shape), feature.dtype if feature.name not in rows else np.int32)
            packed[grid_rows, grid_cols] = column
            features[feature.name] = packed
        weights = np.zeros((s, b), np.float32)
        weights[grid_rows, grid_cols] = 1.0
        return cls(features, rows, num_rows, weights, len(batches))
