"""What an admin sets per population: round sizes, deadlines, filters, the server optimizer."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from device_runtime.client_task import TaskConfig
from orchestrator.aggregation import ServerOptimizerConfig


class PopulationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_reports: int = Field(10, ge=1, description="reports that commit a round")
    oversampling: float = Field(1.3, ge=1.0, description="accept up to ceil(target * oversampling) check-ins")
    min_reports: int = Field(1, ge=1, description="reports needed to commit at the deadline")
    round_duration_seconds: float = Field(60.0, gt=0)
    min_examples: int = Field(
        1,
        ge=1,
        description="devices with fewer examples are turned away: at check-in (the examples the device "
        "holds) and on the device (the examples its task can use); devices get it in their task config",
    )
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

    @field_validator("server_optimizer")
    @classmethod
    def _optimizer(cls, value: dict[str, Any]) -> dict[str, Any]:
        return ServerOptimizerConfig.from_json(value).to_json()

    @field_validator("task_config")
    @classmethod
    def _task(cls, value: dict[str, Any]) -> dict[str, Any]:
        return TaskConfig.from_json(value).to_json()

    @model_validator(mode="after")
    def _sizes(self) -> PopulationSettings:
        if self.min_reports > self.target_reports:
            raise ValueError(
                f"min_reports ({self.min_reports}) must be <= target_reports ({self.target_reports})"
            )
        # One minimum for check-in and device alike, so a device the server accepts never finds
        # itself below a different threshold on the phone.
        self.task_config = TaskConfig.from_json(
            {**self.task_config, "min_examples": self.min_examples}
        ).to_json()
        return self

    @property
    def capacity(self) -> int:
        return math.ceil(self.target_reports * self.oversampling)

    def optimizer(self) -> ServerOptimizerConfig:
        return ServerOptimizerConfig.from_json(self.server_optimizer)

    def task(self) -> TaskConfig:
        return TaskConfig.from_json(self.task_config)
