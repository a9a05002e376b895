"""One table of training defaults: what an export records is what a task config reads."""

from __future__ import annotations

from dataclasses import asdict, fields, replace

from contracts.task_config import TaskConfig, TrainingDefaults
from model_export.config import ModelConfig


def test_every_training_default_is_a_task_config_field_with_the_same_default() -> None:
    # TaskConfig.from_manifest keeps only the manifest's keys it knows: a default missing here
    # would be recorded at export and silently never applied.
    task = {f.name: f for f in fields(TaskConfig)}
    table = TrainingDefaults()
    for f in fields(TrainingDefaults):
        assert f.name in task, f.name
        assert task[f.name].type == f.type, f.name
        assert getattr(TaskConfig(), f.name) == getattr(table, f.name), f.name


def test_the_manifest_records_the_export_s_training_defaults_and_a_task_config_applies_them() -> None:
    assert ModelConfig().to_json()["training"] == asdict(TrainingDefaults())
    tuned = replace(
        ModelConfig(),
        training=TrainingDefaults(reconstruction_learning_rate=0.25, update_max_epochs=5, l2_local=0.001),
    )
    recorded = tuned.to_json()["training"]
    assert isinstance(recorded, dict)
    config = TaskConfig.from_json(recorded)

    assert (config.reconstruction_learning_rate, config.update_max_epochs, config.l2_local) == (
        0.25,
        5,
        0.001,
    )
    assert config.update_learning_rate == TaskConfig().update_learning_rate
    assert ModelConfig.from_json(tuned.to_json()) == tuned
