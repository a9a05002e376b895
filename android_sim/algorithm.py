"""The algorithm a run's options choose, whatever the model: the devices' task config over the
model's defaults, the server optimizer over the data's, and whether the orchestrator would take the
population settings they make (`run_config.round_settings` adds the round and DP options)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from contracts.task_config import LocalState, TaskConfig
from orchestrator.populations.settings import PopulationSettings, settings_problems


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


def settings_problem(settings: dict[str, Any]) -> str | None:
    """Why the orchestrator would refuse a population with these settings (one line), or None:
    the server's own validator, run before the fleet exports a model or starts a server."""
    try:
        PopulationSettings.model_validate(settings)
    except ValidationError as e:
        return "population settings: " + settings_problems(e)
    return None
