"""Mixing centralized data into federated training (Augenstein et al., "Mixing centralized and
federated data"): the operator's choice of strategy and its parameters, and the wire format of
centralized examples.

The centralized data is public by definition (trending shares of public accounts, editorial
tags): the server holds it, and under `example_transfer` devices receive a few of its examples.
Nothing here ever carries a device's data.

Strategies (the paper's algorithms):
- `none`: plain federated training;
- `parallel_training` (Algorithm 2): each round the server trains a copy of the globals on the
  centralized data for `central_steps` steps and merges its delta with the federated one,
  `(1 - weight) * federated + weight * central` (MERGEOPT), before the server optimizer;
- `example_transfer` (Algorithm 3): each assignment carries `examples_per_assignment` centralized
  examples that the device mixes into its update steps only;
- `gradient_transfer` (Algorithm 4): each assignment carries the gradient of the centralized loss
  at the round's globals, which the device adds, times `weight`, to each update step; on the wire,
  a sparse delta (contracts.params) of the rows the centralized data touches.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from contracts.features import Examples, FeatureSpec, InvalidExamples
from contracts.manifest import Manifest
from contracts.params import ParamsError, SparseTensor, check_sparse_delta, decode_sparse_delta, row_shape

Strategy = Literal["none", "parallel_training", "example_transfer", "gradient_transfer"]
STRATEGIES: tuple[Strategy, ...] = ("none", "parallel_training", "example_transfer", "gradient_transfer")

# A centralized dataset is stored with its population and sampled per assignment: bounded so that
# attaching one cannot exhaust the server, and checked before it is parsed.
MAX_CENTRAL_BYTES = 32 << 20
MAX_CENTRAL_EXAMPLES = 1_000_000
# A safetensors header: a few hundred bytes per feature.
MAX_EXAMPLES_HEADER_BYTES = 64 * 1024
# J: a step costs about 1 ms on the server, and runs at every commit.
MAX_CENTRAL_STEPS = 10_000
MAX_LEARNING_RATE = 1_000.0
# gradient_transfer's weight multiplies a gradient, not a share of the update: a bound on sanity.
MAX_GRADIENT_WEIGHT = 100.0


class MixingError(ValueError):
    """A mixing configuration or centralized dataset the population cannot use; says what and why."""


@dataclass(frozen=True)
class MixingConfig:
    """A population's mixing strategy and its parameters (those of other strategies are ignored)."""

    strategy: Strategy = "none"
    # parallel_training: alpha in [0, 1]; gradient_transfer: the central gradient's weight.
    weight: float = 0.1
    central_steps: int = 10  # parallel_training: J
    central_learning_rate: float = 0.1  # parallel_training: the server's SGD rate on central data
    examples_per_assignment: int = 16  # example_transfer: sampled per assignment
    # parallel_training, gradient_transfer, for a dataset without group ids (GROUP_TENSOR): the
    # server's pseudo-users are runs of this many consecutive examples (each gets its own
    # reconstructed locals); None: as many as fit one call with their negatives
    # (orchestrator.populations.central_training.pseudo_user_capacity). Ignored when the dataset has group ids:
    # the groups are the pseudo-users.
    examples_per_pseudo_user: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        high = 1.0 if self.strategy != "gradient_transfer" else MAX_GRADIENT_WEIGHT
        if not _number(self.weight) or not 0.0 <= self.weight <= high:
            what = "alpha, the central delta's share" if high == 1.0 else "the central gradient's weight"
            problems.append(f"weight ({what}) must be a number in [0, {high:g}], got {self.weight!r}")
        if not _integer(self.central_steps) or not 1 <= self.central_steps <= MAX_CENTRAL_STEPS:
            problems.append(
                f"central_steps must be an integer in [1, {MAX_CENTRAL_STEPS}], got {self.central_steps!r}"
            )
        if not _number(self.central_learning_rate) or not 0 < self.central_learning_rate <= MAX_LEARNING_RATE:
            problems.append(
                f"central_learning_rate must be a number in (0, {MAX_LEARNING_RATE:g}], "
                f"got {self.central_learning_rate!r}"
            )
        if not _integer(self.examples_per_assignment) or self.examples_per_assignment < 1:
            problems.append(
                f"examples_per_assignment must be an integer >= 1, got {self.examples_per_assignment!r}"
            )
        if self.examples_per_pseudo_user is not None and (
            not _integer(self.examples_per_pseudo_user) or self.examples_per_pseudo_user < 1
        ):
            problems.append(
                "examples_per_pseudo_user must be an integer >= 1 or null (as many as fit one call), "
                f"got {self.examples_per_pseudo_user!r}"
            )
        if problems:
            raise MixingError("; ".join(problems))

    @classmethod
    def from_json(cls, data: Any) -> MixingConfig:
        if not isinstance(data, dict):
            raise MixingError(f"the mixing config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MixingError(f"unknown mixing settings {unknown}; expected some of {sorted(known)}")
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def check_model(self, manifest: Manifest, num_examples: int) -> None:
        """The strategy fits this model and dataset; a MixingError says why not."""
        if self.strategy == "none":
            return
        if num_examples < 1:
            raise MixingError(
                f"strategy {self.strategy!r} needs a centralized dataset of at least one example"
            )
        if self.strategy == "example_transfer" and self.examples_per_assignment > manifest.max_examples:
            raise MixingError(
                f"examples_per_assignment ({self.examples_per_assignment}) must be at most the examples one "
                f"update call takes ({manifest.max_examples} = max_batches x batch_size)"
            )
        if self.strategy == "gradient_transfer" and "gradient" not in manifest.signatures:
            raise MixingError(
                "gradient_transfer is not available for this model: it needs the export's `gradient` "
                f"signature (the model has {sorted(manifest.signatures)}); re-export the model with it"
            )


# ---- centralized examples on the wire and at rest ----------------------------------------


# The optional tensor of a centralized dataset that says which examples belong together (e.g. the
# public account that shared them), so that the server's pseudo-users are those groups
# (orchestrator.populations.central_training.groups_of). Not an identifier, so never a feature's name.
GROUP_TENSOR = "@group"
_GROUP_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True)
class CentralDataset:
    """A population's centralized examples and, when the operator gave them, their group ids."""

    examples: Examples
    groups: np.ndarray | None = None  # int64 [num_examples], >= 0: the source of each example

    def __post_init__(self) -> None:
        if self.groups is not None and self.groups.shape != (self.examples.num_examples,):
            raise ValueError(
                f"one group id per example expected ({self.examples.num_examples}), "
                f"got shape {list(self.groups.shape)}"
            )


def encode_examples(
    examples: Examples,
    features: tuple[FeatureSpec, ...] | list[FeatureSpec],
    groups: np.ndarray | None = None,
) -> bytes:
    """Examples as safetensors: one tensor per feature, named after it, first axis the example;
    with `groups`, also their group ids (GROUP_TENSOR, int64)."""
    # safetensors cannot write a tensor with a zero-sized axis (0.8); the metadata carries the count.
    count = {"num_examples": str(examples.num_examples)}
    tensors = {f.name: np.ascontiguousarray(examples[f.name], f.dtype) for f in features}
    if groups is not None:
        tensors[GROUP_TENSOR] = np.ascontiguousarray(groups, np.int64)
    if not examples.num_examples:
        return save({}, metadata=count)
    return save(tensors, metadata=count)


def decode_examples(
    blob: bytes, features: tuple[FeatureSpec, ...] | list[FeatureSpec], what: str, max_bytes: int
) -> Examples:
    """Safetensors examples checked against the feature spec (sizes before parsing); an
    InvalidExamples says what was wrong and what was expected."""
    tensors, meta = _load(blob, what, max_bytes)
    return _checked_examples(tensors, meta, features, what)


def decode_central(
    blob: bytes, features: tuple[FeatureSpec, ...] | list[FeatureSpec], what: str, max_bytes: int
) -> CentralDataset:
    """A centralized dataset: `decode_examples`'s examples, and the optional group ids
    (GROUP_TENSOR: int32 or int64, one per example, >= 0); an InvalidExamples says what was wrong."""
    tensors, meta = _load(blob, what, max_bytes)
    groups = tensors.pop(GROUP_TENSOR, None)
    examples = _checked_examples(tensors, meta, features, what)
    if groups is None:
        return CentralDataset(examples)
    expected = f"int32 or int64 of shape [{examples.num_examples}] (one id per example), each >= 0"
    if groups.dtype not in _GROUP_DTYPES:
        raise InvalidExamples(
            f"{what}: the group ids {GROUP_TENSOR!r} are {groups.dtype}; expected {expected}"
        )
    if groups.shape != (examples.num_examples,):
        raise InvalidExamples(
            f"{what}: the group ids {GROUP_TENSOR!r} have shape {list(groups.shape)}; expected {expected}"
        )
    if groups.size and int(groups.min()) < 0:
        raise InvalidExamples(
            f"{what}: the group ids {GROUP_TENSOR!r} include {int(groups.min())}; expected {expected}"
        )
    return CentralDataset(examples, groups.astype(np.int64))


def _load(blob: bytes, what: str, max_bytes: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A safetensors blob's tensors and metadata, its sizes checked before it is parsed."""
    if len(blob) > max_bytes:
        raise InvalidExamples(f"{what} is {len(blob)} bytes; the limit is {max_bytes}")
    if len(blob) < 8:
        raise InvalidExamples(f"{what} is not safetensors (shorter than its 8-byte header length)")
    header = int.from_bytes(blob[:8], "little")
    if header > min(MAX_EXAMPLES_HEADER_BYTES, len(blob) - 8):
        raise InvalidExamples(
            f"{what} has a safetensors header of {header} bytes; expected at most "
            f"{min(MAX_EXAMPLES_HEADER_BYTES, len(blob) - 8)}"
        )
    try:
        meta = json.loads(blob[8 : 8 + header]).get("__metadata__") or {}
        tensors = load(blob)
    except (SafetensorError, ValueError, TypeError, AttributeError) as e:
        raise InvalidExamples(f"{what} is not valid safetensors ({e})") from None
    return tensors, meta


def _checked_examples(
    tensors: dict[str, np.ndarray],
    meta: dict[str, Any],
    features: tuple[FeatureSpec, ...] | list[FeatureSpec],
    what: str,
) -> Examples:
    if not tensors:
        if meta.get("num_examples") != "0":
            raise InvalidExamples(
                f"{what} holds no tensors; expected one per feature {[f.name for f in features]}"
            )
        return Examples.empty(features)
    examples = Examples(tensors).validated(features)
    if examples.num_examples > MAX_CENTRAL_EXAMPLES:
        raise InvalidExamples(
            f"{what} holds {examples.num_examples} examples; the limit is {MAX_CENTRAL_EXAMPLES}"
        )
    return examples


def max_transfer_bytes(manifest: Manifest) -> int:
    """The largest example-transfer payload a device accepts: one update call's examples
    (max_batches x batch_size) of every feature, 4 bytes a value, and a header."""
    per_example = sum(4 * int(np.prod(f.shape, dtype=np.int64)) for f in manifest.features)
    return manifest.max_examples * per_example + 8 + MAX_EXAMPLES_HEADER_BYTES


def transferred_examples(blob: bytes, manifest: Manifest) -> Examples:
    """A device's reading of an assignment's centralized examples: bounded, in the model's
    feature spec, at most one update call's worth; InvalidExamples otherwise."""
    what = "the assignment's centralized examples"
    examples = decode_examples(blob, manifest.features, what, max_transfer_bytes(manifest))
    if examples.num_examples > manifest.max_examples:
        raise InvalidExamples(
            f"{what} are {examples.num_examples}; expected at most {manifest.max_examples} (one update call)"
        )
    return examples


def max_gradient_bytes(manifest: Manifest) -> int:
    """The largest central gradient a device accepts: every row of every global (a 4-byte row index
    and 4 bytes a value), and a header."""
    total = 0
    for spec in manifest.global_params:
        shape = row_shape(spec.shape)
        total += 4 * shape[0] + 4 * int(np.prod(shape, dtype=np.int64)) + 8 * len(spec.shape)
    return total + 8 + MAX_EXAMPLES_HEADER_BYTES


def transferred_gradient(blob: bytes, manifest: Manifest) -> dict[str, SparseTensor]:
    """A device's reading of an assignment's central gradient: bounded, one sparse tensor per
    global of the model with its shape (rows in range, strictly increasing), float32, finite;
    ParamsError otherwise."""
    what = "the assignment's central gradient"
    limit = max_gradient_bytes(manifest)
    if len(blob) > limit:
        raise ParamsError(f"{what} is {len(blob)} bytes; the limit for this model is {limit}")
    return check_sparse_delta(decode_sparse_delta(blob), manifest.global_params, what)


def sample_examples(examples: Examples, count: int, seed: bytes) -> Examples:
    """`count` examples (all when fewer) drawn without replacement, fixed by `seed` (e.g. an
    assignment id), so that a retried download gets the same ones."""
    rng = np.random.default_rng(int.from_bytes(seed[:16].ljust(16, b"\0"), "little"))
    n = examples.num_examples
    if n <= count:
        return examples
    return examples.select(np.sort(rng.choice(n, size=count, replace=False)))


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and bool(np.isfinite(x))


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
