"""Aggregation of client deltas and the server optimizer: pure functions, numpy only.

No HTTP, no database, no I/O: the round logic hands deltas and weights in and gets parameters back,
so all of this is testable with hand-computed numbers.

- Sparse deltas (`model_export.params.SparseTensor`): a client trains only the item rows it has
  examples for (about 150 of 20,000), so its delta travels and is stored as those rows.
- `WeightedMean`: a streaming weighted mean of deltas, memory O(model) however many clients report.
- Server optimizers, "generalized FedAvg" (Reddi et al. 2021, "Adaptive Federated Optimization",
  Algorithm 2): the mean delta is a negative pseudo-gradient fed to SGD, SGD with momentum, Adam or Yogi.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from model_export.params import Params, SparseTensor, row_shape


def _describe_mismatch(
    what: str, got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> str | None:
    """What differs between two name -> shape maps, or None when they agree."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        return (
            f"{what}: expected tensors {sorted(expected)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    wrong = [
        f"{name} has shape {got[name]}, expected {expected[name]}"
        for name in sorted(expected)
        if tuple(got[name]) != tuple(expected[name])
    ]
    if wrong:
        return f"{what}: " + "; ".join(wrong)
    return None


def _check_shapes(
    what: str, got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> None:
    problem = _describe_mismatch(what, got, expected)
    if problem is not None:
        raise ValueError(problem)


def _shapes(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(np.shape(value)) for name, value in tensors.items()}


# ---------------------------------------------------------------------------------------------------------
# Streaming weighted mean


class WeightedMean:
    """Weighted mean of client deltas, added one at a time.

    Memory is O(model), never O(clients x model): only a running float64 weighted sum per tensor and
    the total weight are kept; each delta can be dropped once added. float64 so that summing many
    small float32 contributions does not lose precision.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = {name: tuple(int(n) for n in shape) for name, shape in shapes.items()}
        # Kept in row form (a 0-D tensor as shape (1,)) so dense and sparse adds index the same way.
        self._sums = {
            name: np.zeros(row_shape(shape), dtype=np.float64) for name, shape in self._shapes.items()
        }
        self._scratch = {name: np.empty_like(total) for name, total in self._sums.items()}
        self._total_weight = 0.0
        self._count = 0

    @property
    def total_weight(self) -> float:
        return self._total_weight

    @property
    def count(self) -> int:
        """Number of deltas added."""
        return self._count

    def _check(self, what: str, shapes: Mapping[str, tuple[int, ...]], weight: float) -> None:
        # Everything is checked before anything is accumulated, so a refused delta leaves no trace.
        # numbers.Real admits numpy scalars (an example count may well be an np.int64); bool is refused.
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ValueError(f"{what}: weight must be a finite number > 0, got {weight!r}")
        _check_shapes(what, shapes, self._shapes)

    def add(self, delta: Mapping[str, np.ndarray], weight: float) -> None:
        """Add a dense delta with the given weight (e.g. the client's number of examples)."""
        self._check("delta", _shapes(delta), weight)
        for name, value in delta.items():
            total, scratch = self._sums[name], self._scratch[name]
            # Into a buffer kept for the purpose: a fresh 1.5 MB temporary per add is mapped and
            # page-faulted in by the allocator every time, which made adds ~10x slower.
            np.multiply(np.reshape(value, total.shape), float(weight), out=scratch, dtype=np.float64)
            total += scratch
        self._total_weight += float(weight)
        self._count += 1

    def add_sparse(self, delta: Mapping[str, SparseTensor], weight: float) -> None:
        """Add a sparse delta: only its stored rows are touched, the rest are zero."""
        self._check("sparse delta", {name: t.shape for name, t in delta.items()}, weight)
        for name, tensor in delta.items():
            # Rows are unique (SparseTensor checks it), so fancy-index += adds each row exactly once.
            self._sums[name][tensor.rows] += float(weight) * tensor.values.astype(np.float64)
        self._total_weight += float(weight)
        self._count += 1

    def weighted_sum(self) -> Params:
        """The weighted sum so far, float64, in the template's shapes (DP-FedAvg noises the sum)."""
        return {name: total.reshape(self._shapes[name]).copy() for name, total in self._sums.items()}

    def mean(self) -> Params:
        """The weighted mean, float32, in the template's shapes."""
        if self._count == 0 or self._total_weight <= 0:
            raise ValueError("weighted mean of no deltas: add at least one delta with a weight > 0 first")
        return {
            name: (total / self._total_weight).reshape(self._shapes[name]).astype(np.float32)
            for name, total in self._sums.items()
        }


# ---------------------------------------------------------------------------------------------------------
# Server optimizers

SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi")


@dataclass(frozen=True)
class ServerOptimizerConfig:
    """The server optimizer of a population and its hyperparameters (Reddi et al. 2021, Algorithm 2)."""

    name: str  # one of SERVER_OPTIMIZERS
    learning_rate: float = 1.0  # sgd with 1.0 is plain FedAvg: the new model is the mean client model
    momentum: float = 0.9  # beta of sgd with momentum
    beta1: float = 0.9  # adam, yogi: decay of the first moment
    beta2: float = 0.99  # adam, yogi: decay of the second moment
    tau: float = 1e-3  # adam, yogi: adaptivity (epsilon); the second moment starts at tau**2

    def __post_init__(self) -> None:
        if self.name not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.name!r}; known: {list(SERVER_OPTIMIZERS)}")
        bounds = {
            "learning_rate": "> 0",
            "momentum": "in [0, 1)",
            "beta1": "in [0, 1)",
            "beta2": "in [0, 1)",
            "tau": "> 0",
        }
        for field_name, allowed in bounds.items():
            value = getattr(self, field_name)
            # bool is an int in Python; `true` in a JSON config is a mistake, not 1.0.
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(
                    f"server optimizer {field_name} must be a finite number {allowed}, got {value!r}"
                )
            in_range = value > 0 if allowed == "> 0" else 0 <= value < 1
            if not in_range:
                raise ValueError(f"server optimizer {field_name} must be {allowed}, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerOptimizerConfig:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown server optimizer fields {unknown}; known: {known}")
        if "name" not in data:
            raise ValueError(f"server optimizer config needs a 'name', one of {list(SERVER_OPTIMIZERS)}")
        return cls(**data)


def _state_shapes(
    config: ServerOptimizerConfig, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the optimizer state for parameters of the given shapes."""
    if config.name == "sgd":
        return {}
    prefixes = ("momentum",) if config.name == "momentum" else ("m", "v")
    return {f"{prefix}/{name}": shape for prefix in prefixes for name, shape in shapes.items()}


def init_state(config: ServerOptimizerConfig, params: Params) -> Params:
    """The optimizer state before the first round, as named float32 arrays (stored like parameters).

    sgd: none. momentum: "momentum/<name>" zeros. adam, yogi: "m/<name>" zeros and "v/<name>" filled
    with tau**2, the paper's initial second moment.
    """
    state: Params = {}
    for key, shape in _state_shapes(config, _shapes(params)).items():
        fill = config.tau**2 if key.startswith("v/") else 0.0
        state[key] = np.full(shape, fill, dtype=np.float32)
    return state


def apply_update(
    config: ServerOptimizerConfig, params: Params, mean_delta: Params, state: Params
) -> tuple[Params, Params]:
    """One server step: (new params, new state). The inputs are not modified.

    `mean_delta` is the weighted mean of `x_client - x_server`, a negative pseudo-gradient, so every
    optimizer moves the parameters along +delta. No bias correction, as in the paper. Computed in
    float64, returned as float32.
    """
    shapes = _shapes(params)
    _check_shapes("mean delta", _shapes(mean_delta), shapes)
    _check_shapes(f"{config.name} optimizer state", _shapes(state), _state_shapes(config, shapes))
    lr = config.learning_rate
    new_params: Params = {}
    new_state: Params = {}
    for name in params:
        x = np.asarray(params[name], dtype=np.float64)
        d = np.asarray(mean_delta[name], dtype=np.float64)
        if config.name == "sgd":
            x = x + lr * d
        elif config.name == "momentum":
            m = config.momentum * np.asarray(state[f"momentum/{name}"], dtype=np.float64) + d
            x = x + lr * m
            new_state[f"momentum/{name}"] = m.astype(np.float32)
        elif config.name in ("adam", "yogi"):
            m = np.asarray(state[f"m/{name}"], dtype=np.float64)
            v = np.asarray(state[f"v/{name}"], dtype=np.float64)
            m = config.beta1 * m + (1 - config.beta1) * d
            d2 = d * d
            if config.name == "adam":
                v = config.beta2 * v + (1 - config.beta2) * d2
            else:
                # Yogi moves v towards d^2 by (1-b2)*d^2 whatever v is, instead of Adam's (1-b2)*(v-d^2):
                # when deltas get small, v shrinks more slowly, so the effective step does not blow up.
                v = v - (1 - config.beta2) * d2 * np.sign(v - d2)
            x = x + lr * m / (np.sqrt(v) + config.tau)
            new_state[f"m/{name}"] = m.astype(np.float32)
            new_state[f"v/{name}"] = v.astype(np.float32)
        else:  # unreachable: the config checks the name
            raise ValueError(f"unknown server optimizer {config.name!r}; known: {list(SERVER_OPTIMIZERS)}")
        new_params[name] = x.astype(np.float32)
    return new_params, new_state
