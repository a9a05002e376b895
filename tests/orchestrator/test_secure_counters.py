"""A secure round's phase counters (on its row) against its participants' rows, counted afresh,
through every kind of change to an assignment: messages, aborts at each stage, drops when a phase
closes, a phase's deadline and the commit. Real SQLite file (and PostgreSQL with
TEST_POSTGRES_URL)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from alembic import command
from sqlalchemy import and_, case, func, not_, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Assignment, Round, SecureParticipant, SecureRound
from orchestrator.migrate import alembic_config
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import state as secure_round_state
from orchestrator.rounds.secure.state import ADVERTISE, CONSISTENCY, MASKED_INPUT, SHARE_KEYS, UNMASKING
from orchestrator.service.population_creation import ExportedModel
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.messages import AdvertisedKeys, ciphertexts_from_json, encode_vector, shares_to_json
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import abort as abort_one
from tests.orchestrator.test_rounds import checkin, current_round, device, round_by_id
from tests.orchestrator.test_secure_rounds import SECURE, confirm, message, send_masked_input, state


def _count(condition: Any) -> Any:
    return func.count(case((condition, 1)))


def counted_afresh(session: Session, round_id: int) -> secure_round_state.Counts:
    """The phase conditions counted over every participant and assignment of the round (what the
    counters replace)."""
    open_ = Assignment.status == "assigned"
    joined = SecureParticipant.assignment_id.is_not(None)
    p = SecureParticipant
    row = session.execute(
        select(
            func.count(p.assignment_id),
            _count(and_(open_, p.assignment_id.is_(None))),
            _count(p.sent_shares),
            _count(and_(open_, joined, not_(p.sent_shares))),
            _count(p.sent_masked_input),
            _count(and_(open_, p.sent_shares, not_(p.sent_masked_input))),
            _count(p.sent_consistency),
            _count(and_(open_, p.sent_masked_input, not_(p.sent_consistency))),
            _count(p.sent_unmasking),
        )
        .select_from(Assignment)
        .outerjoin(p, p.assignment_id == Assignment.id)
        .where(Assignment.round_id == round_id)
    ).one()
    return secure_round_state.Counts(*(int(n) for n in row))


def from_the_row(session: Session, round_id: int) -> tuple[str, secure_round_state.Counts]:
    secure_round, round_ = session.get(SecureRound, round_id), session.get(Round, round_id)
    assert secure_round is not None and round_ is not None
    return secure_round.phase, secure_round_state.counts_of(secure_round, round_.accepted)


def check(db: sessionmaker[Session], round_id: int) -> tuple[str, secure_round_state.Counts]:
    with db() as session:
        phase, counts = from_the_row(session, round_id)
        assert counts == counted_afresh(session, round_id), phase
        return phase, counts


def abort(db: sessionmaker[Session], dev: str, assignment_id: str, now: float) -> None:
    answer = abort_one(db, dev, assignment_id, now)
    assert not isinstance(answer, Refused), answer


def test_the_counters_on_the_round_follow_every_message_abort_drop_and_deadline(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: target 5, capacity 6, masked inputs for 60 s; six devices check in, one aborts
    # before its keys
    settings: dict[str, Any] = {
        **SECURE,
        "target_reports": 5,
        "oversampling": 1.2,
        "secure": {**SECURE["secure"], "masked_input_seconds": 60},
    }
    make_population(db, biased_model, **settings)
    devices = [device(db) for _ in range(6)]
    answers = [checkin(db, d, now=0.5) for d in devices]
    round_id = current_round(db).id
    seen = [check(db, round_id)]
    abort(db, devices[5], answers[5].assignment_id, 0.6)
    seen.append(check(db, round_id))
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 0.7)["parameters"])
    sessions = [DeviceSession(params) for _ in devices]

    # Execute: five advertise (the roster is then full); one aborts after its keys, four share
    indices = []
    for k in range(5):
        keys = sessions[k].advertise().to_json()
        indices.append(message(db, devices[k], answers[k].assignment_id, "advertise", keys, 1.0)["index"])
        seen.append(check(db, round_id))
    roster_json = state(db, devices[0], answers[0].assignment_id, 1.5)["roster"]
    roster = {int(i): AdvertisedKeys.from_json(k) for i, k in roster_json.items()}
    abort(db, devices[4], answers[4].assignment_id, 1.6)
    seen.append(check(db, round_id))
    for k in range(4):
        shares = shares_to_json(sessions[k].share_keys(indices[k], roster))
        message(db, devices[k], answers[k].assignment_id, "share_keys", shares, 2.0)
        seen.append(check(db, round_id))
    # three send their masked input; the fourth is dropped at the phase's deadline (2 + 60 s)
    zero = np.zeros(params.vector_length, np.uint64)
    for k in range(3):
        ciphertexts = ciphertexts_from_json(
            state(db, devices[k], answers[k].assignment_id, 4.0)["ciphertexts"], 5
        )
        body = encode_vector(sessions[k].masked_input(zero, ciphertexts), params)
        send_masked_input(db, devices[k], answers[k].assignment_id, sessions[k], body, 4.0)
        seen.append(check(db, round_id))
    survivors = state(db, devices[0], answers[0].assignment_id, 62.5)["survivors"]
    seen.append(check(db, round_id))
    confirm(db, devices, answers, range(3), 63.0)
    seen.append(check(db, round_id))
    for k in range(3):
        message(
            db,
            devices[k],
            answers[k].assignment_id,
            "unmasking",
            sessions[k].unmask(survivors).to_json(),
            64.0,
        )
        seen.append(check(db, round_id))

    # Assert: the row agreed with the participants at every step (`check`), through the phases
    # in order, and the round committed with the three that stayed
    phases = [phase for phase, _ in seen]
    assert phases[:2] == ["advertise", "advertise"] and phases[6] == "share_keys"
    assert phases[11] == "masked_input" and phases[15] == "consistency" and phases[-1] == "done"
    assert seen[1][1].waiting == 5  # six checked in, one aborted
    assert seen[8][1].open_unshared == 3  # five advertised, one aborted, one has shared
    assert seen[14][1].open_unsent == 1 and seen[15][1].open_unsent == 0  # the fourth dropped
    with db() as session:
        secure_round = session.get(SecureRound, round_id)
        assert secure_round is not None
        counters = {name: getattr(secure_round, name) for name in secure_round_state.COUNTERS}
    assert counters == {
        "advertised": 5,
        "sharers": 4,
        "senders": 3,
        "signers": 3,
        "responders": 3,
        "left_before_keys": 1,
        "left_before_shares": 1,
        "left_before_input": 1,
        "left_before_confirmation": 0,
    }
    closed = round_by_id(db, round_id)
    assert closed.status == "committed" and closed.metrics["secure_survivors"] == 3


def test_a_round_under_way_keeps_its_counts_through_the_migration_that_adds_them(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: a secure round in its advertise phase: four checked in, one aborted, two advertised
    make_population(db, biased_model, **SECURE)
    devices = [device(db) for _ in range(4)]
    answers = [checkin(db, d, now=0.5) for d in devices]
    round_id = current_round(db).id
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 0.7)["parameters"])
    abort(db, devices[3], answers[3].assignment_id, 0.8)
    for k in range(2):
        message(
            db,
            devices[k],
            answers[k].assignment_id,
            "advertise",
            DeviceSession(params).advertise().to_json(),
            1.0,
        )
    before = check(db, round_id)
    url = db.kw["bind"].url.render_as_string(hide_password=False)
    config = alembic_config(url)
    command.downgrade(config, "0016")

    # Execute: the database is upgraded again, and the third device advertises
    command.upgrade(config, "head")
    after = check(db, round_id)
    message(
        db,
        devices[2],
        answers[2].assignment_id,
        "advertise",
        DeviceSession(params).advertise().to_json(),
        1.5,
    )

    # Assert: the counters were filled from the participants, and the round goes on with them:
    # the full roster closes at the last advertisement
    assert after == before == ("advertise", secure_round_state.Counts(2, 1, 0, 2, 0, 0, 0, 0, 0))
    phase, counts = check(db, round_id)
    assert phase == "share_keys" and counts.advertised == 3 and counts.waiting == 0


@contextmanager
def secure_row(db: sessionmaker[Session], model: ExportedModel, **counters: int) -> Iterator[Any]:
    """A secure round's row holding `counters`, in a transaction: the counts below move it as
    production does (`round_counts.count_secure`)."""
    make_population(db, model, target_reports=5)
    round_id = checkin(db, device(db)).round_id
    with db.begin() as session:
        session.add(SecureRound(round_id=round_id, phase="advertise", phase_deadline=10.0, parameters={}))
    with db.begin() as session:
        row = session.get(SecureRound, round_id)
        assert row is not None
        for name, value in counters.items():
            setattr(row, name, value)
        session.flush()
        yield lambda count: round_counts.count_secure(session, row, count), row


def test_each_message_moves_its_stage_and_the_open_devices_follow(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    with secure_row(db, biased_model) as (apply, row):
        for phase, times in (
            (ADVERTISE, 5),
            (SHARE_KEYS, 4),
            (MASKED_INPUT, 3),
            (CONSISTENCY, 2),
            (UNMASKING, 1),
        ):
            for _ in range(times):
                apply(secure_round_state.message(phase))

        counts = secure_round_state.counts_of(row, accepted=6)

        assert (row.advertised, row.sharers, row.senders, row.signers, row.responders) == (5, 4, 3, 2, 1)
        # 6 checked in, 1 never advertised; each later stage keeps one device behind
        open_counts = (counts.waiting, counts.open_unshared, counts.open_unsent, counts.open_unsigned)
        assert open_counts == (1, 1, 1, 1)


def test_a_device_leaving_is_counted_at_the_stage_it_had_reached(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    with secure_row(db, biased_model, advertised=4, sharers=3, senders=2, signers=1) as (apply, row):
        sent = {SHARE_KEYS: True, MASKED_INPUT: False}
        at = secure_round_state.stage(True, sent)

        apply(secure_round_state.leaving(at))
        apply(secure_round_state.leaving(secure_round_state.stage(False, {})))

        assert at == 2
        assert (row.left_before_input, row.left_before_keys) == (1, 1)
        assert secure_round_state.counts_of(row, accepted=5).open_unsent == 0
        # a device past its confirmation leaves nothing a phase's condition reads
        assert secure_round_state.leaving(4).adds == {} and secure_round_state.leaving(5).adds == {}


def test_a_phase_close_drops_every_open_device_below_the_stage_it_keeps(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    counters = {"advertised": 5, "sharers": 4, "senders": 2, "left_before_shares": 1}
    with secure_row(db, biased_model, **counters) as (apply, row):
        accepted = 7

        apply(secure_round_state.dropped_below(row, accepted, kept=3))

        assert secure_round_state.open_at(row, accepted)[:3] == [0, 0, 0]
        assert (row.left_before_keys, row.left_before_shares, row.left_before_input) == (2, 1, 2)
        # a second close finds nobody left to drop
        assert secure_round_state.dropped_below(row, accepted, kept=3).adds == {}
