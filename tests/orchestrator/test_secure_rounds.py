"""A secure round's phases and deadlines on a real SQLite file, with time passed in explicitly."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from orchestrator.populations.locks import population_of_assignment
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds.lifecycle import advance_secure
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages as secure_rounds
from orchestrator.service.population_creation import ExportedModel
from prometheus_client import REGISTRY
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.rounds import checkins
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.messages import AdvertisedKeys, ciphertexts_from_json, encode_vector, shares_to_json
from secure_aggregation.view import Confirmation, PartnerStatement
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin, current_round, device, round_by_id

SECURE: dict[str, Any] = {
    "target_reports": 4,
    "oversampling": 1.0,
    "min_reports": 3,
    "aggregation": "secure",
    "secure": {"advertise_seconds": 10, "share_keys_seconds": 5, "neighbours": 0},
}


def message(
    factory: sessionmaker[Session], dev: str, assignment_id: str, phase: str, body: Any, now: float
) -> Any:
    """A device's phase message as the route sends it: checks, the handler, then the phase logic."""
    with factory.begin() as session:
        population = population_of_assignment(session, assignment_id)
        assert population is not None
        found = checkins.secure_round_of(session, population, assignment_id, dev, now)
        assert not isinstance(found, Refused), found
        _, round_ = found
        answer = getattr(secure_rounds, phase)(session, round_, assignment_id, body, now)
        advance_secure(session, population, round_, now)
        return answer


def send_masked_input(
    factory: sessionmaker[Session],
    dev: str,
    assignment_id: str,
    session: DeviceSession,
    body: bytes,
    now: float,
) -> Any:
    """A device's partner statement (unsigned: these devices have no identity), then its masked input."""
    statement = PartnerStatement(bytes(32), session.missing, None).to_json()
    message(factory, dev, assignment_id, "partners", statement, now)
    return message(factory, dev, assignment_id, "masked_input", body, now)


def confirm(
    factory: sessionmaker[Session], devices: list[str], answers: list[Any], ks: range | list[int], now: float
) -> None:
    """Devices `ks` confirm the survivors (unsigned: the devices of these tests have no identity)."""
    unsigned = Confirmation(bytes(32), None).to_json()
    for k in ks:
        message(factory, devices[k], answers[k].assignment_id, "consistency", unsigned, now)


def state(factory: sessionmaker[Session], dev: str, assignment_id: str, now: float) -> dict[str, Any]:
    with factory.begin() as session:
        population = population_of_assignment(session, assignment_id)
        assert population is not None
        found = checkins.secure_round_of(session, population, assignment_id, dev, now)
        assert not isinstance(found, Refused), found
        return secure_rounds.state(session, found[1], assignment_id, now)


def _keys_shared(
    db: sessionmaker[Session], n: int, checkin_at: float, advertise_at: float, share_at: float
) -> tuple[list[str], list[Any], list[DeviceSession], RoundParameters, list[int]]:
    """`n` new devices check in, advertise their keys and share them with the whole roster, as
    devices do before they train; their ids, check-in answers, sessions, the round's parameters and
    their roster indices."""
    devices = [device(db) for _ in range(n)]
    answers = [checkin(db, d, now=checkin_at) for d in devices]
    params = RoundParameters.from_json(
        state(db, devices[0], answers[0].assignment_id, checkin_at)["parameters"]
    )
    sessions = [DeviceSession(params) for _ in devices]
    indices = [
        message(db, d, a.assignment_id, "advertise", s.advertise().to_json(), advertise_at)["index"]
        for d, a, s in zip(devices, answers, sessions, strict=True)
    ]
    roster_json = state(db, devices[0], answers[0].assignment_id, share_at)["roster"]
    roster = {int(i): AdvertisedKeys.from_json(k) for i, k in roster_json.items()}
    for d, a, s, index in zip(devices, answers, sessions, indices, strict=True):
        message(db, d, a.assignment_id, "share_keys", shares_to_json(s.share_keys(index, roster)), share_at)
    return devices, answers, sessions, params, indices


def test_secure_settings_refuse_rounds_too_small_to_hide_an_input() -> None:
    with pytest.raises(ValidationError, match="min_reports >= 3"):
        PopulationSettings.model_validate({**SECURE, "min_reports": 2})
    with pytest.raises(ValidationError, match="even"):
        PopulationSettings.model_validate({**SECURE, "secure": {"neighbours": 3}})
    assert PopulationSettings.model_validate({}).aggregation == "plaintext"


def test_too_few_sharers_abandon_the_round_at_the_phase_deadline_and_the_next_one_opens(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: four devices advertise keys; the roster closes at the target
    make_population(db, biased_model, **SECURE)
    devices = [device(db) for _ in range(4)]
    answers = [checkin(db, d) for d in devices]
    first = current_round(db)
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 1.0)["parameters"])
    sessions = [DeviceSession(params) for _ in devices]
    for d, a, s in zip(devices, answers, sessions, strict=True):
        assert message(db, d, a.assignment_id, "advertise", s.advertise().to_json(), 2.0)["index"] >= 1
    late = checkin(db, device(db), now=2.5)

    # Execute: only two send their shares before the share-keys deadline (2 + 5 s)
    roster_json = state(db, devices[0], answers[0].assignment_id, 3.0)["roster"]
    roster = {int(i): AdvertisedKeys.from_json(k) for i, k in roster_json.items()}
    for d, a, s, index in list(zip(devices, answers, sessions, sorted(roster), strict=True))[:2]:
        assert "shared_with" in message(
            db, d, a.assignment_id, "share_keys", shares_to_json(s.share_keys(index, roster)), 3.0
        )
    after = state(db, devices[0], answers[0].assignment_id, 8.0)

    # Assert: check-ins closed with the roster; the round is abandoned, nothing to unmask; a new one opens
    assert isinstance(late, Refused) and "closed its check-ins" in late.message
    assert after["phase"] == "done" and after["round_status"] == "abandoned"
    assert "only 2 devices shared keys" in after["outcome"]
    closed = round_by_id(db, first.id)
    why = (closed.stopped_phase, closed.devices_had, closed.devices_needed, closed.ended_by)
    assert why == ("share_keys", 2, 3, "deadline") and closed.close_reason == after["outcome"]
    assert current_round(db).id != first.id


def test_the_roster_waits_for_capacity_and_for_a_device_that_never_advertises_as_long_again(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: target 4, capacity 6; six devices check in, four advertise at once
    make_population(db, biased_model, **{**SECURE, "oversampling": 1.5})
    devices = [device(db) for _ in range(6)]
    answers = [checkin(db, d, now=0.5) for d in devices]
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 0.5)["parameters"])
    for d, a in list(zip(devices, answers, strict=True))[:4]:
        message(db, d, a.assignment_id, "advertise", DeviceSession(params).advertise().to_json(), 1.0)
    at_target = state(db, devices[0], answers[0].assignment_id, 1.0)

    # Execute: a fifth advertises; the sixth never does (it vanished after its check-in)
    message(
        db,
        devices[4],
        answers[4].assignment_id,
        "advertise",
        DeviceSession(params).advertise().to_json(),
        1.5,
    )
    waiting = state(db, devices[0], answers[0].assignment_id, 1.9)
    closed = state(db, devices[0], answers[0].assignment_id, 2.0)
    late = checkin(db, device(db), now=2.0)

    # Assert: the roster did not close at the target (training comes after the keys), and waited
    # for the sixth as long again as the round took to fill (1 s); then it went out to the five
    assert at_target["phase"] == "advertise" and waiting["phase"] == "advertise"
    assert closed["phase"] == "share_keys" and len(closed["roster"]) == 5
    assert isinstance(late, Refused) and "closed its check-ins" in late.message
    assert late.retry_after == 10.0  # the population's retry window, not the round's far deadline
    assert current_round(db).metrics["secure_advertise_seconds"] == 2.0


def test_once_enough_inputs_are_in_a_straggler_is_waited_for_as_long_again_and_counts_as_dropped(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: four devices advertise at check-in (t=1) and share keys while training (t=2)
    make_population(
        db, biased_model, **{**SECURE, "secure": {**SECURE["secure"], "masked_input_seconds": 60}}
    )
    devices, answers, sessions, params, indices = _keys_shared(db, 4, 1.0, 1.0, 2.0)
    first = current_round(db)
    zero = np.zeros(params.vector_length, np.uint64)

    def masked(k: int, now: float) -> bytes:
        ciphertexts = ciphertexts_from_json(
            state(db, devices[k], answers[k].assignment_id, now)["ciphertexts"], 4
        )
        return encode_vector(sessions[k].masked_input(zero, ciphertexts), params)

    # Execute: three (min_reports) send their masked input at t=4, 2 s into the phase; the
    # fourth is still training
    inputs = [masked(k, 4.0) for k in range(4)]
    for k in range(3):
        send_masked_input(db, devices[k], answers[k].assignment_id, sessions[k], inputs[k], 4.0)
    waiting = state(db, devices[0], answers[0].assignment_id, 5.9)
    moved_on = state(db, devices[0], answers[0].assignment_id, 6.0)
    late = send_masked_input(db, devices[3], answers[3].assignment_id, sessions[3], inputs[3], 6.0)
    confirm(db, devices, answers, range(3), 6.25)
    for k in range(3):
        message(
            db,
            devices[k],
            answers[k].assignment_id,
            "unmasking",
            sessions[k].unmask(moved_on["survivors"]).to_json(),
            6.5,
        )

    # Assert: at 4 + 2 s (straggler_wait 1 x the phase's pace) the phase went on without the
    # fourth, whose masks the others' shares removed: the round committed with three inputs
    assert waiting["phase"] == "masked_input"
    assert moved_on["phase"] == "consistency" and moved_on["survivors"] == sorted(indices[:3])
    assert isinstance(late, Refused) and late.status == 409
    closed = round_by_id(db, first.id)
    assert closed.status == "committed" and closed.metrics["secure_survivors"] == 3
    phases = {p: closed.metrics[f"secure_{p}_seconds"] for p in secure_rounds.PHASES}
    assert phases == {
        "advertise": 1.0,
        "share_keys": 1.0,
        "masked_input": 4.0,
        "consistency": 0.25,
        "unmasking": 0.25,
    }


def _one_round(db: sessionmaker[Session], start: float) -> list[str]:
    """Four new devices take a whole secure round from `start`: the phases take 1, 1, 1 and 4 s."""
    devices, answers, sessions, params, _ = _keys_shared(db, 4, start, start + 1, start + 2)
    zero = np.zeros(params.vector_length, np.uint64)
    for d, a, s in zip(devices, answers, sessions, strict=True):
        ciphertexts = ciphertexts_from_json(state(db, d, a.assignment_id, start + 3)["ciphertexts"], 4)
        send_masked_input(
            db, d, a.assignment_id, s, encode_vector(s.masked_input(zero, ciphertexts), params), start + 3
        )
    survivors = state(db, devices[0], answers[0].assignment_id, start + 3)["survivors"]
    confirm(db, devices, answers, range(4), start + 3)
    for d, a, s in zip(devices, answers, sessions, strict=True):
        # Once enough shares are in, the round commits and the last answers are refused: no matter.
        message(db, d, a.assignment_id, "unmasking", s.unmask(survivors).to_json(), start + 7)
    return devices


def test_a_device_refused_by_a_closed_roster_is_told_to_come_back_during_the_next_round(
    db: sessionmaker[Session], biased_model: ExportedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a first round commits after phases of 1, 1, 1 and 4 s
    monkeypatch.setattr(rounds, "_draw", random.Random(0))
    make_population(db, biased_model, **SECURE)
    _one_round(db, 0.0)
    first = round_by_id(db, 1)
    second = current_round(db)
    devices = [device(db) for _ in range(4)]
    answers = [checkin(db, d, now=20.0) for d in devices]
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 20.0)["parameters"])
    for d, a in zip(devices, answers, strict=True):
        message(db, d, a.assignment_id, "advertise", DeviceSession(params).advertise().to_json(), 21.0)

    # Execute: the second round's roster closed at 21 s; 20 devices check in at 21.5 s, one at 22.5 s
    counted = {"population": "p", "kind": "training", "answer": "roster_closed"}
    before = REGISTRY.get_sample_value("orchestrator_checkins_total", counted) or 0.0
    soon = [checkin(db, device(db), now=21.5) for _ in range(20)]
    later = checkin(db, device(db), now=22.5)

    # Assert: come back once the share keys (0.5 s left of the last round's 1 s), masked input
    # (1 s) and unmasking (4 s) phases should be over, going by the last round (a phase that
    # outlasts it counts as ending now), each device at its own time over the last round's
    # length after that: not all at the next round's opening
    assert first.status == "committed" and second.id != first.id
    took = sum(first.metrics[f"secure_{p}_seconds"] for p in secure_rounds.PHASES)
    assert all(isinstance(r, Refused) and "closed its check-ins" in r.message for r in soon)
    times = sorted(r.retry_after for r in soon if isinstance(r, Refused) and r.retry_after is not None)
    assert len(times) == 20 and times[0] >= 0.5 + 1.0 + 4.0 and times[-1] < 0.5 + 1.0 + 4.0 + took
    assert times[-1] - times[0] > took / 2 and len(set(times)) == 20
    assert isinstance(later, Refused) and later.retry_after is not None
    assert 1.0 + 4.0 <= later.retry_after < 1.0 + 4.0 + took
    # the operator's metrics count these refusals apart
    assert REGISTRY.get_sample_value("orchestrator_checkins_total", counted) == before + 21


def test_a_roster_short_of_min_reports_waits_its_patience_and_then_is_abandoned_or_goes_on(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: min_reports 3, target and capacity 4; the roster has 10 s, then 5 s of patience
    patient = {**SECURE, "secure": {**SECURE["secure"], "advertise_patience_seconds": 5}}
    make_population(db, biased_model, **patient)
    first = current_round(db)
    devices = [device(db) for _ in range(6)]
    answers = [checkin(db, d, now=1.0) for d in devices[:2]]
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 1.0)["parameters"])
    for d, a in zip(devices[:2], answers, strict=True):
        message(db, d, a.assignment_id, "advertise", DeviceSession(params).advertise().to_json(), 2.0)

    # Execute: two devices at the deadline (10 s); two more check in at 12 s and advertise
    at_deadline = state(db, devices[0], answers[0].assignment_id, 11.0)
    more = [checkin(db, d, now=12.0) for d in devices[2:4]]
    for d, a in zip(devices[2:4], more, strict=True):
        message(db, d, a.assignment_id, "advertise", DeviceSession(params).advertise().to_json(), 12.5)
    closed = state(db, devices[0], answers[0].assignment_id, 12.5)

    # Assert: past its deadline with too few the roster stayed open for check-ins, and closed
    # when it filled; no abandoned round sent the first two away
    assert at_deadline["phase"] == "advertise"
    assert all(isinstance(a, checkins.Accepted) for a in more)
    assert closed["phase"] == "share_keys" and len(closed["roster"]) == 4
    assert current_round(db).id == first.id


def test_a_roster_still_short_after_its_patience_is_abandoned(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: as above; only two devices ever come
    patient = {**SECURE, "secure": {**SECURE["secure"], "advertise_patience_seconds": 5}}
    make_population(db, biased_model, **patient)
    first = current_round(db)
    devices = [device(db) for _ in range(2)]
    answers = [checkin(db, d, now=1.0) for d in devices]
    params = RoundParameters.from_json(state(db, devices[0], answers[0].assignment_id, 1.0)["parameters"])
    for d, a in zip(devices, answers, strict=True):
        message(db, d, a.assignment_id, "advertise", DeviceSession(params).advertise().to_json(), 2.0)

    # Execute
    patient_still = state(db, devices[0], answers[0].assignment_id, 14.9)
    after = state(db, devices[0], answers[0].assignment_id, 15.0)

    # Assert: abandoned at the deadline plus the patience, with nothing sent on; a new round opens
    assert patient_still["phase"] == "advertise"
    assert after["phase"] == "done" and after["round_status"] == "abandoned"
    assert "only 2 devices advertised keys" in after["outcome"]
    closed = round_by_id(db, first.id)
    assert (closed.stopped_phase, closed.devices_had, closed.ended_by) == ("advertise", 2, "deadline")
    assert closed.metrics["secure_advertise_seconds"] == 15.0
    assert current_round(db).id != first.id


def test_the_masked_inputs_wait_for_stragglers_only_once_they_could_be_unmasked(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: six devices share keys with a threshold of 0.8 (4 of a device's 5 neighbours);
    # min_reports 3 inputs would leave each survivor 2 shareholders among the survivors
    secure = {**SECURE["secure"], "masked_input_seconds": 60, "threshold": 0.8}
    make_population(db, biased_model, **{**SECURE, "target_reports": 6, "secure": secure})
    devices, answers, sessions, params, indices = _keys_shared(db, 6, 1.0, 1.0, 2.0)
    first = current_round(db)
    zero = np.zeros(params.vector_length, np.uint64)
    inputs = [
        encode_vector(
            s.masked_input(zero, ciphertexts_from_json(state(db, d, a.assignment_id, 3.0)["ciphertexts"], 6)),
            params,
        )
        for d, a, s in zip(devices, answers, sessions, strict=True)
    ]

    # Execute: three inputs at t=4 (2 s into the phase), two more from slower phones at t=7; the
    # sixth never comes
    for k in range(3):
        send_masked_input(db, devices[k], answers[k].assignment_id, sessions[k], inputs[k], 4.0)
    after_three = state(db, devices[0], answers[0].assignment_id, 6.5)
    for k in range(3, 5):
        send_masked_input(db, devices[k], answers[k].assignment_id, sessions[k], inputs[k], 7.0)
    waiting = state(db, devices[0], answers[0].assignment_id, 11.9)
    moved_on = state(db, devices[0], answers[0].assignment_id, 12.0)
    confirm(db, devices, answers, range(5), 12.25)
    for k in range(5):
        unmasking = sessions[k].unmask(moved_on["survivors"]).to_json()
        message(db, devices[k], answers[k].assignment_id, "unmasking", unmasking, 12.5)

    # Assert: three inputs (which no unmasking could have opened) did not close the phase at
    # 4 + 2 s; five did, after waiting for the sixth as long as they took (t = 7 + 5), and the
    # round committed with them
    assert after_three["phase"] == "masked_input"
    assert waiting["phase"] == "masked_input"
    assert moved_on["phase"] == "consistency" and moved_on["survivors"] == sorted(indices[:5])
    closed = round_by_id(db, first.id)
    assert closed.status == "committed" and closed.metrics["secure_survivors"] == 5


def test_partner_statements_are_checked_and_come_before_the_masked_input(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: four devices share keys with the whole roster
    make_population(db, biased_model, **SECURE)
    devices, answers, sessions, params, indices = _keys_shared(db, 4, 1.0, 1.0, 2.0)
    zero = np.zeros(params.vector_length, np.uint64)
    ciphertexts = ciphertexts_from_json(
        state(db, devices[0], answers[0].assignment_id, 3.0)["ciphertexts"], 4
    )
    body = encode_vector(sessions[0].masked_input(zero, ciphertexts), params)
    me, others = indices[0], [i for i in indices if i != indices[0]]

    def send(statement: PartnerStatement) -> Any:
        return message(db, devices[0], answers[0].assignment_id, "partners", statement.to_json(), 3.0)

    # Execute / Assert: no masked input before a statement; a statement naming a stranger, or
    # masking with fewer neighbours than the threshold, is refused; the first good one is kept
    early = message(db, devices[0], answers[0].assignment_id, "masked_input", body, 3.0)
    assert isinstance(early, Refused) and early.status == 409 and "partner statement" in early.message
    stranger = send(PartnerStatement(bytes(32), (me + 100,), None))
    assert isinstance(stranger, Refused) and "not this device's neighbours" in stranger.message
    alone = send(PartnerStatement(bytes(32), tuple(others), None))
    assert isinstance(alone, Refused) and "masked with 0 neighbours" in alone.message
    assert send(PartnerStatement(bytes(32), (), None)) == {"accepted": True}
    again = send(PartnerStatement(bytes(32), (), None))
    assert isinstance(again, Refused) and "already sent its partner statement" in again.message
    assert "received_bytes" in message(db, devices[0], answers[0].assignment_id, "masked_input", body, 3.0)
