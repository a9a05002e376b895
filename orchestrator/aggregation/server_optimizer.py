"""The server optimizers, "generalized FedAvg" (Reddi et al. 2021, "Adaptive Federated
Optimization", Algorithm 2): the round's mean delta is a negative pseudo-gradient fed to SGD, SGD
with momentum, Adam or Yogi. Pure functions, numpy only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from contracts.params import Params
from orchestrator.aggregation.tensor_shapes import check_shapes, shapes_of
from orchestrator.setting_ranges import Range, check

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
    for key, shape in _state_shapes(config, shapes_of(params)).items():
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
    shapes = shapes_of(params)
    check_shapes("mean delta", shapes_of(mean_delta), shapes)
    check_shapes(f"{config.name} optimizer state", shapes_of(state), _state_shapes(config, shapes))
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
