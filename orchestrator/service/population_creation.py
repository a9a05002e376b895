"""Creating a population from an exported model: artifact by sha256, manifest checked, version 0."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from contracts.manifest import INITIAL_GLOBAL_FILE, MANIFEST_FILE, MODEL_FILE, Manifest, ManifestError
from contracts.params import ParamsError, decode_params, encode_params
from contracts.task_config import TaskConfig
from orchestrator.aggregation.server_optimizer import init_state
from orchestrator.db import Artifact, ModelVersion, Population
from orchestrator.populations.model_check import ModelUnusable, check_model
from orchestrator.populations.settings import PopulationSettings, settings_problems
from orchestrator.rounds.lifecycle import TRAINING, open_round


class PopulationError(ValueError):
    """The population cannot be created as asked; the message says why."""


@dataclass(frozen=True)
class ExportedModel:
    """The three files `python -m model_export` writes, as bytes."""

    tflite: bytes
    manifest: dict[str, Any]
    initial_global: bytes
    initial_source: str = "initial global parameters"  # what the errors call `initial_global`

    @classmethod
    def from_dir(cls, model_dir: Path, initial_globals: Path | None = None) -> ExportedModel:
        """The export in `model_dir`; its globals replaced by the file `initial_globals` if given
        (e.g. a simulation's trained ones), checked against the manifest on creation."""
        model_dir = Path(model_dir)
        try:
            return cls(
                tflite=(model_dir / MODEL_FILE).read_bytes(),
                manifest=json.loads((model_dir / MANIFEST_FILE).read_text()),
                initial_global=(model_dir / INITIAL_GLOBAL_FILE).read_bytes()
                if initial_globals is None
                else initial_globals.read_bytes(),
                initial_source="initial global parameters"
                if initial_globals is None
                else f"--initial-globals {initial_globals}",
            )
        except FileNotFoundError as e:
            if initial_globals is not None and e.filename == str(initial_globals):
                raise PopulationError(f"--initial-globals {initial_globals}: no such file") from None
            raise PopulationError(
                f"{model_dir} is not an exported model directory: {e.filename} is missing"
            ) from None
        except IsADirectoryError as e:
            raise PopulationError(f"{e.filename} is a directory; expected a file") from None
        except json.JSONDecodeError as e:
            raise PopulationError(f"{model_dir / MANIFEST_FILE} is not valid JSON: {e}") from None


def create_population(
    session: Session, name: str, model: ExportedModel, settings: dict[str, Any], now: float
) -> Population:
    if not name or len(name) > 100 or not name.replace("-", "").replace("_", "").isalnum():
        raise PopulationError(f"population name {name!r} must be 1-100 letters, digits, '-' or '_'")
    if session.scalars(select(Population).where(Population.name == name)).first() is not None:
        raise PopulationError(f"population {name!r} already exists")
    try:
        manifest = Manifest.from_json(model.manifest)
    except ManifestError as e:
        raise PopulationError(f"invalid manifest: {e}") from None
    sha256 = hashlib.sha256(model.tflite).hexdigest()
    if sha256 != manifest.model_sha256:
        raise PopulationError(
            f"the model file's sha256 {sha256[:12]}... is not the manifest's {manifest.model_sha256[:12]}..."
        )
    try:
        initial = decode_params(model.initial_global, manifest.global_params, model.initial_source)
    except ParamsError as e:
        raise PopulationError(str(e)) from None
    overrides = settings.get("task_config", {})
    if not isinstance(overrides, dict):
        raise PopulationError(
            f"invalid settings: task_config must be a JSON object, got {type(overrides).__name__}"
        )
    try:
        # Devices get the export's defaults unless the admin overrides them. Types and ranges
        # first: text "1" must not be compared with (and "differ" from) the population's 1.
        task = TaskConfig.from_manifest(manifest, **overrides)
        if "min_examples" in overrides and task.min_examples != settings.get("min_examples", 1):
            raise PopulationError(
                f"invalid settings: task_config.min_examples ({task.min_examples}) differs from the "
                f"population's min_examples ({settings.get('min_examples', 1)!r}); set it once, as the "
                "population's min_examples"
            )
        checked = PopulationSettings.model_validate({**settings, "task_config": task.to_json()})
    except ValidationError as e:
        raise PopulationError(f"invalid settings: {settings_problems(e)}") from None
    except PopulationError:
        raise
    except ValueError as e:
        raise PopulationError(f"invalid settings: {e}") from None
    if task.negative_popularity > 0 and not (manifest.task.negative_sampling and manifest.task.popularity):
        raise PopulationError(
            f"invalid settings: task_config.negative_popularity ({task.negative_popularity:g}) draws "
            "negatives by the model's popularity global; this model samples no negatives or has no "
            "popularity global (e.g. item biases): leave it 0"
        )
    central_only = task.central_only_items
    if central_only and not manifest.task.negative_sampling:
        raise PopulationError(
            "invalid settings: task_config.central_only_items keeps catalog rows out of sampled negatives; "
            "this model samples no negatives: leave it empty"
        )
    if central_only and central_only[-1] >= manifest.catalog_size:
        raise PopulationError(
            f"invalid settings: task_config.central_only_items lists row {central_only[-1]}; the "
            f"model's catalog has rows 0-{manifest.catalog_size - 1}"
        )
    try:
        check_model(model.tflite, manifest)
    except ModelUnusable as e:
        raise PopulationError(str(e)) from None
    if session.get(Artifact, sha256) is None:
        session.add(Artifact(sha256=sha256, content=model.tflite, created_at=now))
    population = Population(
        name=name,
        artifact_sha256=sha256,
        manifest=manifest.to_json(),
        settings=checked.model_dump(),
        current_version=0,
        training_rounds_committed=0,
        created_at=now,
    )
    session.add(population)
    session.flush()
    state = init_state(checked.optimizer(), initial)
    session.add(
        ModelVersion(
            population_id=population.id,
            version=0,
            params=encode_params(initial),
            optimizer_state=encode_params(state),
            round_id=None,
            created_at=now,
        )
    )
    open_round(session, population, TRAINING, now)
    return population
