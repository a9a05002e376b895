"""A population's centralized data and mixing strategy (contracts.mixing): attaching them, and
what each strategy needs from them at check-in and at commit.

The centralized dataset is public, server-side data; it is stored with its population (one per
population, replaced on attach) and validated against the population's manifest when attached,
so a strategy never finds examples its model cannot take.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from contracts.features import Examples, InvalidExamples
from contracts.manifest import Manifest
from contracts.mixing import (
    MAX_CENTRAL_BYTES,
    CentralDataset,
    MixingConfig,
    MixingError,
    Strategy,
    decode_central,
    sample_examples,
)
from contracts.params import Params
from contracts.task_config import LocalState, TaskConfig
from orchestrator.db import Artifact, CentralizedData, Population
from orchestrator.populations import central_training
from orchestrator.populations.central_training import CentralJob, job_key
from orchestrator.populations.settings import PopulationSettings


def attach(
    session: Session,
    population: Population,
    manifest: Manifest,
    mixing: Any,
    examples_blob: bytes | None,
    now: float,
) -> CentralizedData:
    """Attach (or replace) a population's mixing strategy and centralized examples; keep the stored
    examples when `examples_blob` is None. A MixingError says what was wrong; nothing is changed then."""
    config = MixingConfig.from_json(mixing)
    existing = session.get(CentralizedData, population.id)
    if examples_blob is None:
        if existing is None and config.strategy != "none":
            raise MixingError(f"strategy {config.strategy!r} needs centralized examples; none are attached")
        blob = existing.examples if existing is not None else b""
        num_examples = existing.num_examples if existing is not None else 0
    else:
        try:
            dataset = decode_central(
                examples_blob, manifest.features, "the centralized examples", MAX_CENTRAL_BYTES
            )
        except InvalidExamples as e:
            raise MixingError(f"the centralized examples do not fit the model's feature spec: {e}") from None
        blob, num_examples = examples_blob, dataset.examples.num_examples
    config.check_model(manifest, num_examples)
    task = PopulationSettings.model_validate(population.settings).task()
    capacity = central_training.pseudo_user_capacity(manifest, task)
    size = config.examples_per_pseudo_user
    if config.strategy in ("parallel_training", "gradient_transfer") and size is not None and size > capacity:
        raise MixingError(
            f"examples_per_pseudo_user ({size}) must be at most {capacity}: the examples whose support and "
            f"query batches, with {task.negatives_per_positive} sampled negatives each for implicit labels, "
            "one call takes and its steps all visit"
        )
    if config.strategy == "example_transfer" and task.local_state is LocalState.KEEP:
        raise MixingError(
            "example_transfer mixes centralized examples into FedRecon's update; this population keeps "
            "local state across rounds (local_state 'keep'), which it does not support"
        )
    row = existing or CentralizedData(population_id=population.id)
    row.mixing = config.to_json()
    row.examples = blob
    row.num_examples = num_examples
    row.sha256 = hashlib.sha256(blob).hexdigest()
    row.attached_at = now
    session.add(row)
    session.flush()
    return row


def mixing_of(session: Session, population: Population) -> MixingConfig:
    """The population's strategy ("none" when nothing is attached)."""
    found = session.scalars(
        select(CentralizedData.mixing).where(CentralizedData.population_id == population.id)
    ).first()
    return MixingConfig() if found is None else MixingConfig.from_json(found)


def describe(session: Session, population: Population) -> dict[str, Any]:
    """The attached strategy and dataset as the admin API shows them; `groups` is how many
    distinct `@group` ids the examples carry (the pseudo-users of parallel training and gradient
    transfer), None when they carry none."""
    found = session.execute(
        select(CentralizedData.mixing, CentralizedData.num_examples, CentralizedData.sha256).where(
            CentralizedData.population_id == population.id
        )
    ).first()
    if found is None:
        return {"mixing": MixingConfig().to_json(), "num_examples": 0, "sha256": None, "groups": None}
    dataset = central_examples(session, population, Manifest.from_json(population.manifest))
    groups = None if dataset.groups is None else int(np.unique(dataset.groups).size)
    return {"mixing": found[0], "num_examples": found[1], "sha256": found[2], "groups": groups}


# Decoded datasets by content: a check-in or commit that needs the examples parses them once per
# process. Small: a population has one dataset, and a replaced one is dropped when the bound is hit.
_decoded: dict[str, CentralDataset] = {}
_decoded_lock = threading.Lock()
_MAX_DECODED = 8


def central_examples(session: Session, population: Population, manifest: Manifest) -> CentralDataset:
    """The population's centralized examples and their group ids (empty when none are attached)."""
    sha = session.scalars(
        select(CentralizedData.sha256).where(CentralizedData.population_id == population.id)
    ).first()
    if sha is None:
        return CentralDataset(Examples.empty(manifest.features))
    with _decoded_lock:
        if sha in _decoded:
            return _decoded[sha]
    blob = session.scalars(
        select(CentralizedData.examples).where(CentralizedData.population_id == population.id)
    ).one()
    # Validated when attached; decoded again only to rebuild the arrays.
    dataset = decode_central(blob, manifest.features, "the stored centralized examples", MAX_CENTRAL_BYTES)
    with _decoded_lock:
        if len(_decoded) >= _MAX_DECODED:
            _decoded.clear()
        _decoded[sha] = dataset
    return dataset


def assignment_examples(examples: Examples, config: MixingConfig, assignment_id: str) -> Examples:
    """Example transfer: an assignment's sample of the centralized examples, the same on every
    download of it (seeded by the assignment)."""
    return sample_examples(
        examples, config.examples_per_assignment, hashlib.sha256(assignment_id.encode()).digest()
    )


def strategy_of(session: Session, population: Population) -> Strategy | None:
    """How the population mixes centralized data, None if it has none: read once by a commit, which
    then asks for a central job only of a population that mixes."""
    query = select(CentralizedData.mixing).where(CentralizedData.population_id == population.id)
    found = session.scalar(query)
    return None if found is None else MixingConfig.from_json(found).strategy


def central_job(
    session: Session,
    population: Population,
    manifest: Manifest,
    version: int,
    params: Params,
    task: TaskConfig,
    strategy: Strategy,
) -> CentralJob | None:
    """The server's work on the centralized data at model `version`, if the population mixes by
    `strategy`; None otherwise."""
    found = session.execute(
        select(CentralizedData.mixing, CentralizedData.sha256).where(
            CentralizedData.population_id == population.id
        )
    ).first()
    if found is None:
        return None
    config = MixingConfig.from_json(found[0])
    if config.strategy != strategy:
        return None
    sha = population.artifact_sha256
    dataset = central_examples(session, population, manifest)

    # Read only when this process has not loaded the model yet: a 1-10 MB read at most once.
    tflite = None
    if not central_training.has_model(sha):
        artifact = session.get(Artifact, sha)
        assert artifact is not None  # a population's artifact is never deleted
        tflite = artifact.content
    return CentralJob(
        key=job_key(session.get_bind(), population.id, version, found[1], config),
        artifact_sha256=sha,
        manifest=manifest,
        tflite=tflite,
        params=params,
        dataset=dataset,
        mixing=config,
        task=task,
        seed=version,
    )
