"""What an admin sets per population: round sizes, deadlines, filters, the server optimizer, DP."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from device_runtime.client_task import TaskConfig
from orchestrator.aggregation import ServerOptimizerConfig
from orchestrator.differential_privacy import DPConfig, PrivacySpent, privacy_spent


class PopulationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_reports: int = Field(10, ge=1, description="reports that commit a round")
    oversampling: float = Field(1.3, ge=1.0, description="accept up to ceil(target * oversampling) check-ins")
    min_reports: int = Field(1, ge=1, description="reports needed to commit at the deadline")
    round_duration_seconds: float = Field(60.0, gt=0)
    min_examples: int = Field(1, ge=1, description="devices with fewer examples are turned away")
    retry_after_seconds: float = Field(10.0, ge=0, description="retry window sent with a rejection")
    server_optimizer: dict[str, Any] = Field(default_factory=lambda: {"name": "sgd", "learning_rate": 1.0})
    update_norm_bound: float = Field(1000.0, gt=0, description="largest accepted L2 norm of a delta")
    task_config: dict[str, Any] = Field(default_factory=dict, description="sent to devices (TaskConfig)")
    keep_model_versions: int = Field(
        100,
        ge=0,
        description="model versions kept after a commit: the newest k (0 keeps all); version 0 and "
        "any version an open round trains or evaluates from are always kept",
    )
    evaluation_every: int = Field(0, ge=0, description="open an evaluation round after every k commits")
    evaluation_target_reports: int = Field(10, ge=1)
    evaluation_round_duration_seconds: float = Field(60.0, gt=0)
    differential_privacy: dict[str, Any] | None = Field(
        None,
        description="DP-FedAvg: {clip_norm, noise_multiplier, population_size, target_delta (1e-5), "
        "epsilon_budget (optional)}; devices clip to clip_norm, the server adds Gaussian noise to the "
        "sum and weighs every report equally; null: no DP",
    )

    @field_validator("server_optimizer")
    @classmethod
    def _optimizer(cls, value: dict[str, Any]) -> dict[str, Any]:
        return ServerOptimizerConfig.from_json(value).to_json()

    @field_validator("task_config")
    @classmethod
    def _task(cls, value: dict[str, Any]) -> dict[str, Any]:
        return TaskConfig.from_json(value).to_json()

    @field_validator("differential_privacy")
    @classmethod
    def _dp(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else DPConfig.from_json(value).to_json()

    @model_validator(mode="after")
    def _sizes(self) -> PopulationSettings:
        if self.min_reports > self.target_reports:
            raise ValueError(
                f"min_reports ({self.min_reports}) must be <= target_reports ({self.target_reports})"
            )
        dp = self.dp()
        if dp is not None:
            if dp.population_size < self.target_reports:
                raise ValueError(
                    f"differential_privacy.population_size ({dp.population_size}) must be >= target_reports "
                    f"({self.target_reports}): the sampling rate is target_reports / population_size"
                )
            stated = self.task_config.get("clip_norm")
            if stated is not None and stated != dp.clip_norm:
                raise ValueError(
                    f"task_config.clip_norm ({stated}) differs from differential_privacy.clip_norm "
                    f"({dp.clip_norm}); leave it out: devices are sent the DP clip norm"
                )
            self.task_config = {
                **self.task_config,
                "clip_norm": dp.clip_norm,
                "report_within_clip": dp.adaptive,
            }
            if dp.epsilon_budget is not None and self.privacy_spent(0).rounds_within_budget == 0:
                raise ValueError(
                    f"differential_privacy.epsilon_budget {dp.epsilon_budget:g} does not allow one round: "
                    f"one round costs epsilon {self.privacy_spent(1).epsilon:.3g}; raise the noise, the "
                    "population size or the budget"
                )
        return self

    @property
    def capacity(self) -> int:
        return math.ceil(self.target_reports * self.oversampling)

    def optimizer(self) -> ServerOptimizerConfig:
        return ServerOptimizerConfig.from_json(self.server_optimizer)

    def task(self) -> TaskConfig:
        return TaskConfig.from_json(self.task_config)

    def dp(self) -> DPConfig | None:
        return None if self.differential_privacy is None else DPConfig.from_json(self.differential_privacy)

    def privacy_spent(self, rounds: int) -> PrivacySpent:
        """Epsilon after `rounds` committed training rounds of `target_reports` reports each."""
        dp = self.dp()
        if dp is None:
            raise ValueError("this population has no differential_privacy settings")
        return privacy_spent(dp, self.target_reports, rounds)
