"""The operator's transactions, one function each, as the admin API's routes call them: each
opens its own transaction (a read, or a write under the population's lock) and answers with the
contract's views; a request it will not honour raises `AdminRefused`, which the route answers
with its status."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contracts.mixing import MixingError
from contracts.protocol import PopulationView, RoundView
from orchestrator.db import Population, Round, SettingsChange
from orchestrator.populations import mixing as mixing_data
from orchestrator.populations.config import population_manifest
from orchestrator.populations.locks import lock_population
from orchestrator.populations.settings_changes import SettingsChangeError, change_settings
from orchestrator.rounds import pausing, release
from orchestrator.rounds.lifecycle import EVALUATION, advance, open_round, open_rounds
from orchestrator.service.population_creation import ExportedModel, PopulationError, create_population
from orchestrator.service.population_views import population_out, round_out

Factory = sessionmaker[Session]


class AdminRefused(Exception):
    """An admin request refused: the HTTP status the route answers with, and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _population(session: Session, name: str) -> Population:
    found = session.scalars(select(Population).where(Population.name == name)).first()
    if found is None:
        raise AdminRefused(404, f"no population {name!r}")
    return found


def _locked(session: Session, name: str) -> Population:
    """The population `name`, its row locked for the transaction."""
    population = lock_population(session, name)
    if population is None:
        raise AdminRefused(404, f"no population {name!r}")
    return population


def create(
    factory: Factory, name: str, exported: ExportedModel, settings: dict[str, Any], now: float
) -> PopulationView:
    with factory.begin() as session:
        try:
            population = create_population(session, name, exported, settings, now)
        except PopulationError as e:
            raise AdminRefused(409 if "already exists" in str(e) else 422, str(e)) from None
        return population_out(session, population, now)


def populations(factory: Factory, now: float) -> list[PopulationView]:
    with factory() as session:
        return [
            population_out(session, p, now)
            for p in session.scalars(select(Population).order_by(Population.id))
        ]


def status(factory: Factory, name: str, now: float) -> PopulationView:
    with factory() as session:
        return population_out(session, _population(session, name), now)


def rounds(factory: Factory, name: str, kind: str | None, limit: int, offset: int) -> list[RoundView]:
    """A population's rounds, newest first, `kind` only if given, a page of `limit` after `offset`."""
    with factory() as session:
        population = _population(session, name)
        query = select(Round).where(Round.population_id == population.id)
        if kind is not None:
            query = query.where(Round.kind == kind)
        query = query.order_by(Round.id.desc()).limit(limit).offset(offset)
        return [round_out(r) for r in session.scalars(query)]


def schedule_evaluation(factory: Factory, name: str, now: float, duration_seconds: float | None) -> RoundView:
    with factory.begin() as session:
        population = _locked(session, name)
        if pausing.paused(population):
            raise AdminRefused(409, "the population is paused: resume it first")
        refusal = release.may_open_evaluation(population)
        if refusal is not None:
            raise AdminRefused(409, refusal)
        if EVALUATION in open_rounds(session, population):
            raise AdminRefused(409, "an evaluation round is already open")
        return round_out(open_round(session, population, EVALUATION, now, duration_seconds))


def pause(factory: Factory, name: str, now: float) -> PopulationView:
    with factory.begin() as session:
        population = _locked(session, name)
        pausing.pause(session, population, now)
        return population_out(session, population, now)


def resume(factory: Factory, name: str, now: float) -> PopulationView:
    """Resume `name`; its next training round opens now."""
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            pausing.resume(session, population, now)
        except pausing.ArchivedError as e:
            raise AdminRefused(409, str(e)) from None
        advance(session, population, now)
        return population_out(session, population, now)


def archive(factory: Factory, name: str, now: float) -> PopulationView:
    with factory.begin() as session:
        population = _locked(session, name)
        pausing.archive(session, population, now)
        return population_out(session, population, now)


def change(factory: Factory, name: str, changes: Any, operator: str, now: float) -> PopulationView:
    """Change the settings safe to change mid-flight; `operator` is kept with the change."""
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            change_settings(session, population, changes, operator, now)
        except SettingsChangeError as e:
            raise AdminRefused(422, str(e)) from None
        return population_out(session, population, now)


def settings_changes(factory: Factory, name: str) -> list[dict[str, Any]]:
    """The settings' changes, newest first."""
    with factory() as session:
        population = _population(session, name)
        found = session.scalars(
            select(SettingsChange)
            .where(SettingsChange.population_id == population.id)
            .order_by(SettingsChange.version.desc())
        )
        return [
            {
                "version": c.version,
                "changes": c.changes,
                "previous": c.previous,
                "changed_by": c.changed_by,
                "changed_at": c.changed_at,
            }
            for c in found
        ]


def mixing(factory: Factory, name: str) -> dict[str, Any]:
    with factory() as session:
        return mixing_data.describe(session, _population(session, name))


def attach_mixing(
    factory: Factory, name: str, config: Any, examples: bytes | None, now: float
) -> dict[str, Any]:
    """Attach a mixing strategy and (if given) centralized examples, bounded by the caller."""
    with factory.begin() as session:
        population = _locked(session, name)
        try:
            mixing_data.attach(session, population, population_manifest(population), config, examples, now)
        except MixingError as e:
            raise AdminRefused(422, str(e)) from None
        return mixing_data.describe(session, population)
