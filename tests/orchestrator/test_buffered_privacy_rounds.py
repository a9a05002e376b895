"""Buffered rounds under differential privacy over real HTTP: each committed buffer is noised, the
privacy figure is the m-fold Gaussian bound (no amplification), a device is in one report per
buffer, and a device whose reports are in `max_participations` buffers is refused at check-in."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from model_export.config import ModelConfig
from orchestrator.aggregation.buffered_privacy import buffered_epsilon
from orchestrator.populations.settings import PopulationSettings, settings_problems
from tests.conftest import BIASED
from tests.orchestrator.conftest import OCTETS, Server, admin_create_population
from tests.orchestrator.test_buffered_rounds import ADMIN, Phone, body_for, training_round

DP = {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 100, "max_participations": 2}
DELTA = 1e-5  # the server's default for 100 devices: min(1e-5, 100^-1.1)


def settings(**dp: object) -> str:
    return json.dumps(
        {
            "rounds": "buffered",
            "buffered": {"buffer_size": 2, "concurrency": 4, "max_staleness": 3},
            "round_duration_seconds": 60.0,
            "retry_after_seconds": 0,
            "differential_privacy": {**DP, **dp},
        }
    )


def privacy(url: str) -> dict[str, object]:
    view = httpx.get(f"{url}/v1/admin/populations/p", headers=ADMIN, timeout=30).json()
    return dict(view["privacy"])


def test_buffers_are_noised_and_a_device_is_capped(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    model_dir = export(BIASED)
    created = admin_create_population(server.url, model_dir, "p", settings())
    assert created.status_code == 201, created.text
    body = body_for(model_dir)
    a, b, x = (Phone(server.url) for _ in range(3))
    for phone in (a, b, x):
        assert phone.checkin()["accepted"] is True
    assert a.report(body).status_code == 200
    first = b.report(body).json()
    assert first["round_status"] == "committed"
    buffer = training_round(server.url, first["round_id"])
    # Noise calibrated to the sum (z C = 1) over the buffer's 2 equally weighted reports.
    assert buffer["metrics"]["dp_noise_stddev"] == pytest.approx(0.5)
    assert buffer["metrics"]["dp_epsilon"] == pytest.approx(buffered_epsilon(1.0, 1, DELTA))
    spent = privacy(server.url)
    assert spent["sampling_rate"] == 1.0 and spent["training_rounds"] == 1
    assert spent["epsilon"] == pytest.approx(buffered_epsilon(1.0, 1, DELTA))

    # X trains on version 0 and, meanwhile, on version 1: both would land in the open buffer.
    on_version_0 = x.assignment
    assert x.checkin()["model_version"] == 1
    into_buffer = x.http.post(on_version_0["report_url"], content=body, headers={**x.headers, **OCTETS})
    assert into_buffer.status_code == 200, into_buffer.text
    twice = x.report(body)
    assert twice.status_code == 409
    assert "already holds a report of this device" in twice.json()["detail"]
    assert into_buffer.json()["reported"] == 1  # and stays 1: A's report below fills the buffer

    # A's second buffer fills it; its third participation is refused, for a day.
    assert a.checkin()["accepted"] is True
    second = a.report(body).json()
    assert (second["round_id"], second["reported"]) == (into_buffer.json()["round_id"], 2)
    assert second["round_status"] == "committed"
    refused = a.http.post("/v1/populations/p/checkin", json={"example_count": 50}, headers=a.headers)
    assert refused.json()["accepted"] is False
    assert "max_participations" in refused.json()["reason"]
    assert float(refused.headers["Retry-After"]) >= 86400
    # Two buffers committed; a device is in at most two, and epsilon is that bound's.
    spent = privacy(server.url)
    assert spent["training_rounds"] == 2
    assert spent["epsilon"] == pytest.approx(buffered_epsilon(1.0, 2, DELTA))
    assert "at most 2: max_participations" in str(spent["message"])
    # B, in one buffer so far, still trains.
    assert b.checkin()["accepted"] is True


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"max_participations": None}, "differential_privacy.max_participations is required"),
        ({"max_participations": 0}, "max_participations"),
        ({"epsilon_budget": 5.0}, "epsilon_budget is for synchronous rounds"),
        (
            {"target_unclipped_quantile": 0.5, "clipped_count_stddev": 2.0},
            "adaptive clipping) is not supported with rounds: buffered",
        ),
    ],
)
def test_buffered_dp_without_a_sound_bound_is_refused(given: dict[str, object], problem: str) -> None:
    dp = {k: v for k, v in {**DP, **given}.items() if v is not None}
    with pytest.raises(ValidationError) as error:
        PopulationSettings.model_validate({"rounds": "buffered", "differential_privacy": dp})
    assert problem in settings_problems(error.value)


def test_a_cap_means_nothing_in_synchronous_rounds_and_is_refused() -> None:
    with pytest.raises(ValidationError) as error:
        PopulationSettings.model_validate({"differential_privacy": DP})
    assert "max_participations applies to rounds: buffered only" in settings_problems(error.value)


def test_buffered_secure_rounds_refuse_dp() -> None:
    with pytest.raises(ValidationError) as error:
        PopulationSettings.model_validate(
            {
                "rounds": "buffered",
                "aggregation": "secure",
                "target_reports": 6,
                "min_reports": 3,
                "buffered": {"concurrency": 12, "buffer_size": 6},
                "differential_privacy": DP,
            }
        )
    assert "aggregation: secure is not built" in settings_problems(error.value)
