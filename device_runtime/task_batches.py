"""Examples packed into the padded, weighted arrays that the training signatures take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contracts.manifest import Manifest


class InvalidExamples(ValueError):
    """Examples the model cannot train on: unknown items, NaN or out-of-range labels."""


@dataclass(frozen=True)
class Examples:
    """Column-wise examples: `item_ids[i]` was rated or shared with `labels[i]`."""

    item_ids: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if self.item_ids.ndim != 1 or self.labels.ndim != 1 or len(self.item_ids) != len(self.labels):
            raise InvalidExamples(
                f"item_ids and labels must be 1-D and of equal length, got shapes "
                f"{self.item_ids.shape} and {self.labels.shape}"
            )

    def __len__(self) -> int:
        return len(self.item_ids)

    def __getitem__(self, index: slice | np.ndarray) -> Examples:
        return Examples(self.item_ids[index], self.labels[index])

    @classmethod
    def concat(cls, parts: Sequence[Examples]) -> Examples:
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.float32))
        return cls(np.concatenate([p.item_ids for p in parts]), np.concatenate([p.labels for p in parts]))

    def validate(self, manifest: Manifest) -> None:
        """Raise `InvalidExamples` saying which example is wrong and what was expected."""
        bad_item = np.flatnonzero((self.item_ids < 0) | (self.item_ids >= manifest.num_items))
        if bad_item.size:
            i = int(bad_item[0])
            raise InvalidExamples(
                f"{bad_item.size} example(s) name items outside the catalog, e.g. item "
                f"{int(self.item_ids[i])}; expected ids in [0, {manifest.num_items})"
            )
        labels = self.labels.astype(np.float64)
        if not np.all(np.isfinite(labels)):
            raise InvalidExamples(
                f"{int(np.sum(~np.isfinite(labels)))} example(s) have NaN or infinite labels"
            )
        low, high = manifest.label_range
        out = np.flatnonzero((labels < low) | (labels > high))
        if out.size:
            raise InvalidExamples(
                f"{out.size} example(s) have labels outside [{low}, {high}], e.g. {labels[out[0]]}"
            )
        if manifest.feedback == "implicit" and not np.all((labels == 0) | (labels == 1)):
            raise InvalidExamples("implicit feedback labels must be 0 (not shared) or 1 (shared)")


def split_batches(examples: Examples, batch_size: int) -> list[Examples]:
    return [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]


@dataclass(frozen=True)
class TaskBatches:
    """Up to `max_batches` batches as the signatures want them (see `model_export.model`)."""

    item_ids: np.ndarray  # [max_examples] int32: the distinct items, then padding
    slots: np.ndarray  # [max_batches, batch_size] int32: index into item_ids per example
    labels: np.ndarray  # [max_batches, batch_size] float32
    weights: np.ndarray  # [max_batches, batch_size] float32: 1 real, 0 padding
    num_batches: int
    num_items: int  # distinct items actually used (the rest of item_ids is padding)

    @property
    def num_examples(self) -> int:
        return int(self.weights.sum())

    def inputs(self) -> dict[str, np.ndarray]:
        """The batch inputs of a training/evaluation signature (the global rows come from the model)."""
        return {
            "slots": self.slots,
            "labels": self.labels,
            "weights": self.weights,
            "num_batches": np.array(self.num_batches, np.int32),
        }

    @classmethod
    def pack(cls, batches: Sequence[Examples], manifest: Manifest) -> TaskBatches:
        """Pad each batch to `batch_size` and map items to slots; validates the examples."""
        b, s = manifest.batch_size, manifest.max_batches
        if len(batches) > s:
            raise InvalidExamples(f"{len(batches)} batches given; this model takes at most {s} per call")
        for batch in batches:
            if len(batch) > b:
                raise InvalidExamples(f"a batch has {len(batch)} examples; the model's batch size is {b}")
        flat = Examples.concat(list(batches))
        flat.validate(manifest)
        unique, inverse = np.unique(flat.item_ids, return_inverse=True)
        item_ids = np.zeros(manifest.max_examples, np.int32)
        item_ids[: unique.size] = unique
        slots = np.zeros((s, b), np.int32)
        labels = np.zeros((s, b), np.float32)
        weights = np.zeros((s, b), np.float32)
        start = 0
        for row, batch in enumerate(batches):
            n = len(batch)
            slots[row, :n] = inverse[start : start + n]
            labels[row, :n] = batch.labels
            weights[row, :n] = 1.0
            start += n
        return cls(item_ids, slots, labels, weights, len(batches), int(unique.size))
