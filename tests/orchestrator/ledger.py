"""The training rounds' ledger as the database holds it, and the invariants it must keep whatever
happened to the server (concurrent devices, several processes, crashes, a locked or stopped database).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Connection, Row, create_engine, text

from contracts.manifest import Manifest
from contracts.params import decode_params


@dataclass
class Ledger:
    population: Row[Any]  # id, current_version, training_rounds_committed
    rounds: list[Row[Any]]  # training rounds: id, status, versions, capacity and counters
    reports: dict[int, float]  # round -> stored reports
    reported_assignments: int

    @property
    def committed(self) -> list[Row[Any]]:
        return [r for r in self.rounds if r.status == "committed"]


def _per_round(db: Connection, query: str) -> dict[int, float]:
    return {int(round_id): float(value) for round_id, value in db.execute(text(query))}


def check_ledger(database_url: str, manifest: Manifest) -> Ledger:
    """Asserts the invariants of the one population in the database and returns its ledger: no
    device has two assignments in a round, no round accepted beyond its capacity, no report counts
    twice (each round's counters are its stored rows), each round committed once into the next
    version, and every committed version's parameters decode whole and finite."""
    engine = create_engine(database_url)
    with engine.connect() as db:
        population = db.execute(
            text("SELECT id, current_version, training_rounds_committed FROM populations")
        ).one()
        rounds = list(
            db.execute(
                text(
                    "SELECT id, status, base_version, result_version, capacity, accepted, reported, "
                    "total_weight FROM rounds JOIN round_admissions ON round_id = id "
                    "WHERE kind = 'training' ORDER BY id"
                )
            ).all()
        )
        assignments = _per_round(db, "SELECT round_id, count(*) FROM assignments GROUP BY round_id")
        twice = db.execute(
            text(
                "SELECT round_id, device_id FROM assignments GROUP BY round_id, device_id HAVING count(*) > 1"
            )
        ).all()
        reports = _per_round(db, "SELECT round_id, count(*) FROM reports GROUP BY round_id")
        weights = _per_round(db, "SELECT round_id, sum(weight) FROM reports GROUP BY round_id")
        reported_assignments = int(
            db.execute(
                text(
                    "SELECT count(*) FROM assignments JOIN rounds ON rounds.id = assignments.round_id "
                    "WHERE assignments.status = 'reported' AND rounds.kind = 'training'"
                )
            ).scalar_one()
        )
        versions = db.execute(
            text("SELECT version, round_id, params FROM model_versions ORDER BY version")
        ).all()
    engine.dispose()

    ledger = Ledger(population, rounds, reports, reported_assignments)
    committed = ledger.committed
    # No device has two assignments in one round; no round accepted beyond its capacity.
    assert twice == []
    assert all(r.accepted <= r.capacity for r in rounds)
    assert all(assignments.get(r.id, 0) == r.accepted for r in rounds)
    # No report counts twice: the counters are the stored reports, each from one reported assignment.
    assert sum(reports.get(r.id, 0) for r in rounds) == reported_assignments
    assert all(r.reported == reports.get(r.id, 0) for r in rounds)
    assert all(r.total_weight == pytest.approx(weights.get(r.id, 0.0)) for r in rounds)
    # Each round committed once, into the next version: consecutive, each from the one before.
    assert sorted(r.result_version for r in committed) == list(range(1, population.current_version + 1))
    assert all(r.base_version == r.result_version - 1 for r in committed)
    assert population.training_rounds_committed == population.current_version == len(committed)
    assert [v.version for v in versions] == list(range(population.current_version + 1))
    assert sorted(v.round_id for v in versions[1:]) == sorted(r.id for r in committed)
    assert all(r.result_version is None for r in rounds if r.status != "committed")
    # Every committed version's parameters are whole: each tensor of the manifest, its shape, finite
    # (decode_params raises otherwise).
    for v in versions:
        decode_params(v.params, manifest.global_params, f"version {v.version}")
    return ledger
