"""Request and response bodies of the HTTP protocol (JSON; tensors travel as safetensors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from orchestrator.limits import MAX_COUNT


class Enrolled(BaseModel):
    device_id: str
    token: str = Field(description="send as 'Authorization: Bearer <token>'; shown once")


class CheckIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    example_count: int = Field(ge=0, le=MAX_COUNT, description="how many examples the device holds")
    task: Literal["training", "evaluation"] = "training"
    conditions: dict[Annotated[str, StringConstraints(max_length=64)], bool] = Field(
        default_factory=dict, max_length=32, description="e.g. idle, charging, unmetered (at most 32)"
    )


class AssignmentOut(BaseModel):
    accepted: Literal[True] = True
    assignment_id: str
    round_id: int
    kind: str
    deadline: float = Field(description="server time (unix seconds) by which to report")
    seconds_left: float
    model_version: int
    artifact_sha256: str
    artifact_url: str
    params_url: str
    manifest_url: str
    report_url: str
    abort_url: str
    task_config: dict[str, Any]
    aggregation: Literal["plaintext", "secure"] = Field(
        "plaintext", description="secure: take part through secure_url's phases instead of report_url"
    )
    secure_url: str | None = None


class RejectionOut(BaseModel):
    accepted: Literal[False] = False
    reason: str
    retry_after_seconds: float


class ReportAccepted(BaseModel):
    round_id: int
    round_status: str
    reported: int
    target: int


class RoundOut(BaseModel):
    id: int
    kind: str
    status: str
    base_version: int
    result_version: int | None
    target: int
    capacity: int
    min_reports: int
    opened_at: float
    deadline: float
    closed_at: float | None
    counters: dict[str, int]
    total_weight: float
    metrics: dict[str, float]


class PrivacyOut(BaseModel):
    """A DP population's privacy spent so far (Renyi DP accounting, Poisson-sampled Gaussian rounds)."""

    epsilon: float | None = Field(
        description="at delta after the committed rounds; null: no noise, no guarantee"
    )
    delta: float
    sampling_rate: float = Field(description="target_reports / population_size")
    training_rounds: int
    epsilon_budget: float | None
    rounds_within_budget: int | None
    budget_spent: bool = Field(description="true: no more training rounds are opened or committed")
    message: str


class PopulationOut(BaseModel):
    name: str
    current_version: int
    training_rounds_committed: int
    artifact_sha256: str
    settings: dict[str, Any]
    open_rounds: list[RoundOut]
    privacy: PrivacyOut | None = Field(None, description="only for populations with differential_privacy")
