"""The secure phases of the round state machine alone: verdicts and deadlines from a round's
counters, without a database. (The counters each event moves are applied by the database alone:
tests/orchestrator/test_secure_counters.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from orchestrator.rounds.secure import state as secure_round_state
from orchestrator.rounds.secure.state import (
    ADVERTISE,
    CONSISTENCY,
    DONE,
    MASKED_INPUT,
    SHARE_KEYS,
    UNMASKING,
    Rules,
    Verdict,
)
from orchestrator.rounds.state import ABANDONED, DEADLINE, DROPOUTS, REFUSALS


@dataclass
class Row:
    """A secure round's counters as plain fields (the `SecureRound` row has the same)."""

    advertised: int = 0
    sharers: int = 0
    senders: int = 0
    signers: int = 0
    responders: int = 0
    left_before_keys: int = 0
    left_before_shares: int = 0
    left_before_input: int = 0
    left_before_confirmation: int = 0


RULES = Rules(
    enough=3,
    capacity=5,
    target=4,
    straggler_wait=None,
    patient_until=30.0,
    seconds={SHARE_KEYS: 5.0, MASKED_INPUT: 20.0, CONSISTENCY: 8.0, UNMASKING: 8.0},
)


def _never() -> bool:
    raise AssertionError("the unmasking check was asked for when it did not matter")


def over(
    phase: str, row: Row, accepted: int = 5, now: float = 1.0, deadline: float = 10.0, rules: Rules = RULES
) -> Verdict:
    counts = secure_round_state.counts_of(row, accepted)
    return secure_round_state.phase_over(phase, counts, accepted, rules, now, deadline, 0.0, _never)


def test_the_roster_closes_full_with_every_device_advertised_and_not_before() -> None:
    assert over(ADVERTISE, Row(advertised=4), accepted=5) == Verdict(False, False, 10.0)
    assert over(ADVERTISE, Row(advertised=5), accepted=5) == Verdict(True, False, 10.0)
    # not full: it waits for check-ins until its deadline
    assert over(ADVERTISE, Row(advertised=4), accepted=4).over is False
    assert over(ADVERTISE, Row(advertised=4), accepted=4, now=10.0) == Verdict(True, True, 10.0)


def test_a_roster_short_at_its_deadline_waits_its_patience_once() -> None:
    short = Row(advertised=2)

    first = over(ADVERTISE, short, accepted=2, now=10.0, deadline=10.0)
    second = over(ADVERTISE, short, accepted=2, now=30.0, deadline=first.deadline)

    assert first == Verdict(False, False, 30.0)
    assert second == Verdict(True, True, 30.0)


def test_the_phases_close_once_no_open_device_owes_their_message() -> None:
    assert over(SHARE_KEYS, Row(advertised=5, sharers=4)).over is False
    assert over(SHARE_KEYS, Row(advertised=5, sharers=4, left_before_shares=1)).over is True
    assert over(MASKED_INPUT, Row(advertised=5, sharers=5, senders=3)).over is False
    assert over(MASKED_INPUT, Row(advertised=5, sharers=5, senders=4)).over is True  # the target
    assert over(MASKED_INPUT, Row(advertised=5, sharers=3, senders=3, left_before_shares=2)).over
    assert over(CONSISTENCY, Row(advertised=5, sharers=5, senders=4, signers=3)).over is False
    assert over(CONSISTENCY, Row(advertised=5, sharers=5, senders=4, signers=4)).over is True
    with pytest.raises(ValueError, match="unmasking"):
        over(UNMASKING, Row())


def test_once_enough_answered_a_phase_waits_for_stragglers_as_long_again() -> None:
    patient = Rules(**{**RULES.__dict__, "straggler_wait": 1.0})
    row = Row(advertised=5, sharers=3)

    early = over(SHARE_KEYS, row, now=2.0, rules=patient)
    later = over(SHARE_KEYS, row, now=4.0, deadline=early.deadline, rules=patient)

    assert early == Verdict(False, False, 4.0)  # 2 s to get there: 2 s more for the others
    assert later == Verdict(True, True, 4.0)
    impatient = Rules(**{**RULES.__dict__, "straggler_wait": 0.0})
    assert over(SHARE_KEYS, row, now=2.0, rules=impatient) == Verdict(True, False, 2.0)
    assert over(SHARE_KEYS, Row(advertised=5, sharers=2), now=2.0, rules=patient).deadline == 10.0


def test_masked_inputs_stop_waiting_only_once_they_could_be_unmasked() -> None:
    patient = Rules(**{**RULES.__dict__, "straggler_wait": 1.0})
    counts = secure_round_state.counts_of(Row(advertised=5, sharers=5, senders=3), 5)
    asked: list[bool] = []

    def unmaskable(answer: bool) -> bool:
        asked.append(answer)
        return answer

    waits = secure_round_state.phase_over(
        MASKED_INPUT, counts, 5, patient, 2.0, 10.0, 0.0, lambda: unmaskable(False)
    )
    stops = secure_round_state.phase_over(
        MASKED_INPUT, counts, 5, patient, 2.0, 10.0, 0.0, lambda: unmaskable(True)
    )

    assert waits == Verdict(False, False, 10.0)
    assert stops == Verdict(False, False, 4.0)
    assert asked == [False, True]


def test_a_phase_with_too_few_devices_abandons_the_round_and_says_why() -> None:
    by_deadline = secure_round_state.too_few(SHARE_KEYS, 2, RULES, refused=0, timed_out=True)
    by_refusals = secure_round_state.too_few(MASKED_INPUT, 2, RULES, refused=1, timed_out=True)
    by_dropouts = secure_round_state.too_few(CONSISTENCY, 1, RULES, refused=0, timed_out=False)

    assert by_deadline is not None and by_deadline.status == ABANDONED
    assert by_deadline.reason == (
        "only 2 devices shared keys in the share_keys phase; a secure round needs at least 3"
    )
    assert (by_deadline.phase, by_deadline.had, by_deadline.needed) == (SHARE_KEYS, 2, 3)
    assert by_deadline.ended_by == DEADLINE
    assert by_refusals is not None and by_refusals.ended_by == REFUSALS
    assert by_dropouts is not None and by_dropouts.ended_by == DROPOUTS
    assert secure_round_state.too_few(ADVERTISE, 3, RULES, 0, True) is None


def test_the_next_phase_opens_with_its_own_deadline_and_the_unmasking_ends_the_round() -> None:
    assert secure_round_state.next_deadline(SHARE_KEYS, RULES, 7.0) == (MASKED_INPUT, 27.0)
    assert secure_round_state.next_deadline(UNMASKING, RULES, 7.0)[0] == DONE
    assert (
        secure_round_state.unmasking_over(can_unmask=False, timed_out=False, everyone_answered=False) is False
    )
    assert secure_round_state.unmasking_over(True, False, False)
    assert secure_round_state.unmasking_over(False, True, False)
    assert secure_round_state.unmasking_over(False, False, True)
