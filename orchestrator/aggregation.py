"""Aggregation of client deltas and the server optimizer: pure functions, numpy only.

No HTTP, no database, no I/O: the round logic hands deltas and weights in and gets parameters back,
so all of this is testable with hand-computed numbers.

- Sparse deltas (`contracts.params.SparseTensor`): a client trains only the item rows it has
  examples for (about 150 of 20,000), so its delta travels and is stored as those rows.
- `WeightedMean`: a streaming weighted mean of deltas, memory O(model) however many clients report.
- Robust aggregation (`RobustAggregation`, `plan_round`, `clip_by_norm`, `robust_mean`): what
  keeps a few hostile devices from moving the model: each report's delta is clipped per tensor to
  a multiple of a reference norm learnt from earlier rounds, one device's weight is capped at a
  multiple of the round's median, and optionally the mean is replaced by a coordinate-wise
  trimmed mean or median.
- Server optimizers, "generalized FedAvg" (Reddi et al. 2021, "Adaptive Federated Optimization",
  Algorithm 2): the mean delta is a negative pseudo-gradient fed to SGD, SGD with momentum, Adam or Yogi.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from contracts.params import Params, SparseTensor, row_shape
from orchestrator.aggregation.norm_reference import (
    HISTORY_ROUNDS,
    ROUND_GROWTH,
    WINDOW_GROWTH,
    WINDOW_ROUNDS,
    NormReference,
    NormRule,
    next_reference,
)
from orchestrator.setting_ranges import Range, check


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


def _touched_rows(total: np.ndarray) -> np.ndarray:
    """The rows of a sum in row form that are not all zero (an untouched row adds nothing)."""
    return np.flatnonzero(np.any(total != 0, axis=tuple(range(1, total.ndim))))


# ---------------------------------------------------------------------------------------------------------
# Streaming weighted mean


@dataclass(frozen=True, eq=False)  # eq=False: comparing numpy arrays with == is not a bool
class PartialSum:
    """Part of a round's weighted sum, added up where its deltas were made (a simulation worker's
    shard of the round): per tensor (`shapes`), the rows its deltas touched (`rows`, increasing)
    and their float64 weighted sums (`sums`, in row form), the weights' total and how many deltas
    it holds. Only touched rows travel, so a partial of one sparse delta is about that delta's size.
    Adding partials gives the round's sum up to float64 summation order."""

    shapes: Mapping[str, tuple[int, ...]]
    rows: Mapping[str, np.ndarray]
    sums: Mapping[str, np.ndarray]
    total_weight: float
    count: int

    @property
    def nbytes(self) -> int:
        return sum(int(self.rows[name].nbytes + self.sums[name].nbytes) for name in self.sums)


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
            total = self._sums[name]
            if len(tensor.rows) == len(total):  # every row (they are strictly increasing): as `add`
                scratch = self._scratch[name]
                np.multiply(tensor.values, float(weight), out=scratch, dtype=np.float64)
                total += scratch
            else:
                # Rows are unique (SparseTensor checks it), so fancy-index += adds each row exactly once.
                total[tensor.rows] += float(weight) * tensor.values.astype(np.float64)
        self._total_weight += float(weight)
        self._count += 1

    def partial(self) -> PartialSum:
        """What was added so far, to be added to another `WeightedMean` (`add_partial`)."""
        rows = {name: _touched_rows(total) for name, total in self._sums.items()}
        return PartialSum(
            dict(self._shapes),
            rows,
            {name: total[rows[name]] for name, total in self._sums.items()},
            self._total_weight,
            self._count,
        )

    def add_partial(self, part: PartialSum) -> None:
        """Add another mean's deltas at once, as if each had been added here. Everything is
        checked before anything is added."""
        if part.count < 1 or not math.isfinite(part.total_weight) or part.total_weight <= 0:
            raise ValueError(
                f"partial sum: expected at least one delta and a total weight > 0, got {part.count} "
                f"deltas weighing {part.total_weight!r}"
            )
        _check_shapes("partial sum", part.shapes, self._shapes)
        for name, total in self._sums.items():
            rows, sums = np.asarray(part.rows[name]), np.asarray(part.sums[name])
            if (
                rows.ndim != 1
                or sums.shape != (len(rows), *total.shape[1:])
                or (len(rows) and (rows.min() < 0 or rows.max() >= len(total) or np.any(np.diff(rows) <= 0)))
            ):
                raise ValueError(
                    f"partial sum: {name} must hold increasing rows of 0..{len(total) - 1} and their "
                    f"sums of shape (rows, {', '.join(map(str, total.shape[1:]))}), got {len(rows)} rows "
                    f"and sums of shape {sums.shape}"
                )
        for name, total in self._sums.items():
            total[part.rows[name]] += part.sums[name]
        self._total_weight += part.total_weight
        self._count += part.count

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
# Robust aggregation

ROBUST_METHODS = ("none", "trimmed_mean", "median")


@dataclass(frozen=True)
class RobustAggregation:
    """How a round's reports are combined so that hostile devices cannot move the model far.

    - Clipping: each report's delta is scaled down, tensor by tensor, to at most
      `norm_clip_multiple` x the tensor's reference norm. The reference is learnt from the honest
      rounds before (`plan_round`), not fixed: a fixed bound is either loose enough for any model
      (1000, which let ten devices move a global mean from 3.5 to 1002.5) or wrong for most.
    - Weights: a device's weight (its example count, already at most what it checked in with and
      the task's max_examples) is capped at `max_weight_multiple` x the round's median weight.
    - `method`: "none" is the weighted mean (FedAvg) of the clipped deltas; "trimmed_mean" and
      "median" replace it per coordinate (Yin et al., ICML 2018), over the reports that changed
      that row, scaled by their share of the round's weight (as the weighted mean scales a row
      that few reports changed).
    """

    method: str = "none"
    trim_fraction: float = 0.1  # trimmed_mean: this fraction of the values dropped at each end
    norm_clip_multiple: float = 3.0
    max_weight_multiple: float = 5.0
    # How the reference norm may move (orchestrator.aggregation.norm_reference): at most this factor a
    # round, at most `reference_window_growth` over any `reference_window_rounds` rounds, and
    # never above the median of the last `reference_history_rounds` rounds' observations.
    reference_growth: float = ROUND_GROWTH
    reference_history_rounds: int = HISTORY_ROUNDS
    reference_window_rounds: int = WINDOW_ROUNDS
    reference_window_growth: float = WINDOW_GROWTH

    def __post_init__(self) -> None:
        if self.method not in ROBUST_METHODS:
            raise ValueError(f"unknown robust aggregation {self.method!r}; known: {list(ROBUST_METHODS)}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        for name in (
            "norm_clip_multiple",
            "max_weight_multiple",
            "reference_growth",
            "reference_window_growth",
        ):
            if not 1 <= getattr(self, name) <= 1e6:
                raise ValueError(f"{name} must be in [1, 1e6], got {getattr(self, name)}")
        _ = self.norm_rule  # checks the history and the window

    @functools.cached_property
    def norm_rule(self) -> NormRule:
        """Built once per rule (a population's is built once per settings version), not per round."""
        return NormRule(
            history_rounds=self.reference_history_rounds,
            window_rounds=self.reference_window_rounds,
            window_growth=self.reference_window_growth,
            round_growth=self.reference_growth,
        )


def tensor_norms(delta: Mapping[str, SparseTensor]) -> dict[str, float]:
    """The L2 norm of each tensor of a sparse delta (absent rows are zero), summed in float64."""
    return {name: _norm(t.values) for name, t in delta.items()}


def _norm(values: np.ndarray) -> float:
    # einsum sums the float64 squares without a float64 copy of the values (np.linalg.norm of
    # values.astype(float64) made one, and its BLAS call was most of a dense delta's clipping).
    flat = values.reshape(-1)
    return math.sqrt(float(np.einsum("i,i->", flat, flat, dtype=np.float64)))


def cap_weights(weights: Sequence[float], multiple: float) -> list[float]:
    """Each weight, at most `multiple` x the median weight."""
    cap = multiple * float(np.median(weights)) if len(weights) else 0.0
    return [min(float(w), cap) for w in weights]


@dataclass(frozen=True)
class RoundPlan:
    """What `plan_round` decided for one round's reports."""

    weights: list[float]  # capped, in the reports' order
    bounds: dict[str, float]  # per tensor, the norm each report's delta is clipped to
    next_reference: NormReference  # per tensor, the reference norm for the next round, and its history


def plan_round(
    weights: Sequence[float],
    norms: Sequence[Mapping[str, float]],
    reference: NormReference | Mapping[str, float] | None,
    rule: RobustAggregation,
) -> RoundPlan:
    """Capped weights and per-tensor clipping bounds for a round's reports, and the next reference.

    This round's bound is `norm_clip_multiple` x the reference the previous round left
    (`reference`); a population's first round, which has none, uses its own median norm. The
    next reference follows the rounds' median norms under the limits of
    orchestrator.aggregation.norm_reference, so that hostile rounds cannot ratchet it up.
    """
    names = sorted({name for n in norms for name in n})
    medians: dict[str, float] = {}
    for name in names:
        touched = [n[name] for n in norms if n.get(name, 0.0) > 0]
        medians[name] = float(np.median(touched)) if touched else 0.0
    state = NormReference.of(reference)
    known = state.reference if state else {}
    used = {name: known[name] if known.get(name, 0.0) > 0 else medians[name] for name in names}
    return RoundPlan(
        weights=cap_weights(weights, rule.max_weight_multiple),
        bounds={name: rule.norm_clip_multiple * used[name] for name in names},
        next_reference=next_reference(state, used, medians, rule.norm_clip_multiple, rule.norm_rule),
    )


def known_bounds(
    reference: NormReference | Mapping[str, float] | None, names: Iterable[str], rule: RobustAggregation
) -> dict[str, float] | None:
    """The clipping bounds `plan_round` will set for tensors `names`, when the reference fixes
    them all (a norm > 0 for each) so that a round's reports can be clipped as they are read;
    None when some bound depends on the round's own norms."""
    state = NormReference.of(reference)
    known = state.reference if state else {}
    if not all(known.get(name, 0.0) > 0 for name in names):
        return None
    return {name: rule.norm_clip_multiple * known[name] for name in names}


def clip_by_norm(
    delta: Mapping[str, SparseTensor],
    bounds: Mapping[str, float],
    norms: Mapping[str, float] | None = None,
) -> dict[str, SparseTensor]:
    """Each tensor scaled down to L2 norm at most its bound (tensors within it are unchanged);
    `norms`: the tensors' norms (`tensor_norms`), when the caller has them already."""
    clipped: dict[str, SparseTensor] = {}
    for name, tensor in delta.items():
        norm = norms[name] if norms is not None else _norm(tensor.values)
        bound = bounds.get(name, 0.0)
        if norm <= bound:
            clipped[name] = tensor
        else:
            values = (tensor.values.astype(np.float64) * (bound / norm)).astype(np.float32)
            clipped[name] = SparseTensor(tensor.shape, tensor.rows, values)
    return clipped


def robust_mean(
    deltas: Sequence[Mapping[str, SparseTensor]],
    weights: Sequence[float],
    shapes: Mapping[str, tuple[int, ...]],
    method: str,
    trim_fraction: float = 0.1,
) -> Params:
    """The coordinate-wise median or trimmed mean of sparse deltas, per row over the deltas that
    changed it, times those deltas' share of the total weight. Holds every delta: memory is the
    sum of the reports' sizes, not O(model) as the weighted mean's."""
    if method not in ("trimmed_mean", "median"):
        raise ValueError(f"robust_mean: method must be 'trimmed_mean' or 'median', got {method!r}")
    if not deltas or len(deltas) != len(weights) or not sum(weights) > 0:
        raise ValueError("robust_mean needs at least one delta and one weight > 0 per delta")
    total = float(sum(weights))
    out: Params = {}
    for name, shape in shapes.items():
        by_row = row_shape(shape)
        result = np.zeros(by_row, np.float64)
        parts = [(d[name], float(w)) for d, w in zip(deltas, weights, strict=True) if name in d]
        if parts:
            rows = np.concatenate([t.rows for t, _ in parts])
            values = np.concatenate([t.values.reshape(len(t.rows), *by_row[1:]) for t, _ in parts])
            row_weights = np.concatenate([np.full(len(t.rows), w) for t, w in parts])
            order = np.argsort(rows, kind="stable")
            rows, values, row_weights = rows[order], values[order].astype(np.float64), row_weights[order]
            unique, starts, counts = np.unique(rows, return_index=True, return_counts=True)
            share = np.add.reduceat(row_weights, starts) / total
            # Rows changed by the same number of deltas are reduced together, as one array.
            for count in np.unique(counts):
                which = np.flatnonzero(counts == count)
                stacked = values[starts[which][:, None] + np.arange(count)]  # (rows, count, ...)
                if method == "median":
                    reduced = np.median(stacked, axis=1)
                else:
                    cut = math.floor(trim_fraction * count)
                    reduced = np.sort(stacked, axis=1)[:, cut : count - cut].mean(axis=1)
                result[unique[which]] = reduced * share[which].reshape(-1, *([1] * (reduced.ndim - 1)))
        out[name] = result.reshape(shape).astype(np.float32)
    return out


def aggregate(
    deltas: Sequence[Mapping[str, SparseTensor]],
    weights: Sequence[float],
    shapes: Mapping[str, tuple[int, ...]],
    rule: RobustAggregation,
    reference: NormReference | Mapping[str, float] | None,
) -> tuple[Params, NormReference]:
    """A round's reports held in memory, combined by `rule`: (mean delta, next reference norms).
    The server's commit does the same, streaming the reports for the weighted mean."""
    plan = plan_round(weights, [tensor_norms(d) for d in deltas], reference, rule)
    clipped = [clip_by_norm(d, plan.bounds) for d in deltas]
    if rule.method != "none":
        return robust_mean(
            clipped, plan.weights, shapes, rule.method, rule.trim_fraction
        ), plan.next_reference
    mean = WeightedMean(shapes)
    for delta, weight in zip(clipped, plan.weights, strict=True):
        mean.add_sparse(delta, weight)
    return mean.mean(), plan.next_reference


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

    # Every number's range (orchestrator.setting_ranges): a step or tau beyond 1e6 is no
    # optimizer anyone means, and tau**2 must stay a finite float32.
    RANGES: ClassVar[dict[str, Range]] = {
        "learning_rate": Range(0, 1e6, low_open=True),
        "momentum": Range(0, 1, high_open=True),
        "beta1": Range(0, 1, high_open=True),
        "beta2": Range(0, 1, high_open=True),
        "tau": Range(0, 1e6, low_open=True),
    }

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in SERVER_OPTIMIZERS:
            raise ValueError(
                f"unknown server optimizer {self.name!r}; known: {list(SERVER_OPTIMIZERS)} (its name)"
            )
        for field_name, allowed in self.RANGES.items():
            # bool is an int in Python; `true` in a JSON config is a mistake, not 1.0 (Range refuses it).
            problem = check("", field_name, getattr(self, field_name), allowed)
            if problem:
                raise ValueError(f"server optimizer {problem}")

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
