"""Devices that ask for a secure round's state together are answered from one transaction (a real
SQLite file, time passed in explicitly)."""

from __future__ import annotations

from typing import Any

from orchestrator.rounds.refusals import Refused
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.devices import enroll
from orchestrator.service.secure_states import StateCall, read_states
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin
from tests.orchestrator.test_secure_rounds import SECURE, message, state


def _enrolled(db: sessionmaker[Session]) -> tuple[str, str]:
    with db.begin() as session:
        return enroll(session, 0.0)


def _statements(db: sessionmaker[Session], calls: list[StateCall], now: float) -> tuple[list[Any], int]:
    """The answers, and how many SQL statements the transaction ran."""
    count = 0

    def counted(*_args: Any) -> None:
        nonlocal count
        count += 1

    engine = db.kw["bind"]
    event.listen(engine, "before_cursor_execute", counted)
    try:
        return read_states(db, calls, now), count
    finally:
        event.remove(engine, "before_cursor_execute", counted)


def test_the_devices_of_a_round_read_its_state_together_and_each_gets_its_own_answer(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: four devices in a secure round whose roster closed (target 4), each told its own index
    make_population(db, biased_model, **SECURE)
    enrolled = [_enrolled(db) for _ in range(4)]
    answers = [checkin(db, device_id, now=1.0) for device_id, _ in enrolled]
    params = RoundParameters.from_json(state(db, enrolled[0][0], answers[0].assignment_id, 1.0)["parameters"])
    indices = []
    for (device_id, _), answer in zip(enrolled, answers, strict=True):
        keys = DeviceSession(params).advertise().to_json()
        indices.append(message(db, device_id, answer.assignment_id, "advertise", keys, 2.0)["index"])
    calls = [
        StateCall(a.assignment_id, token, "share_keys")
        for (_, token), a in zip(enrolled, answers, strict=True)
    ]
    wrong_token = StateCall(answers[0].assignment_id, enrolled[1][1], None)
    unknown = StateCall("0" * 32, enrolled[0][1], None)

    # Execute: the four read together with a device using another's assignment and an unknown one;
    # then one device alone
    together, statements_together = _statements(db, [*calls, wrong_token, unknown], 3.0)
    (alone,), statements_alone = _statements(db, calls[:1], 3.0)

    # Assert: each device's own answer (the roster, its index); the others refused as the route
    # refuses them; each answer after the first costs at most two statements (its assignment, its
    # part in the round), where one transaction each costs every statement again
    states, refusals = together[:4], together[4:]
    assert all(isinstance(s, dict) and s["phase"] == "share_keys" and len(s["roster"]) == 4 for s in states)
    assert [s["index"] for s in states] == indices
    assert alone == states[0]
    assert [(r.status if isinstance(r, Refused) else r) for r in refusals] == [403, 404]
    assert statements_together <= statements_alone + 2 * (len(together) - 1), (
        statements_together,
        statements_alone,
    )
    assert statements_alone >= 6
