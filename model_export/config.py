"""Export-time configuration of the FedRecon matrix-factorization model.

Only the numbers that fix tensor shapes or the model's structure are baked into the
`.tflite`; learning rates, step counts and L2 strengths are signature inputs whose
defaults travel in the manifest, so a server can tune them without a new export.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from contracts.features import FeatureSpec
from contracts.task_config import TrainingDefaults

# The matrix-factorization model's features: the catalog item of an example and its label.
ITEM, LABEL = "item", "label"


class Feedback(enum.StrEnum):
    """What a label means, and therefore which loss the model trains."""

    EXPLICIT = "explicit"  # a rating; squared error
    IMPLICIT = "implicit"  # shared (1) or a sampled negative (0); logistic loss


@dataclass(frozen=True)
class ModelConfig:
    """Structure and static shapes of the exported model."""

    num_items: int = 1682
    embedding_dim: int = 50
    batch_size: int = 5
    max_batches: int = 64  # static bound on batches per signature call (pad with weight 0)
    top_k: int = 100  # static length of `infer`'s ranked output; callers slice it
    feedback: Feedback = Feedback.EXPLICIT
    item_bias: bool = False
    user_bias: bool = False
    global_mean: bool = False
    global_mean_init: float = 0.0
    rating_min: float = 1.0  # explicit feedback: labels outside [rating_min, rating_max] are refused
    rating_max: float = 5.0
    # Explicit feedback: 0 trains on squared error; > 0 on a Huber loss that equals the squared
    # error within +-huber_delta and grows linearly beyond, so a few surprising ratings pull
    # the parameters less (on MovieLens 100K: better RMSE and accuracy, README).
    huber_delta: float = 0.0
    init_stddev: float = 0.1  # item embeddings ~ N(0, init_stddev)
    # Explicit feedback: `evaluate` scores a prediction clipped to [rating_min, rating_max] (no
    # rating lies outside, so this can only lower the error); training and ranking are unchanged.
    clip_predictions: bool = False
    # Public catalog metadata: each item's group (e.g. its topic), or () for none. An item's
    # embedding then starts at its group's random unit direction times `group_init_scale` (plus
    # the N(0, init_stddev) noise), so an item few devices have shared starts beside its group's
    # and a user vector fitted to one share of a group already ranks the group's popular items.
    item_groups: tuple[int, ...] = ()
    group_init_scale: float = 0.5
    # With item_groups: a global embedding per group added to each of its items' embeddings
    # (`group_embeddings`, dense: every task trains it), and/or a global bias per group added to
    # each of its items' scores (`group_bias`). Every item's score then uses what all the
    # group's shares taught, so an item few devices shared ranks with its group's. The group
    # directions start `group_embeddings` instead of the items'.
    group_embeddings: bool = False
    group_bias: bool = False
    # The group tables' SGD step relative to the other globals' (device and server alike): a
    # group table is trained by every task, not diluted like a sparse row in the server's
    # mean, so the server step that makes up for that dilution overshoots it. Realized as
    # `value = sqrt(group_rate) * stored` (the stored table is what is trained and sent).
    group_rate: float = 1.0
    # Implicit feedback: > 0 starts the reconstruction's user vector at this times the mean of the
    # device's shared items' vectors (their embedding plus, with group_embeddings, their group's;
    # `history_start_groups`: their group's alone) instead of zeros, so each share weighs the same
    # in where it starts and the SGD steps refine it. 0: from zeros. `history_start_contrast`:
    # minus the mean of the support's sampled negatives' vectors.
    history_start: float = 0.0
    history_start_groups: bool = False
    history_start_contrast: bool = False
    seed: int = 0
    training: TrainingDefaults = field(default_factory=TrainingDefaults)

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_items", "embedding_dim", "batch_size", "max_batches", "top_k"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_items >= 1:  # a catalog below 1 is refused as such above
            problems.append(f"top_k ({self.top_k}) must not exceed num_items ({self.num_items})")
        if not self.rating_min < self.rating_max:
            problems.append(f"rating_min ({self.rating_min}) must be < rating_max ({self.rating_max})")
        if not (math.isfinite(self.huber_delta) and self.huber_delta >= 0):
            problems.append(f"huber_delta must be finite and >= 0, got {self.huber_delta}")
        elif self.huber_delta > 0 and self.feedback is Feedback.IMPLICIT:
            problems.append("huber_delta applies to explicit feedback only; implicit trains a logistic loss")
        if not isinstance(self.clip_predictions, bool):
            problems.append(f"clip_predictions must be true or false, got {self.clip_predictions!r}")
        elif self.clip_predictions and self.feedback is Feedback.IMPLICIT:
            problems.append("clip_predictions applies to explicit feedback only; implicit scores are logits")
        if self.init_stddev < 0:
            problems.append(f"init_stddev must be >= 0, got {self.init_stddev}")
        if self.item_groups and len(self.item_groups) != self.num_items:
            problems.append(
                f"item_groups must give one group per item ({self.num_items}), got {len(self.item_groups)}"
            )
        if any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in self.item_groups):
            problems.append("item_groups must be integers >= 0 (each item's group)")
        for name in ("group_embeddings", "group_bias"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                problems.append(f"{name} must be true or false, got {value!r}")
            elif value and not self.item_groups:
                problems.append(f"{name} needs item_groups (each item's group)")
        if not (math.isfinite(self.group_rate) and self.group_rate > 0):
            problems.append(f"group_rate must be finite and > 0, got {self.group_rate}")
        if not (math.isfinite(self.group_init_scale) and self.group_init_scale >= 0):
            problems.append(f"group_init_scale must be finite and >= 0, got {self.group_init_scale}")
        if not (math.isfinite(self.history_start) and self.history_start >= 0):
            problems.append(f"history_start must be finite and >= 0, got {self.history_start}")
        elif self.history_start > 0 and self.feedback is not Feedback.IMPLICIT:
            problems.append("history_start applies to implicit feedback only (the mean of the shared items)")
        if not isinstance(self.history_start_groups, bool):
            problems.append(f"history_start_groups must be true or false, got {self.history_start_groups!r}")
        elif self.history_start_groups and not (self.group_embeddings and self.history_start > 0):
            problems.append("history_start_groups needs group_embeddings and history_start > 0")
        if not isinstance(self.history_start_contrast, bool):
            problems.append(
                f"history_start_contrast must be true or false, got {self.history_start_contrast!r}"
            )
        elif self.history_start_contrast and not self.history_start > 0:
            problems.append("history_start_contrast needs history_start > 0")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def num_groups(self) -> int:
        """Rows of the group tables: the largest group + 1 (0 without item_groups)."""
        return max(self.item_groups) + 1 if self.item_groups else 0

    @property
    def max_examples(self) -> int:
        """Examples one signature call can see: `max_batches * batch_size`."""
        return self.max_batches * self.batch_size

    @property
    def label_range(self) -> tuple[float, float]:
        if self.feedback is Feedback.IMPLICIT:
            return (0.0, 1.0)
        return (self.rating_min, self.rating_max)

    def features(self) -> tuple[FeatureSpec, FeatureSpec]:
        """An example: the catalog item (indexing the item tables) and its label."""
        low, high = self.label_range
        return (
            FeatureSpec(
                ITEM,
                "int32",
                value_range=(0, self.num_items - 1),
                tables=("item_embeddings", "item_bias") if self.item_bias else ("item_embeddings",),
            ),
            FeatureSpec(
                LABEL,
                "float32",
                role="label",
                value_range=(low, high),
                discrete=self.feedback is Feedback.IMPLICIT,
            ),
        )

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        data["feedback"] = self.feedback.value
        data["item_groups"] = list(self.item_groups)  # as JSON reads it back
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_json`; unknown keys are an error, so a typo cannot go unnoticed."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config fields {sorted(unknown)}; known: {sorted(known)}")
        values = dict(data)
        if "feedback" in values:
            values["feedback"] = Feedback(values["feedback"])
        if "item_groups" in values:
            if not isinstance(values["item_groups"], list | tuple):
                raise ValueError("'item_groups' must be a list of integers (each item's group)")
            values["item_groups"] = tuple(values["item_groups"])
        if "training" in values:
            training = values["training"]
            known_t = {f.name for f in fields(TrainingDefaults)}
            if not isinstance(training, dict) or set(training) - known_t:
                raise ValueError(f"'training' must be an object with fields from {sorted(known_t)}")
            values["training"] = TrainingDefaults(**training)
        return cls(**values)
