"""Model versions: the one a round's commit starts from, the one it writes, and pruning the old ones."""

from __future__ import annotations

import functools
from typing import Any, cast

from safetensors.numpy import load
from sqlalchemy import CursorResult, delete, select
from sqlalchemy.orm import Session

from contracts.manifest import Manifest
from contracts.params import Params, decode_params, encode_params
from orchestrator.db import ModelVersion, Population, Round
from orchestrator.observability.on_commit import on_commit

# The model version this process committed last, per population: the next round's commit starts
# from it. Reading it back and decoding it (parameters and optimizer state, 1.5 MB each for
# 3,706 x 50) took 8-10 ms of a 50-70 ms commit under load, while check-ins into the round
# waited for its row. Versions never change once written, and a copy is kept only once its
# transaction committed, so it is never wrong, only sometimes not the version asked for.
_latest: dict[tuple[object, int], tuple[int, Params, Params]] = {}


def keep_latest(key: tuple[object, int], version: int, params: Params, state: Params) -> None:
    for array in (*params.values(), *state.values()):
        array.flags.writeable = False  # shared by the commits that start from it
    _latest[key] = (version, params, state)


def base_version(
    session: Session, population: Population, manifest: Manifest, version: int
) -> tuple[Params, Params]:
    """Model `version`'s (parameters, optimizer state): this process's copy if it committed that
    version, else read from the database (another process committed it, or this one restarted)."""
    kept = _latest.get((session.get_bind(), population.id))
    if kept is not None and kept[0] == version:
        return kept[1], kept[2]
    base = session.get(ModelVersion, (population.id, version))
    assert base is not None
    params = decode_params(base.params, manifest.global_params, "model version")
    return params, dict(load(base.optimizer_state))


def write_version(
    session: Session, population: Population, round_: Round, params: Params, state: Params, now: float
) -> int:
    """The population's next version, committed by `round_`: stored, made current, and kept in
    this process once the transaction commits (`base_version`). Returns its number."""
    version = population.current_version + 1
    round_.result_version = version
    session.add(
        ModelVersion(
            population_id=population.id,
            version=version,
            params=encode_params(params),
            optimizer_state=encode_params(state),
            round_id=round_.id,
            created_at=now,
        )
    )
    population.current_version = version
    population.training_rounds_committed += 1
    latest = (session.get_bind(), population.id)
    on_commit(session, functools.partial(keep_latest, latest, version, params, state))
    return version


def kept(session: Session, population: Population) -> list[tuple[int, int | None, float]]:
    """The versions kept, newest first: (version, the round that committed it, when)."""
    rows = session.execute(
        select(ModelVersion.version, ModelVersion.round_id, ModelVersion.created_at)
        .where(ModelVersion.population_id == population.id)
        .order_by(ModelVersion.version.desc())
    )
    return [(int(v), r, float(t)) for v, r, t in rows]


def prune_model_versions(session: Session, population: Population, keep: int) -> int:
    """Delete the versions older than the newest `keep`, except version 0 (the export) and any
    version an open round works from; returns how many went. Each version holds the dense
    parameters and optimizer state (about 1.5 MB for 3,706 x 50), so keeping every round's
    would grow the database without bound; SQLite reuses the freed pages."""
    in_use = select(Round.base_version).where(Round.population_id == population.id, Round.status == "open")
    result = session.execute(
        delete(ModelVersion).where(
            ModelVersion.population_id == population.id,
            ModelVersion.version > 0,
            ModelVersion.version <= population.current_version - keep,
            ModelVersion.version.not_in(in_use),
        )
    )
    return int(cast(CursorResult[Any], result).rowcount)
