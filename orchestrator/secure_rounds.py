"""The devices' messages of a secure round (Bonawitz et al. 2017; SecAgg+): advertising keys, sharing
them, the masked input and the unmasking answer, each checked by the pure `secure_aggregation`
package and stored; and what a device may know of its round. The phases these messages move
through, and the unmasking, are `secure_phases`' (whose names are re-exported here).

Like `rounds`, every function runs in the caller's transaction with an explicit `now`, and
refusals are returned as `Refused` values.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.db import Round, SecureMaskedInput, SecureParticipant, SecureRound
from orchestrator.rounds import counts
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import participants
from orchestrator.rounds.secure import state as secure_round_state
from orchestrator.rounds.secure.phases import (
    ADVERTISE,
    CONSISTENCY,
    MASKED_INPUT,
    SHARE_KEYS,
    UNMASKING,
    phase_started,
    round_parameters,
)
from orchestrator.rounds.secure.phases import DONE as DONE
from orchestrator.rounds.secure.phases import PHASES as PHASES
from orchestrator.rounds.secure.phases import Abandon as Abandon
from orchestrator.rounds.secure.phases import Commit as Commit
from orchestrator.rounds.secure.phases import advance as advance
from orchestrator.rounds.secure.phases import layout as layout
from orchestrator.rounds.secure.phases import phase_seconds_metric as phase_seconds_metric
from orchestrator.rounds.secure.phases import start as start
from secure_aggregation import identity, server, view
from secure_aggregation.config import ProtocolError
from secure_aggregation.device import round_graph
from secure_aggregation.messages import (
    AdvertisedKeys,
    EncryptedShares,
    UnmaskingShares,
    decode_vector,
    shares_from_json,
)


def _secure_round(session: Session, round_: Round) -> SecureRound:
    secure_round = session.get(SecureRound, round_.id)
    assert secure_round is not None
    return secure_round


def _participant(session: Session, assignment_id: str) -> SecureParticipant | None:
    return session.get(SecureParticipant, assignment_id)


def _in_phase(secure_round: SecureRound, phase: str, now: float) -> Refused | None:
    if secure_round.phase == phase:
        return None
    if secure_round.phase == DONE:
        return Refused(409, f"the secure round is over ({secure_round.outcome or 'committed'})")
    return Refused(
        409,
        f"the secure round is in its {secure_round.phase!r} phase, not {phase!r}",
        retry_after=max(0.0, secure_round.phase_deadline - now),
    )


def state(
    session: Session, round_: Round, assignment_id: str, now: float, until: str | None = None
) -> dict[str, Any]:
    """What one device may know now: the phase, and what that phase hands it (the roster, the
    ciphertexts addressed to it, the survivors), only when it takes part in that phase; and with
    `until`, only once the round has reached that phase (a device waiting for a later phase has
    no use for the current one's roster or ciphertexts, and it may ask many times meanwhile)."""
    secure_round = _secure_round(session, round_)
    participant = _participant(session, assignment_id)
    out: dict[str, Any] = {
        "phase": secure_round.phase,
        "phase_deadline": secure_round.phase_deadline,
        "seconds_left": max(0.0, secure_round.phase_deadline - now),
        "round_status": round_.status,
        "outcome": secure_round.outcome,
        "parameters": secure_round.parameters,
        "index": participant.device_index if participant is not None else None,
    }
    if participant is None or secure_round.phase in (ADVERTISE, DONE):
        return out
    if until is not None and PHASES.index(secure_round.phase) < _ORDER.index(until):
        return out
    # What the closed phases fixed, read once per server process: every device of the round asks.
    facts = participants.closed(session, secure_round)
    if secure_round.phase == SHARE_KEYS and not participant.sent_shares:
        out["roster"] = facts.roster_json
    elif secure_round.phase == MASKED_INPUT and participant.sent_shares:
        assert facts.roster is not None
        graph = round_graph(round_parameters(secure_round), facts.roster)
        index = participant.device_index
        out["ciphertexts"] = _ciphertexts_for(session, round_.id, graph, index)
    elif (
        secure_round.phase == CONSISTENCY
        and participant.sent_masked_input
        and not participant.sent_consistency
    ):
        assert facts.survivors is not None
        out["survivors"] = sorted(facts.survivors)
    elif secure_round.phase == UNMASKING and participant.confirmed and participant.sent_consistency:
        assert facts.survivors is not None and facts.signers is not None
        out["survivors"] = sorted(facts.survivors)
        out["confirmed"] = sorted(facts.signers)
        # What a device checks before it reveals anything (secure_aggregation.view): the signed
        # confirmations of the survivor set, and every survivor's partner statement.
        out["confirmations"] = facts.confirmations
        out["statements"] = facts.statements
    return out


_ORDER = (*PHASES, DONE)


def _ciphertexts_for(
    session: Session, round_id: int, graph: Mapping[int, list[int]], holder: int
) -> dict[str, str]:
    """The ciphertexts `holder`'s neighbours that shared keys sent for it, as they sent them (each
    message was checked as it came): decoding and re-encoding each was a third of the server's
    state reads at 1,000 devices, 60 neighbours each."""
    rows = session.execute(
        select(
            SecureParticipant.device_index, SecureParticipant.shares[(str(holder), "ciphertext")].as_string()
        )
        .where(
            SecureParticipant.round_id == round_id,
            SecureParticipant.sent_shares,
            SecureParticipant.device_index.in_(graph[holder]),
        )
        .order_by(SecureParticipant.device_index)
    )
    return {str(owner): ciphertext for owner, ciphertext in rows if ciphertext is not None}


def _shares_for(
    session: Session, round_id: int, graph: Mapping[int, list[int]], holder: int
) -> dict[int, EncryptedShares]:
    """What each of `holder`'s neighbours that shared keys sent for it, read in one query. The
    database extracts the holder's entry from each sender's message: every device of a round
    asks, and parsing every neighbour's whole message for each would cost O(n k^2) a round."""
    rows = session.execute(
        select(SecureParticipant.device_index, SecureParticipant.shares[str(holder)]).where(
            SecureParticipant.round_id == round_id,
            SecureParticipant.sent_shares,
            SecureParticipant.device_index.in_(graph[holder]),
        )
    )
    return {owner: EncryptedShares.from_json(shares) for owner, shares in rows}


def advertise(
    session: Session,
    round_: Round,
    assignment_id: str,
    body: Any,
    now: float,
    authority_key: bytes | None = None,
) -> dict[str, Any] | Refused:
    """Phase 1: a device's keys. With the enrollment authority's `authority_key`, only an
    advertisement that authority certified (`certified_by`)."""
    secure_round = _secure_round(session, round_)
    wrong_phase = _in_phase(secure_round, ADVERTISE, now)
    if wrong_phase is not None:
        return wrong_phase
    if _participant(session, assignment_id) is not None:
        return Refused(409, "this assignment has already advertised its keys")
    try:
        advertisement = identity.parse_advertisement(body)
        if authority_key is not None:
            certified_by(advertisement, authority_key, now)
        # No key twice in a round: an indexed lookup of this advertisement's keys, not a
        # comparison with every earlier advertisement (which made the phase O(n^2)).
        taken = participants.taken_kinds(session, round_.id, advertisement)
        server.check_advertisement(identity.keys_of(advertisement), [])
        if "agreement" in taken:
            raise ProtocolError("these keys were already advertised by another device of this round")
        if isinstance(advertisement, identity.SignedAdvertisement):
            context = round_parameters(secure_round).context
            identity.check_signed_advertisement(advertisement, context, [])
            if "device" in taken:
                raise ProtocolError("this device key already advertised keys in this round")
    except ProtocolError as e:
        return Refused(422, str(e))
    participants.record_keys(session, round_.id, advertisement)
    index = participants.next_index(session, round_.id)
    session.add(
        SecureParticipant(
            assignment_id=assignment_id,
            round_id=round_.id,
            device_index=index,
            # Signed, with its certificate, as the device sent it: the server relays it unchanged.
            keys=advertisement.to_json(),
            shares=None,
            sent_shares=False,
            sent_masked_input=False,
            unmasking=None,
            sent_unmasking=False,
        )
    )
    session.flush()
    _counted(session, secure_round, ADVERTISE)
    return {"index": index}


def certified_by(
    advertisement: AdvertisedKeys | identity.SignedAdvertisement, authority_key: bytes, now: float
) -> None:
    """ProtocolError unless the advertisement carries a certificate of the enrollment authority
    whose key the server was given, valid now. Devices check this themselves and refuse a whole
    roster with one uncertified entry: refused here, one device cannot stop its round."""
    if not isinstance(advertisement, identity.SignedAdvertisement):
        raise ProtocolError(
            "this server takes only key advertisements signed with a certificate of its enrollment "
            "authority; this one has none (enroll the device's signing key first)"
        )
    certificate = advertisement.certificate
    message = identity.Certificate.message(certificate.device_key, certificate.not_after)
    if not identity.verify(authority_key, certificate.signature, message):
        raise ProtocolError(
            "the advertisement's certificate is not signed by the enrollment authority this server "
            "and its devices trust"
        )
    if now > certificate.not_after:
        raise ProtocolError(f"the advertisement's certificate expired at {certificate.not_after}")


@dataclass(frozen=True)
class _Step:
    """What a device's message in a phase needs of its participant: the flag the step before set
    (None: only its keys), and the flag this step sets (each step is taken once)."""

    phase: str
    after: str | None
    not_after: str  # why a participant without `after` cannot take this step
    done: str
    again: str  # the refusal of a second message


_SHARE = _Step(SHARE_KEYS, None, "", "sent_shares", "this assignment has already sent its shares")
_MASK = _Step(
    MASKED_INPUT,
    "sent_shares",
    "this assignment did not share keys in this round",
    "sent_masked_input",
    "this assignment has already sent its masked input",
)
_CONFIRM = _Step(
    CONSISTENCY,
    "sent_masked_input",
    "this assignment did not send a masked input, so it is not a survivor",
    "sent_consistency",
    "this assignment has already confirmed the survivors",
)
_UNMASK = _Step(
    UNMASKING,
    "confirmed",
    "this assignment did not confirm the survivors, so it is not a survivor",
    "sent_unmasking",
    "this assignment has already sent its unmasking shares",
)


def _taking_part(
    session: Session, round_: Round, assignment_id: str, step: _Step, now: float
) -> tuple[SecureRound, SecureParticipant] | Refused:
    """The round and the participant of a device's message in `step`'s phase; refused out of its
    phase, without the step before, or a second time."""
    secure_round = _secure_round(session, round_)
    wrong_phase = _in_phase(secure_round, step.phase, now)
    if wrong_phase is not None:
        return wrong_phase
    participant = _participant(session, assignment_id)
    if participant is None:
        return Refused(409, "this assignment did not advertise keys in this round")
    if step.after is not None and not getattr(participant, step.after):
        return Refused(409, step.not_after)
    if getattr(participant, step.done):
        return Refused(409, step.again)
    return secure_round, participant


def share_keys(
    session: Session, round_: Round, assignment_id: str, body: Any, now: float
) -> dict[str, Any] | Refused:
    found = _taking_part(session, round_, assignment_id, _SHARE, now)
    if isinstance(found, Refused):
        return found
    secure_round, participant = found
    roster = participants.closed(session, secure_round).roster
    assert roster is not None
    try:
        shares = shares_from_json(body, len(roster))
        graph = round_graph(round_parameters(secure_round), roster)
        server.check_shares(participant.device_index, graph, shares)
    except ProtocolError as e:
        return Refused(422, str(e))
    participant.shares = {str(holder): message.to_json() for holder, message in shares.items()}
    participant.sent_shares = True
    _counted(session, secure_round, SHARE_KEYS)
    return {"shared_with": sorted(shares)}


def masked_input(
    session: Session, round_: Round, assignment_id: str, body: bytes, now: float
) -> dict[str, Any] | Refused:
    found = _taking_part(session, round_, assignment_id, _MASK, now)
    if isinstance(found, Refused):
        return found
    secure_round, participant = found
    if participant.partners is None:
        return Refused(409, "this assignment sent no partner statement; it comes before the masked input")
    try:
        decode_vector(body, round_parameters(secure_round))
    except ProtocolError as e:
        return Refused(422, str(e))
    session.add(SecureMaskedInput(assignment_id=assignment_id, round_id=round_.id, masked_input=body))
    participant.sent_masked_input = True
    _counted(session, secure_round, MASKED_INPUT)
    return {"received_bytes": len(body)}


def partners(
    session: Session, round_: Round, assignment_id: str, body: Any, now: float
) -> dict[str, Any] | Refused:
    """A sharer's partner statement, before its masked input: the digest of what it trained on and
    the neighbours it masked nothing with; signed (and checked here) when its advertisement was."""
    found = _taking_part(session, round_, assignment_id, _MASK, now)
    if isinstance(found, Refused):
        return found
    secure_round, participant = found
    if participant.partners is not None:
        return Refused(409, "this assignment has already sent its partner statement")
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None and facts.sharers is not None and facts.roster_digest is not None
    parameters = round_parameters(secure_round)
    graph = round_graph(parameters, facts.roster)
    index = participant.device_index
    try:
        statement = view.PartnerStatement.from_json(body)
        _check_signed(
            participant, statement.verifies, parameters.context, facts.roster_digest, "partner statement"
        )
        neighbours = set(graph[index])
        strangers = sorted(set(statement.missing) - neighbours)
        if strangers:
            raise ProtocolError(
                f"the statement names devices {strangers}, which are not this device's neighbours"
            )
        masked_with = view.partners(graph, index, statement.missing)
        if not masked_with <= facts.sharers:
            raise ProtocolError(
                f"the statement says it masked with devices {sorted(masked_with - facts.sharers)}, "
                "which shared no keys"
            )
        needed = parameters.shamir_threshold(len(neighbours))
        if len(masked_with) < needed:
            raise ProtocolError(
                f"the device masked with {len(masked_with)} neighbours; a masked input needs {needed}"
            )
    except ProtocolError as e:
        return Refused(422, str(e))
    participant.partners = statement.to_json()
    return {"accepted": True}


def _check_signed(
    participant: SecureParticipant,
    verifies: Callable[[bytes, str, bytes], bool],
    context: str,
    roster: bytes,
    what: str,
) -> None:
    """ProtocolError unless `verifies` with the participant's certified key (a participant that
    advertised without one signs nothing)."""
    advertisement = identity.parse_advertisement(participant.keys)
    if not isinstance(advertisement, identity.SignedAdvertisement):
        return
    if not verifies(advertisement.certificate.device_key, context, roster):
        raise ProtocolError(
            f"the {what} is not signed by this device's certified key for this round and roster"
        )


def consistency(
    session: Session, round_: Round, assignment_id: str, body: Any, now: float
) -> dict[str, Any] | Refused:
    """A survivor's confirmation of the survivor set, over the roster and the digest of what it
    trained on; signed (and checked here) when its advertisement was."""
    found = _taking_part(session, round_, assignment_id, _CONFIRM, now)
    if isinstance(found, Refused):
        return found
    secure_round, participant = found
    facts = participants.closed(session, secure_round)
    assert facts.survivors is not None and facts.roster_digest is not None
    if not participant.confirmed:
        return Refused(409, "this assignment is not among the survivors")
    survivors = sorted(facts.survivors)
    try:
        confirmation = view.Confirmation.from_json(body)
        _check_signed(
            participant,
            lambda key, context, roster: confirmation.verifies(key, context, roster, survivors),
            round_parameters(secure_round).context,
            facts.roster_digest,
            "confirmation",
        )
    except ProtocolError as e:
        return Refused(422, str(e))
    participant.consistency, participant.sent_consistency = confirmation.to_json(), True
    _counted(session, secure_round, CONSISTENCY)
    return {"accepted": True}


def unmasking(
    session: Session, round_: Round, assignment_id: str, body: Any, now: float
) -> dict[str, Any] | Refused:
    found = _taking_part(session, round_, assignment_id, _UNMASK, now)
    if isinstance(found, Refused):
        return found
    secure_round, participant = found
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None and facts.sharers is not None and facts.survivors is not None
    parameters = round_parameters(secure_round)
    graph = round_graph(parameters, facts.roster)
    index = participant.device_index
    sharers, survivors = facts.sharers, facts.survivors
    try:
        message = UnmaskingShares.from_json(body, len(facts.roster))
        commitments = {
            owner: {index: shares} for owner, shares in _shares_for(session, round_.id, graph, index).items()
        }
        missing = view.PartnerStatement.from_json(participant.partners).missing
        server.check_unmasking(parameters, index, graph, sharers, survivors, message, commitments, missing)
    except ProtocolError as e:
        return Refused(422, str(e))
    participant.unmasking, participant.sent_unmasking = message.to_json(), True
    _counted(session, secure_round, UNMASKING)
    return {"accepted": True}


def _counted(session: Session, secure_round: SecureRound, phase: str) -> None:
    """A message of `phase` accepted: counted on the secure round's row, in one statement."""
    counts.count_secure(session, secure_round, secure_round_state.message(phase))


def count_leaving(session: Session, round_id: int, assignment_id: str) -> None:
    """A device's assignment in a secure round closed on its own (it aborted): one fewer open at
    the stage it had reached, on the secure round's row."""
    secure_round = session.get(SecureRound, round_id)
    if secure_round is None or secure_round.phase == DONE:
        return
    participant = _participant(session, assignment_id)
    sent = (
        {}
        if participant is None
        else {
            SHARE_KEYS: participant.sent_shares,
            MASKED_INPUT: participant.sent_masked_input,
            CONSISTENCY: participant.sent_consistency,
            UNMASKING: participant.sent_unmasking,
        }
    )
    at = secure_round_state.stage(participant is not None, sent)
    counts.count_secure(session, secure_round, secure_round_state.leaving(at))


def json_body(body: bytes) -> Any | Refused:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return Refused(422, "the body must be JSON")


def deadline_passed(session: Session, round_: Round, now: float) -> bool:
    """Whether the round's current phase has run out of time (and `advance` would close it)."""
    secure_round = _secure_round(session, round_)
    return secure_round.phase != DONE and now >= secure_round.phase_deadline


# The soonest a device refused by a closed roster is asked to come back (before its own jitter).
MIN_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class ComeBack:
    """When devices refused by a round's closed roster should check in again (`at`)."""

    left: float  # about how long until the round ends and the next one takes check-ins
    spread: float  # over how long after that the refused devices come back (a round's length)
    longest: float

    def at(self, draw: float) -> float:
        """One device's time, `draw` uniform in [0, 1): the time left (at least MIN_RETRY_SECONDS,
        at most `longest`), then `draw` times the spread (at most `longest`)."""
        left = min(self.longest, max(MIN_RETRY_SECONDS, self.left))
        return float(left + draw * min(self.longest, self.spread))


def next_round_in(session: Session, round_: Round, now: float, longest: float) -> ComeBack:
    """When a device refused by this round's closed roster should check in again: about when this
    round ends and the next one takes check-ins (the time its open phases took in the population's
    last committed secure round, less what the current phase has used), then at a random time over
    that last round's whole length. Pace steering, as for a full plaintext round: the refused
    devices come back spread over the next round, not all at its opening; told only the time
    left, those that came back a little early were refused again with less and less time left,
    down to MIN_RETRY_SECONDS, and a round's last phases each answered ~35 such check-ins a
    second (12 rounds of the main job: 2,857 refused check-ins against 449 accepted). Before
    any commit: `longest` (the population's retry window)."""
    last = session.scalars(
        select(Round.metrics)
        .where(
            Round.population_id == round_.population_id,
            Round.kind == round_.kind,
            Round.status == "committed",
            Round.id < round_.id,
        )
        .order_by(Round.id.desc())
        .limit(1)
    ).first()
    secure_round = _secure_round(session, round_)
    if last is None or secure_round.phase not in PHASES:
        return ComeBack(longest, 0.0, longest)
    took: list[float] = [float(last.get(phase_seconds_metric(p), longest)) for p in PHASES]
    current = PHASES.index(secure_round.phase)
    used = now - phase_started(round_)
    left = max(0.0, took[current] - used) + sum(took[current + 1 :])
    return ComeBack(left, sum(took), longest)


def parameters(session: Session, round_id: int) -> dict[str, Any]:
    """The round's parameters (JSON), as a device needs them to advertise its keys."""
    secure_round = session.get(SecureRound, round_id)
    assert secure_round is not None, f"round {round_id} is not a secure round"
    return dict(secure_round.parameters)


def open_phases(session: Session) -> frozenset[tuple[int, str]]:
    """(round id, phase) of every secure round under way, in every population."""
    rows = session.execute(select(SecureRound.round_id, SecureRound.phase).where(SecureRound.phase != DONE))
    return frozenset((round_id, phase) for round_id, phase in rows)


def accepting(session: Session, round_: Round) -> bool:
    """Whether the round still takes check-ins: only until its roster closes."""
    return _secure_round(session, round_).phase == ADVERTISE
