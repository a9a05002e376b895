"""Every numeric setting has a range, and at both ends of it (just inside, just outside) the
server answers without a 5xx: a population is created (and a device checks in to its first
round) or the setting is refused with a 422 that names it. Nothing derived may overflow."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from model_export.config import ModelConfig
from orchestrator.populations.settings import numeric_setting_ranges
from orchestrator.setting_ranges import Range, field_ranges
from orchestrator.settings import Settings
from tests.conftest import BIASED
from tests.orchestrator.conftest import Server, admin_create_population

RANGES = numeric_setting_ranges()

# The settings each group of settings is tried over (the rest at their defaults).
DP = {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 1000}
ADAPTIVE = {**DP, "noise_multiplier": 0.0, "target_unclipped_quantile": 0.5, "clipped_count_stddev": 1.0}
BASES: dict[str, dict[str, Any]] = {
    "secure": {"aggregation": "secure", "target_reports": 3, "min_reports": 3},
    "differential_privacy": {"target_reports": 1, "differential_privacy": DP},
    "server_optimizer": {"server_optimizer": {"name": "adam"}},
}

# Ends that are inside their own range but refused with another setting, by the rule named.
CROSS_FIELD = {
    ("min_examples", "high"): "must be >= min_examples",  # the task's max_examples (300) is lower
    ("task_config.min_examples", "high"): "must be >= min_examples",  # max_examples (300) again
    ("task_config.max_examples", "low"): "must be >= min_examples",
    ("differential_privacy.target_delta", "high"): "must be < 1 / population_size",
    ("differential_privacy.epsilon_budget", "low"): "does not allow one round",
    # The tests' model rates (no sampled negatives): any positive value is refused.
    ("task_config.negative_popularity", "high"): "samples no negatives",
}


def ends(allowed: Range) -> dict[str, tuple[float, float]]:
    """Per end: (just inside, just outside)."""
    if allowed.integer:
        low = (allowed.low + allowed.low_open, allowed.low - 1 + allowed.low_open)
        high = (allowed.high - allowed.high_open, allowed.high + 1 - allowed.high_open)
        return {"low": (int(low[0]), int(low[1])), "high": (int(high[0]), int(high[1]))}
    step_up, step_down = math.inf, -math.inf
    return {
        "low": (
            math.nextafter(allowed.low, step_up) if allowed.low_open else allowed.low,
            allowed.low if allowed.low_open else math.nextafter(allowed.low, step_down),
        ),
        "high": (
            math.nextafter(allowed.high, step_down) if allowed.high_open else allowed.high,
            allowed.high if allowed.high_open else math.nextafter(allowed.high, step_up),
        ),
    }


def settings_with(name: str, value: float) -> dict[str, Any]:
    group, _, field = name.rpartition(".")
    adaptive = field in ("target_unclipped_quantile", "clip_learning_rate", "clipped_count_stddev")
    settings: dict[str, Any] = json.loads(json.dumps(BASES.get(group, {"target_reports": 2})))
    if group == "differential_privacy" and adaptive:
        settings["differential_privacy"] = dict(ADAPTIVE)
    if name == "min_reports":
        settings["target_reports"] = max(value, 1) if isinstance(value, int) else 1
    # The evaluation floor is at most the evaluation round's target: each end walks with the other.
    if name == "min_evaluation_reports":
        settings["evaluation_target_reports"] = max(value, 1) if isinstance(value, int) else 1
    if name == "evaluation_target_reports":
        settings["min_evaluation_reports"] = min(max(value, 1), 5) if isinstance(value, int) else 1
    if name == "server_optimizer.momentum":
        settings["server_optimizer"] = {"name": "momentum"}
    if name == "differential_privacy.max_participations":  # a buffered population's cap only
        settings["rounds"] = "buffered"
    if group:
        settings.setdefault(group, {})[field] = value
    else:
        settings[field] = value
    return settings


CASES = [
    pytest.param(name, end, inside, outside, id=f"{name}-{end}")
    for name, allowed in RANGES.items()
    if allowed is not None
    for end, (inside, outside) in ends(allowed).items()
]


def test_every_numeric_setting_has_a_range() -> None:
    server_settings = field_ranges(Settings)
    assert [name for name, r in {**RANGES, **server_settings}.items() if r is None] == []
    assert {"secure.clip_norm", "differential_privacy.clip_norm", "server_optimizer.tau"} <= set(RANGES)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("ranges") / "orchestrator.sqlite").start() as server:
        yield server


@pytest.mark.parametrize(("name", "end", "inside", "outside"), CASES)
def test_each_setting_at_its_extremes_is_accepted_or_refused_never_a_server_error(
    running: Server,
    export: Callable[[ModelConfig], Path],
    name: str,
    end: str,
    inside: float,
    outside: float,
) -> None:
    model = export(BIASED)
    population = f"p-{name.replace('.', '-')}-{end}"

    refused = admin_create_population(
        running.url, model, f"{population}-out", json.dumps(settings_with(name, outside))
    )
    created = admin_create_population(running.url, model, population, json.dumps(settings_with(name, inside)))

    assert refused.status_code == 422, refused.text
    assert name.rpartition(".")[2] in refused.text
    expected_refusal = CROSS_FIELD.get((name, end))
    if expected_refusal is not None:
        assert created.status_code == 422 and expected_refusal in created.text, created.text
        return
    assert created.status_code == 201, created.text
    # The first round is open: a device checks in to it (capacity, deadlines, secure parameters).
    token = httpx.post(f"{running.url}/v1/devices", timeout=10).json()["token"]
    checkin = httpx.post(
        f"{running.url}/v1/populations/{population}/checkin",
        json={"example_count": 5},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert checkin.status_code < 500, checkin.text


SERVER_CASES = [
    pytest.param(name, inside, outside, id=f"{name}-{end}")
    for name, allowed in field_ranges(Settings).items()
    if allowed is not None
    for end, (inside, outside) in ends(allowed).items()
]


@pytest.mark.parametrize(("name", "inside", "outside"), SERVER_CASES)
def test_each_server_setting_at_its_extremes_is_taken_or_refused(
    name: str, inside: float, outside: float
) -> None:
    with pytest.raises(ValidationError, match=name):
        Settings(**{name: outside})  # type: ignore[arg-type]
    assert getattr(Settings(**{name: inside}), name) == inside  # type: ignore[arg-type]


def test_secure_bits_too_few_for_the_round_size_are_refused_at_creation(
    running: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # 16 bits leave 25 levels per device for 1,300 summands: refused when the population is
    # created, not a 500 when its first round opens.
    settings = {"aggregation": "secure", "target_reports": 1000, "min_reports": 3, "secure": {"bits": 16}}

    created = admin_create_population(running.url, export(BIASED), "few-bits", json.dumps(settings))

    assert created.status_code == 422 and "raise secure.bits" in created.text, created.text
