"""What an admin sets per population: round sizes, deadlines, filters, the server optimizer, DP."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from contracts.task_config import FLOAT32_MAX, INT32_MAX, TASK_CONFIG_MAXIMA, TaskConfig
from orchestrator.aggregation.buffered_privacy import (
    buffered_dp_problems,
    buffered_epsilon,
    buffered_privacy_spent,
)
from orchestrator.aggregation.differential_privacy import DPConfig, PrivacySpent, privacy_spent
from orchestrator.aggregation.registry import ROBUST_RULES, RobustAggregation
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.aggregation.staleness import STALENESS_WEIGHTINGS
from orchestrator.limits import MAX_COUNT
from orchestrator.setting_ranges import Range, field_ranges

# Every setting has a range: a round of a million reports or a deadline a month away is already
# beyond any deployment, and a bound keeps every derived number (capacity, deadlines) finite and
# inside the database's integers.
MAX_ROUND_REPORTS = 1_000_000
MAX_SECONDS = 30 * 24 * 3600.0
MAX_TASK_NUMBER = 1e12
# A delta's L2 norm bound: far beyond any model's update, and small enough that the quantization
# scale and the noise computed from it stay finite.
MAX_CLIP_NORM = 1e6

if TYPE_CHECKING:
    RobustRuleName = str
    StalenessWeighting = str
else:
    # The registry's names as a Literal, so that a rule added there is accepted here, pydantic says
    # which names it accepts, and the settings page lists them (a type checker sees a str).
    RobustRuleName = Literal[tuple(ROBUST_RULES)]
    StalenessWeighting = Literal[tuple(STALENESS_WEIGHTINGS)]


def settings_problems(error: ValidationError) -> str:
    """A ValidationError of population settings as one line, each problem as `field: message`
    (pydantic's own text spans lines and echoes the input)."""
    return "; ".join(
        ".".join(str(part) for part in e["loc"]) * bool(e["loc"])
        + (": " if e["loc"] else "")
        + e["msg"].removeprefix("Value error, ")
        for e in error.errors()
    )


class SecureAggregationSettings(BaseModel):
    """The parameters of secure aggregation (used when `aggregation` is "secure")."""

    model_config = ConfigDict(extra="forbid", strict=True)

    clip_norm: float = Field(
        1.0,
        gt=0,
        le=MAX_CLIP_NORM,
        description="each device clips its dense delta to this L2 norm before quantizing",
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
        le=MAX_ROUND_REPORTS,
        description="SecAgg+ neighbourhood size k (even; 0 = every device of the round); "
        "None: about 6 log2(n) for n devices (2 ceil(3 log2 n))",
    )
    threshold: float = Field(
        0.4,
        gt=0,
        le=1,
        description="share of a device's neighbours whose shares reconstruct its secrets; lower "
        "tolerates more dropouts, higher tolerates more devices colluding with the server",
    )
    # Devices advertise keys as they check in and share keys while they train: the masked-input
    # phase is the one that covers training.
    advertise_seconds: float = Field(
        30.0,
        gt=0,
        le=MAX_SECONDS,
        description="check-in and advertising keys (the roster closes at capacity or then)",
    )
    share_keys_seconds: float = Field(
        10.0, gt=0, le=MAX_SECONDS, description="sending shares (devices are training)"
    )
    masked_input_seconds: float = Field(
        60.0, gt=0, le=MAX_SECONDS, description="training and sending the masked input"
    )
    unmasking_seconds: float = Field(10.0, gt=0, le=MAX_SECONDS)
    advertise_patience_seconds: float = Field(
        0.0,
        ge=0,
        le=MAX_SECONDS,
        description="how much longer than advertise_seconds a roster with fewer than min_reports "
        "devices stays open for check-ins before the round is abandoned: in a trough of the day "
        "the round gathers its devices instead of sending away the few it has",
    )
    straggler_wait: float | None = Field(
        1.0,
        gt=0,
        le=100,
        description="once a phase has heard from min_reports devices (keys from a full round, shares, "
        "masked inputs), it waits for the others at most this many times as long as that took (a "
        "device that vanished silently is one); null: until the phase's deadline",
    )

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
            + self.advertise_patience_seconds
            + self.share_keys_seconds
            + self.masked_input_seconds
            + self.unmasking_seconds
        )


class BufferedSettings(BaseModel):
    """Buffered asynchronous rounds (FedBuff, Nguyen et al. 2022; used when `rounds` is "buffered")."""

    model_config = ConfigDict(extra="forbid", strict=True)

    buffer_size: int = Field(
        10,
        ge=1,
        le=MAX_ROUND_REPORTS,
        description="K: reports added into the buffer that commit a new version",
    )
    concurrency: int = Field(
        13,
        ge=1,
        le=MAX_ROUND_REPORTS,
        description="devices training at once (replaces the round's target and oversampling): a "
        "check-in is admitted while fewer hold an assignment",
    )
    staleness_weighting: StalenessWeighting = Field(
        "inverse_sqrt",
        description="a report's weight is its examples x f(s), s the versions committed since its "
        "download: " + "; ".join(f"{name}: {what}" for name, what in STALENESS_WEIGHTINGS.items()),
    )
    max_staleness: int = Field(
        10,
        ge=0,
        le=MAX_ROUND_REPORTS,
        description="a report more versions behind than this is refused (reason `stale`) and its device "
        "checks in again for the current version",
    )


class PopulationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    target_reports: int = Field(
        10,
        ge=1,
        le=MAX_ROUND_REPORTS,
        description="reports that commit a round (rounds: buffered with aggregation: secure: a cohort's)",
    )
    oversampling: float = Field(
        1.3, ge=1.0, le=100.0, description="accept up to ceil(target * oversampling) check-ins"
    )
    min_reports: int = Field(
        1, ge=1, le=MAX_ROUND_REPORTS, description="reports needed to commit at the deadline"
    )
    round_duration_seconds: float = Field(60.0, gt=0, le=MAX_SECONDS)
    min_examples: int = Field(
        1,
        ge=1,
        le=TASK_CONFIG_MAXIMA["min_examples"],  # devices get it in their task config
        description="devices with fewer examples are turned away: at check-in (the examples the device "
        "holds) and on the device (the examples its task can use); devices get it in their task config",
    )
    retry_after_seconds: float = Field(
        10.0, ge=0, le=MAX_SECONDS, description="retry window sent with a rejection"
    )
    server_optimizer: dict[str, Any] = Field(default_factory=lambda: {"name": "sgd", "learning_rate": 1.0})
    update_norm_bound: float = Field(
        1000.0, gt=0, le=1e12, description="a report whose delta has a larger L2 norm is refused"
    )
    robust_aggregation: RobustRuleName = Field(
        "none",
        description="; ".join(f"{name}: {rule.what}" for name, rule in ROBUST_RULES.items()),
    )
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: dropped at each end")
    norm_clip_multiple: float = Field(
        3.0,
        ge=1.0,
        le=1e6,
        description="each tensor of a delta is clipped to this multiple of its reference norm, the "
        "median norm of the honest rounds before",
    )
    max_weight_multiple: float = Field(
        5.0, ge=1.0, le=1e6, description="a report weighs at most this multiple of the round's median weight"
    )
    task_config: dict[str, Any] = Field(default_factory=dict, description="sent to devices (TaskConfig)")
    keep_model_versions: int = Field(
        100,
        ge=0,
        le=MAX_ROUND_REPORTS,
        description="model versions kept after a commit: the newest k (0 keeps all); version 0 and "
        "any version an open round trains or evaluates from are always kept",
    )
    report_deltas: Literal["until_round_closes", "keep"] = Field(
        "until_round_closes",
        description="until_round_closes: a report's delta is deleted in the transaction that commits "
        "or abandons its round (its weight, metrics and the round's counts stay); keep: kept for "
        "good (a plaintext delta reveals its device's data, as the threat model says)",
    )
    max_training_rounds: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="training rounds the population commits, then no training round opens (devices "
        "are told so; evaluation rounds still run); null: no limit",
    )
    evaluation_every: int = Field(
        0, ge=0, le=MAX_ROUND_REPORTS, description="open an evaluation round after every k commits"
    )
    evaluation_target_reports: int = Field(10, ge=1, le=MAX_ROUND_REPORTS)
    min_evaluation_reports: int = Field(
        5,
        ge=1,
        le=MAX_ROUND_REPORTS,
        description="an evaluation round releases its metric sums only when it commits with at least "
        "this many devices' reports; with fewer it is abandoned at its deadline and its sums erased "
        "(a sum of one or two devices' evaluation metrics is those devices' figures)",
    )
    evaluation_round_duration_seconds: float = Field(60.0, gt=0, le=MAX_SECONDS)
    aggregation: Literal["plaintext", "secure"] = Field(
        "plaintext",
        description="plaintext: the server sees each device's sparse delta (trusted servers only); "
        "secure: secure aggregation, the server learns only the sum of a round's survivors",
    )
    secure: SecureAggregationSettings = SecureAggregationSettings.model_validate({})
    rounds: Literal["synchronous", "buffered"] = Field(
        "synchronous",
        description="synchronous: a round opens, admits its capacity, commits at its target and refuses "
        "later reports as late; buffered: devices check in whenever fewer than buffered.concurrency "
        "train, and every buffered.buffer_size reports commit a version, stale ones weighted down",
    )
    buffered: BufferedSettings = BufferedSettings.model_validate({})
    differential_privacy: dict[str, Any] | None = Field(
        None,
        description="DP-FedAvg: {clip_norm, noise_multiplier, population_size, target_delta (default "
        "min(1e-5, population_size^-1.1), always < 1 / population_size), "
        "epsilon_budget (optional: once spent, training check-ins are answered 200 with the budget's "
        "message and Retry-After 86400)}; devices clip to clip_norm, the server adds Gaussian noise to the "
        "sum and weighs every report equally; null: no DP",
    )

    @field_validator("server_optimizer")
    @classmethod
    def _optimizer(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_numbers("server_optimizer", value)
        return ServerOptimizerConfig.from_json(value).to_json()

    @field_validator("task_config")
    @classmethod
    def _task(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_numbers("task_config", value)
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
        if self.min_evaluation_reports > self.evaluation_target_reports:
            raise ValueError(
                f"min_evaluation_reports ({self.min_evaluation_reports}) must be <= "
                f"evaluation_target_reports ({self.evaluation_target_reports}): an evaluation round "
                "commits at its target, and must not release the sums of fewer devices than the floor"
            )
        # One minimum for check-in and device alike, so a device the server accepts never finds
        # itself below a different threshold on the phone.
        self.task_config = TaskConfig.from_json(
            {**self.task_config, "min_examples": self.min_examples}
        ).to_json()
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

    @model_validator(mode="after")
    def _secure_sizes(self) -> PopulationSettings:
        if self.aggregation == "secure" and self.min_reports < 3:
            raise ValueError(
                f"secure aggregation needs min_reports >= 3 (a sum of one or two inputs reveals them), "
                f"got {self.min_reports}"
            )
        # The masked sum of `capacity` inputs must fit `bits` with 8 bits of precision each
        # (secure_aggregation.RoundParameters); checked here, not when the first round opens.
        levels = ((1 << (self.secure.bits - 1)) - 1) // self.secure_roster
        if self.aggregation == "secure" and levels < 2**7:
            raise ValueError(
                f"secure.bits {self.secure.bits} leave {levels} quantization levels per device for a "
                f"round of {self.secure_roster} devices (target_reports x oversampling); raise secure.bits "
                "(at least 8 bits of precision are needed) or lower the round's size"
            )
        dp = self.dp()
        if self.aggregation == "secure" and dp is not None:
            if dp.adaptive:
                raise ValueError(
                    "adaptive clipping (target_unclipped_quantile) needs each device's clipped bit, which "
                    "secure aggregation would have to mask too; use a fixed clip_norm with secure aggregation"
                )
            # One bound: devices clip to the DP clip norm, which the noise is calibrated to.
            self.secure = self.secure.model_copy(update={"clip_norm": dp.clip_norm})
        return self

    @model_validator(mode="after")
    def _buffered_sizes(self) -> PopulationSettings:
        dp = self.dp()
        if self.rounds != "buffered":
            if dp is not None and dp.max_participations is not None:
                raise ValueError(
                    "differential_privacy.max_participations applies to rounds: buffered only; a "
                    "synchronous round's epsilon comes from its sampling rate (leave it out)"
                )
            return self
        # Secure: the buffer sums cohorts, each a secure round of target_reports x oversampling.
        if self.aggregation == "secure" and self.buffered.concurrency < self.secure_roster:
            raise ValueError(
                f"buffered.concurrency ({self.buffered.concurrency}) must be at least one cohort: under "
                f"aggregation: secure devices train in cohorts of ceil(target_reports x oversampling) = "
                f"{self.secure_roster} devices"
            )
        if dp is not None:
            problems = buffered_dp_problems(dp.max_participations, dp.adaptive)
            if self.aggregation == "secure":
                problems.append(
                    "differential_privacy with rounds: buffered and aggregation: secure is not built "
                    "(a cohort's sum would need the noise); use one of the two"
                )
            if dp.epsilon_budget is not None:
                bound = ""
                if not problems and dp.max_participations is not None:
                    eps = buffered_epsilon(dp.noise_multiplier, dp.max_participations, dp.target_delta)
                    bound = f" (here epsilon {eps:.3g} at delta {dp.target_delta:g})"
                problems.append(
                    "differential_privacy.epsilon_budget is for synchronous rounds; a buffered "
                    f"population's bound is its max_participations{bound}: leave the budget out"
                )
            if problems:
                raise ValueError("; ".join(problems))
        if self.min_reports > self.buffered.buffer_size:
            raise ValueError(
                f"min_reports ({self.min_reports}) must be <= buffered.buffer_size "
                f"({self.buffered.buffer_size}): a buffer commits at its deadline with min_reports"
            )
        if self.keep_model_versions and self.keep_model_versions <= self.buffered.max_staleness:
            raise ValueError(
                f"keep_model_versions ({self.keep_model_versions}) must exceed buffered.max_staleness "
                f"({self.buffered.max_staleness}): a device may still download a version that old"
            )
        return self

    @property
    def buffered_training(self) -> bool:
        return self.rounds == "buffered"

    @property
    def secure_training(self) -> bool:
        return self.aggregation == "secure"

    @property
    def secure_roster(self) -> int:
        """A secure round's capacity (a buffered population's cohort's): target x oversampling."""
        return math.ceil(self.target_reports * self.oversampling)

    @property
    def capacity(self) -> int:
        if self.buffered_training:
            return self.buffered.concurrency
        return math.ceil(self.target_reports * self.oversampling)

    def robust(self) -> RobustAggregation:
        return RobustAggregation(
            method=self.robust_aggregation,
            trim_fraction=self.trim_fraction,
            norm_clip_multiple=self.norm_clip_multiple,
            max_weight_multiple=self.max_weight_multiple,
        )

    def optimizer(self) -> ServerOptimizerConfig:
        return ServerOptimizerConfig.from_json(self.server_optimizer)

    def task(self) -> TaskConfig:
        return TaskConfig.from_json(self.task_config)

    def dp(self) -> DPConfig | None:
        return None if self.differential_privacy is None else DPConfig.from_json(self.differential_privacy)

    def privacy_spent(self, rounds: int) -> PrivacySpent:
        """Epsilon after `rounds` committed training rounds: of `target_reports` reports each, or
        buffers of a buffered population (bounded by its max_participations)."""
        dp = self.dp()
        if dp is None:
            raise ValueError("this population has no differential_privacy settings")
        if self.buffered_training:
            return buffered_privacy_spent(dp, rounds)
        return privacy_spent(dp, self.target_reports, rounds)


def numeric_setting_ranges() -> dict[str, Range | None]:
    """Every numeric population setting by dotted name (differential_privacy.*, server_optimizer.*,
    task_config.* included), with its range: what a settings reference lists, what the walk test
    tries at both ends. None would be a setting without a range (a test keeps there being none)."""
    ranges = field_ranges(PopulationSettings)
    ranges.update({f"differential_privacy.{name}": r for name, r in DPConfig.RANGES.items()})
    ranges.update({f"server_optimizer.{name}": r for name, r in ServerOptimizerConfig.RANGES.items()})
    for f in dataclasses.fields(TaskConfig):
        kind = str(f.type)
        if kind.startswith(("int", "float")):
            # The task's own maximum, and _check_numbers' (a device takes integers as int32).
            integer = kind.startswith("int")
            highest = min(
                TASK_CONFIG_MAXIMA.get(f.name, INT32_MAX if integer else FLOAT32_MAX),
                MAX_COUNT if integer else MAX_TASK_NUMBER,
            )
            lowest = 1 if f.name == "min_examples" else 0
            ranges[f"task_config.{f.name}"] = Range(
                lowest, highest, low_open=f.name == "clip_norm", integer=integer
            )
    return ranges


def _check_numbers(what: str, value: dict[str, Any]) -> None:
    """Every number in a settings object in range: integers fit 32 bits (a device's model takes
    them as int32), others are finite and at most MAX_TASK_NUMBER in magnitude."""
    for key, item in value.items():
        if isinstance(item, bool) or not isinstance(item, int | float):
            continue
        if isinstance(item, int) and not -MAX_COUNT - 1 <= item <= MAX_COUNT:
            raise ValueError(f"{what}.{key} = {item} does not fit a 32-bit integer")
        if isinstance(item, float) and not abs(item) <= MAX_TASK_NUMBER:
            raise ValueError(
                f"{what}.{key} = {item} must be finite and at most {MAX_TASK_NUMBER:g} in magnitude"
            )
