"""A population's settings from a run's options, whatever the model: the devices' task config over
the model's defaults, the server optimizer over the data's, DP-FedAvg, and the round options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from contracts.task_config import LocalState, TaskConfig
from orchestrator.populations.settings import PopulationSettings, settings_problems

if TYPE_CHECKING:  # the run's config checks its algorithm with `algorithm_task`
    from android_sim.run_config import RunConfig


def algorithm_task(base: dict[str, Any], overrides: dict[str, Any]) -> TaskConfig:
    """`overrides` over `base`; a stateful task without its own local learning rate trains the kept
    locals at the reconstruction rate (the rate at which a device fits its locals)."""
    values = {**base, **overrides}
    if values.get("local_state") == LocalState.KEEP.value and "local_learning_rate" not in overrides:
        values["local_learning_rate"] = values.get(
            "reconstruction_learning_rate", TaskConfig.reconstruction_learning_rate
        )
    return TaskConfig.from_json(values)


def optimizer_over(default: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """The run's server optimizer choices over the data's default."""
    if chosen.get("name", default["name"]) != default["name"]:
        return dict(chosen)  # another optimizer: none of the default's hyperparameters carry over
    return {**default, **chosen}


def differential_privacy(config: RunConfig, training_devices: int) -> dict[str, Any] | None:
    """The population's DP settings from the run's flags; None without --clip-norm."""
    if config.clip_norm is None:
        return None
    settings: dict[str, Any] = {
        "clip_norm": config.clip_norm,
        "noise_multiplier": config.noise_multiplier,
        "population_size": config.population_size or training_devices,
    }
    if config.epsilon_budget is not None:
        settings["epsilon_budget"] = config.epsilon_budget
    if config.target_delta is not None:
        settings["target_delta"] = config.target_delta
    if config.target_unclipped_quantile is not None:
        settings["target_unclipped_quantile"] = config.target_unclipped_quantile
        # Andrew et al.'s suggestion: the count's noise at a twentieth of the reports per round.
        settings["clipped_count_stddev"] = config.target_reports / 20
    return settings


def settings_problem(settings: dict[str, Any]) -> str | None:
    """Why the orchestrator would refuse a population with these settings (one line), or None:
    the server's own validator, run before the fleet exports a model or starts a server."""
    try:
        PopulationSettings.model_validate(settings)
    except ValidationError as e:
        return "population settings: " + settings_problems(e)
    return None


def round_settings(
    config: RunConfig, task: TaskConfig, optimizer: dict[str, Any], training_devices: int
) -> dict[str, Any]:
    """A population's settings from the run's round options, whatever the model: `task` is what
    the devices do, `optimizer` the server optimizer."""
    return {
        "target_reports": config.target_reports,
        "oversampling": config.oversampling,
        "min_reports": max(1, config.target_reports // 2),
        "round_duration_seconds": config.round_seconds,
        "min_examples": config.min_examples,
        "retry_after_seconds": 2.0,
        # The server stops at --rounds: a fleet that stops its devices at the count would still
        # see the round open then commit from the reports already in flight.
        "max_training_rounds": config.rounds,
        "server_optimizer": optimizer,
        "task_config": task.to_json(),
        "evaluation_every": config.evaluation_every,
        "evaluation_target_reports": config.target_reports,
        # The server's floor (5) unless the run's rounds are smaller: half a round, as min_reports.
        "min_evaluation_reports": min(5, max(1, config.target_reports // 2)),
        "evaluation_round_duration_seconds": config.round_seconds,
        "aggregation": config.aggregation,
        "secure": {
            "clip_norm": config.secure_clip_norm,
            "advertise_seconds": config.round_seconds / 2,
            # A roster still short of min_reports then waits as long again: a round's check-in
            # time, like a plaintext round's, before it is abandoned.
            "advertise_patience_seconds": config.round_seconds,
            "share_keys_seconds": config.secure_phase_seconds,
            "masked_input_seconds": config.round_seconds,
            "unmasking_seconds": config.secure_phase_seconds,
        },
        "differential_privacy": differential_privacy(config, training_devices),
    }
