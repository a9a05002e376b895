"""Population settings: DP-FedAvg's settings checked against the rest of the population's."""

from __future__ import annotations

import pytest
from orchestrator.populations.settings import PopulationSettings
from pydantic import ValidationError

DP = {"clip_norm": 2.0, "noise_multiplier": 1.0, "population_size": 1000}


def test_dp_settings_send_their_clip_norm_to_devices_and_account_at_the_target_rate() -> None:
    settings = PopulationSettings.model_validate({"target_reports": 10, "differential_privacy": DP})

    assert settings.task().clip_norm == 2.0
    assert not settings.task().report_within_clip  # one bit about the update, asked for only when needed
    assert settings.privacy_spent(3).sampling_rate == 10 / 1000
    assert settings.differential_privacy is not None and settings.differential_privacy["target_delta"] == 1e-5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"target_reports": 50, "differential_privacy": {**DP, "population_size": 20}},
            "must be >= target_reports",
        ),
        (
            {"task_config": {"clip_norm": 3.0}, "differential_privacy": DP},
            "differs from differential_privacy",
        ),
        (
            {"target_reports": 100, "differential_privacy": {**DP, "epsilon_budget": 0.01}},
            "does not allow one round: one round costs epsilon",
        ),
    ],
)
def test_inconsistent_dp_settings_are_refused_with_the_reason(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        PopulationSettings.model_validate(settings)


def test_adaptive_clipping_asks_devices_whether_they_were_clipped() -> None:
    adaptive = {**DP, "target_unclipped_quantile": 0.5, "clipped_count_stddev": 1.0}

    settings = PopulationSettings.model_validate({"target_reports": 10, "differential_privacy": adaptive})

    assert settings.task().report_within_clip and settings.task().clip_norm == 2.0
