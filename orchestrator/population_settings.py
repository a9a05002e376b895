"""What an admin sets per population: round sizes, deadlines, filters, the server optimizer."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from device_runtime.client_task import TaskConfig
from orchestrator.aggregation import ServerOptimizerConfig


class SecureAggregationSettings(BaseModel):
    """The parameters of secure aggregation (used when `aggregation` is "secure")."""

    model_config = ConfigDict(extra="forbid")

    clip_norm: float = Field(
        1.0, gt=0, description="each device clips its dense delta to this L2 norm before quantizing"
    )
    bits: int = Field(
        32,
        ge=16,
        le=62,
        description="the masked sum is computed modulo 2^bits (4 bytes a coordinate up to 32)",
    )
    neighbours: int | None = Field(
        None,
        ge=0,
        description="SecAgg+ neighbourhood size k (even; 0 = every device of the round); "
        "None: about 3 log2(n) for n devices",
    )
    threshold: float = Field(
        0.4,
        gt=0,
        le=1,
        description="share of a device's neighbours whose shares reconstruct its secrets; lower "
        "tolerates more dropouts, higher tolerates more devices colluding with the server",
    )
    advertise_seconds: float = Field(60.0, gt=0, description="check-in, training and advertising keys")
    share_keys_seconds: float = Field(10.0, gt=0)
    masked_input_seconds: float = Field(10.0, gt=0)
    unmasking_seconds: float = Field(10.0, gt=0)

    @field_validator("neighbours")
    @classmethod
    def _even(cls, value: int | None) -> int | None:
        if value is not None and value % 2:
            raise ValueError(f"neighbours must be even (a ring with k/2 on each side), got {value}")
        return value

    @property
    def duration_seconds(self) -> float:
        return (
            self.advertise_seconds
            + self.share_keys_seconds
            + self.masked_input_seconds
            + self.unmasking_seconds
        )


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
    aggregation: Literal["plaintext", "secure"] = Field(
        "plaintext",
        description="plaintext: the server sees each device's sparse delta (trusted servers only); "
        "secure: secure aggregation, the server learns only the sum of a round's survivors",
    )
    secure: SecureAggregationSettings = SecureAggregationSettings.model_validate({})

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
        return self

    @model_validator(mode="after")
    def _secure_sizes(self) -> PopulationSettings:
        if self.aggregation == "secure" and self.min_reports < 3:
            raise ValueError(
                f"secure aggregation needs min_reports >= 3 (a sum of one or two inputs reveals them), "
                f"got {self.min_reports}"
            )
        return self

    @property
    def secure_training(self) -> bool:
        return self.aggregation == "secure"

    @property
    def capacity(self) -> int:
        return math.ceil(self.target_reports * self.oversampling)

    def optimizer(self) -> ServerOptimizerConfig:
        return ServerOptimizerConfig.from_json(self.server_optimizer)

    def task(self) -> TaskConfig:
        return TaskConfig.from_json(self.task_config)
