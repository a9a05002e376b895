"""A training round under secure aggregation (Bonawitz et al. 2017; SecAgg+): its phases acted on.

A secure round is an ordinary round (check-in, assignments, capacity = target x oversampling)
whose reports are replaced by phases, each with its own deadline: advertise, share keys, masked
input, consistency, unmasking. Which phase a round is in, when a phase closes and whether it had
enough devices is the round state machine's (`secure_round_state`, pure, from the counters on the
secure round's row); this module acts on its verdicts: it drops the devices a closed phase left
behind, opens the next phase, confirms the survivors, and unmasks the sum.

The consistency check (Bonawitz et al. 2017, with the globals and task of Pasquini et al. 2022):
each survivor signs the survivor set with the hashes of the globals and task it trained on. The
server keeps the signatures that verify and agree with most survivors' hashes (the others' senders
count as dropped: their inputs leave the sum and their mask keys are reconstructed), and relays
them; a device unmasks only after checking its neighbours' (device_runtime/secure_round.py). Its
deadline is the unmasking phase's.

Only the masked input needs the device's update, so a device advertises its keys right after it
checks in and sends its shares while it trains: the advertise phase is the round's check-in time,
the masked-input phase its training time, and after training only the masked input and the
unmasking answer remain. Like a plaintext round at its target reports, the masked-input phase
closes at `target` inputs: the slowest of the oversampled devices count as dropped, and their
masks are removed with their shares; and once enough devices have answered a phase, it waits for
stragglers (a device that vanished silently looks like one) only a while sized from the phase's
own pace, not to its deadline (masked inputs are enough once they could be unmasked: every secret
has its threshold of holders among their senders). A phase that closes with too few devices, or
with a device whose secrets too few neighbours hold, abandons the round: no shares are asked for
and nothing is unmasked. At the end the server holds the sum of the survivors' inputs and never
any single one unmasked; the masked inputs are deleted. Each phase change is announced
(`phase_changes`) to the devices waiting for it, and each phase's duration is kept in the
round's metrics.

Like `rounds`, every function runs in the caller's transaction with an explicit `now`, and
refusals are returned as `Refused` values. The cryptography and the checks of each message are the
pure `secure_aggregation` package, the messages are stored by `secure_rounds`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np
from sqlalchemy import and_, delete, select, true, update
from sqlalchemy.orm import Session

from contracts.manifest import Manifest
from contracts.params import Params
from orchestrator.db import Assignment, Round, SecureMaskedInput, SecureParticipant, SecureRound
from orchestrator.observability.on_commit import on_commit
from orchestrator.populations.locks import lock_admissions
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds import state as round_state
from orchestrator.rounds.secure import participants
from orchestrator.rounds.secure import state as machine
from orchestrator.rounds.secure.phase_changes import PHASE_CHANGES
from secure_aggregation import server, survivors
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import round_graph
from secure_aggregation.messages import UnmaskingShares, decode_vector
from secure_aggregation.neighbours import suggested_neighbours
from secure_aggregation.quantization import Layout, dequantize_sum
from secure_aggregation.view import PartnerStatement, quorum

# The phases' names are the state machine's (re-exported: the routes and tests name them from here).
ADVERTISE, SHARE_KEYS, MASKED_INPUT = machine.ADVERTISE, machine.SHARE_KEYS, machine.MASKED_INPUT
CONSISTENCY, UNMASKING, DONE, PHASES = machine.CONSISTENCY, machine.UNMASKING, machine.DONE, machine.PHASES


def phase_seconds_metric(phase: str) -> str:
    """The round metric with how long `phase` lasted (set when it closes, committed or abandoned)."""
    return f"secure_{phase}_seconds"


def phase_started(round_: Round) -> float:
    """When the current phase opened: the round's opening plus the phases closed before it."""
    names = [phase_seconds_metric(p) for p in PHASES]
    return round_.opened_at + sum(v for k, v in round_.metrics.items() if k in names)


def _close_phase(round_: Round, phase: str, now: float) -> None:
    """Record how long the phase that closes now lasted: where a round's time goes."""
    round_.metrics = {**round_.metrics, phase_seconds_metric(phase): now - phase_started(round_)}


@dataclass(frozen=True)
class Commit:
    """The round unmasked: the mean of the survivors' clipped, quantized deltas (uniform weights)."""

    mean_delta: Params
    survivors: int
    unmask_seconds: float  # summing the masked inputs, removing the masks, dequantizing


@dataclass(frozen=True)
class Abandon:
    """The round cannot commit: how it closes (the phase, the devices it had and needed, and
    what ended it)."""

    closing: round_state.Closing

    @property
    def reason(self) -> str:
        return self.closing.reason


def layout(manifest: Manifest) -> Layout:
    """The order in which a device flattens its dense delta: the manifest's global tensors."""
    return Layout.of(manifest.global_params)


def start(
    session: Session, round_: Round, population_name: str, settings: PopulationSettings, manifest: Manifest
) -> SecureRound:
    """The secure part of a newly opened training round, in its advertise phase."""
    secure = settings.secure
    parameters = RoundParameters(
        # Random per round: keys and ciphertexts of one round are useless in any other.
        context=f"{population_name}/{round_.id}/{secrets.token_hex(16)}",
        vector_length=layout(manifest).length,
        bits=secure.bits,
        clip_norm=secure.clip_norm,
        max_summands=round_.capacity,
        neighbours=suggested_neighbours(round_.capacity) if secure.neighbours is None else secure.neighbours,
        threshold=secure.threshold,
        min_survivors=round_.min_reports,
    )
    secure_round = SecureRound(
        round_id=round_.id,
        phase=ADVERTISE,
        phase_deadline=round_.opened_at + secure.advertise_seconds,
        parameters=parameters.to_json(),
        outcome="",
        **dict.fromkeys(machine.COUNTERS, 0),
    )
    session.add(secure_round)
    return secure_round


def round_parameters(secure_round: SecureRound) -> RoundParameters:
    return RoundParameters.from_json(secure_round.parameters)


def _drop_outstanding(
    session: Session,
    round_: Round,
    secure_round: SecureRound,
    keeping: participants.Flag | None,
    kept: int,
    now: float,
) -> None:
    """Assignments still open whose participant does not have the flag `keeping` (None: all of
    them) are dropped: those that did not take the phase just closed (every open device below
    stage `kept`, as the machine counts them). Two statements: the drop and its count."""
    still_open = and_(Assignment.round_id == round_.id, Assignment.status == "assigned")
    if keeping is not None:
        kept_ids = select(SecureParticipant.assignment_id).where(
            SecureParticipant.round_id == round_.id, keeping
        )
        still_open = and_(still_open, Assignment.id.not_in(kept_ids))
    dropped = session.execute(
        update(Assignment)
        .where(still_open)
        .values(status="dropped", finished_at=now)
        .execution_options(synchronize_session="fetch")
    )
    round_.dropped += dropped.rowcount  # type: ignore[attr-defined]
    round_counts.count_secure(
        session, secure_round, machine.dropped_below(secure_round, round_.accepted, kept)
    )


# The flag a phase's close keeps (KEPT_AT_CLOSE says which stage that is).
_KEEPING: dict[str, participants.Flag] = {
    ADVERTISE: true(),
    SHARE_KEYS: SecureParticipant.sent_shares,
    MASKED_INPUT: SecureParticipant.sent_masked_input,
    CONSISTENCY: SecureParticipant.confirmed,
}


def rules(round_: Round, secure_round: SecureRound, settings: PopulationSettings) -> machine.Rules:
    secure = settings.secure
    return machine.Rules(
        enough=_enough(secure_round),
        capacity=round_.capacity,
        # Inputs fewer than a quorum of the roster cannot be unmasked (devices reveal only for a
        # survivor set more than half the roster confirms): with a large oversampling the phase
        # waits for more than its target.
        target=max(round_.target, quorum(secure_round.advertised)),
        straggler_wait=secure.straggler_wait,
        patient_until=round_.opened_at + secure.advertise_seconds + secure.advertise_patience_seconds,
        seconds={
            SHARE_KEYS: secure.share_keys_seconds,
            MASKED_INPUT: secure.masked_input_seconds,
            CONSISTENCY: secure.unmasking_seconds,
            UNMASKING: secure.unmasking_seconds,
        },
    )


def advance(
    session: Session, round_: Round, settings: PopulationSettings, manifest: Manifest, now: float
) -> Commit | Abandon | None:
    """Close the phases that are over (the state machine's verdicts, from the counters on the
    secure round's row); a Commit or Abandon when the round ends, else None."""
    secure_round = session.get(SecureRound, round_.id)
    assert secure_round is not None
    laws = rules(round_, secure_round, settings)
    while secure_round.phase != DONE:
        phase = secure_round.phase
        if phase == UNMASKING:
            return _finish(session, round_, secure_round, layout(manifest), now)
        n = machine.counts_of(secure_round, round_.accepted)
        verdict = machine.phase_over(
            phase,
            n,
            round_.accepted,
            laws,
            now,
            secure_round.phase_deadline,
            phase_started(round_),
            lambda: _unmaskable(session, secure_round),
        )
        if verdict.deadline != secure_round.phase_deadline:
            secure_round.phase_deadline = verdict.deadline
        if not verdict.over:
            return None
        had = machine.had(phase, n)
        if phase == MASKED_INPUT:
            had = _choose_survivors(session, round_, secure_round, now)
        _drop_outstanding(session, round_, secure_round, _KEEPING[phase], machine.KEPT_AT_CLOSE[phase], now)
        _next_phase(session, round_, secure_round, laws, now)
        problem = machine.too_few(phase, had, laws, round_.invalid, verdict.timed_out)
        if problem is None and phase in (MASKED_INPUT, CONSISTENCY):
            problem = _below_quorum(phase, had, secure_round, round_.invalid, verdict.timed_out)
        if problem is None and phase == SHARE_KEYS:
            problem = _unreachable(session, round_, secure_round, verdict.timed_out)
        if problem is not None:
            return _abandon(session, round_, secure_round, problem, now)
    return None


def _choose_survivors(session: Session, round_: Round, secure_round: SecureRound, now: float) -> int:
    """Mark the survivors among the masked inputs' senders (secure_aggregation.survivors: one of
    each two that disagree on their masks, the most common inputs, the largest part their masks
    connect) and drop the other senders at once; the number of survivors."""
    rows = session.execute(
        select(SecureParticipant.device_index, SecureParticipant.partners).where(
            SecureParticipant.round_id == round_.id, SecureParticipant.sent_masked_input
        )
    )
    statements = {index: PartnerStatement.from_json(data) for index, data in rows}
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None
    chosen = survivors.choose(round_graph(round_parameters(secure_round), facts.roster), statements)
    session.execute(
        update(SecureParticipant)
        .where(SecureParticipant.round_id == round_.id, SecureParticipant.device_index.in_(chosen.survivors))
        .values(confirmed=True)
    )
    if chosen.left_out:
        # Senders left out of the sum are told so by the survivor set; they are dropped now rather
        # than waited for at the consistency check, and counted as left there.
        left_out = select(SecureParticipant.assignment_id).where(
            SecureParticipant.round_id == round_.id,
            SecureParticipant.device_index.in_(sorted(chosen.left_out)),
        )
        dropped = session.execute(
            update(Assignment)
            .where(Assignment.id.in_(left_out), Assignment.status == "assigned")
            .values(status="dropped", finished_at=now)
            .execution_options(synchronize_session="fetch")
        )
        count = int(dropped.rowcount)  # type: ignore[attr-defined]
        round_.dropped += count
        if count:
            round_counts.count_secure(session, secure_round, round_state.Count({machine.LEFT[3]: count}))
    return len(chosen.survivors)


def _below_quorum(
    phase: str, had: int, secure_round: SecureRound, refused: int, timed_out: bool
) -> round_state.Closing | None:
    """Devices reveal only for a survivor set that more than half the roster confirmed: a round
    whose survivors (or confirmations) are fewer cannot be unmasked."""
    needed = quorum(secure_round.advertised)
    if had >= needed:
        return None
    what = "survivors" if phase == MASKED_INPUT else "confirmations"
    reason = (
        f"{had} {what} of a roster of {secure_round.advertised}; devices reveal shares only for a "
        f"survivor set that more than half the roster ({needed}) confirmed"
    )
    return round_state.shortfall(phase, had, needed, refused, timed_out, reason)


def _next_phase(
    session: Session, round_: Round, secure_round: SecureRound, laws: machine.Rules, now: float
) -> None:
    _close_phase(round_, secure_round.phase, now)
    on_commit(session, PHASE_CHANGES.notify)
    secure_round.phase, secure_round.phase_deadline = machine.next_deadline(secure_round.phase, laws, now)


def _enough(secure_round: SecureRound) -> int:
    """Devices a phase needs to go on: the round's minimum, and never fewer than 3."""
    return max(3, round_parameters(secure_round).min_survivors)


def _unreachable(
    session: Session, round_: Round, secure_round: SecureRound, timed_out: bool
) -> round_state.Closing | None:
    """A sharer whose secrets reached fewer neighbours than the threshold could never be unmasked."""
    parameters = round_parameters(secure_round)
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None and facts.sharers is not None
    graph = round_graph(parameters, facts.roster)
    for owner in sorted(facts.sharers):
        t = parameters.shamir_threshold(len(graph[owner]))
        holders = len(set(graph[owner]) & facts.sharers)
        if holders < t:
            reason = f"device {owner}'s shares reached {holders} neighbours; its secrets need {t}"
            return round_state.shortfall(SHARE_KEYS, holders, t, round_.invalid, timed_out, reason)
    return None


def _unmaskable(session: Session, secure_round: SecureRound) -> bool:
    """Whether a round whose survivors are the masked inputs' senders so far could be unmasked,
    at best (every survivor answers the unmasking)."""
    parameters = round_parameters(secure_round)
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None and facts.sharers is not None
    senders = participants.indices_where(session, secure_round.round_id, SecureParticipant.sent_masked_input)
    graph = round_graph(parameters, facts.roster)
    return server.unmask_problem(parameters, graph, facts.sharers, senders, senders) is None


def _abandon(
    session: Session, round_: Round, secure_round: SecureRound, closing: round_state.Closing, now: float
) -> Abandon:
    lock_admissions(session, [round_])  # its check-ins admitted so far have committed; no more
    _drop_outstanding(session, round_, secure_round, None, machine.ALL, now)
    on_commit(session, PHASE_CHANGES.notify)
    secure_round.phase, secure_round.outcome = DONE, closing.reason[:500]
    session.execute(delete(SecureMaskedInput).where(SecureMaskedInput.round_id == round_.id))
    return Abandon(closing)


def _finish(
    session: Session,
    round_: Round,
    secure_round: SecureRound,
    flat: Layout,
    now: float,
) -> Commit | Abandon | None:
    timed_out = now >= secure_round.phase_deadline
    parameters = round_parameters(secure_round)
    facts = participants.closed(session, secure_round)
    assert facts.roster is not None and facts.sharers is not None
    assert facts.survivors is not None and facts.refused is not None
    graph = round_graph(parameters, facts.roster)
    sharers, refused = facts.sharers, facts.refused
    # Every survivor's input is in the sum (those that did not confirm too: their neighbours reveal
    # their seeds against their partner statements).
    survivors = facts.survivors
    # Who answered decides whether the sum can be unmasked yet: their answers are read only then.
    responders = (
        participants.indices_where(session, round_.id, SecureParticipant.sent_unmasking)
        if secure_round.responders
        else set()
    )
    settled: set[int] = set()
    problem = server.unmask_problem(
        parameters,
        graph,
        sharers,
        survivors,
        responders,
        refused,
        participants.settled_owners(secure_round),
        settled,
    )
    participants.settle(session, secure_round, settled)
    if not machine.unmasking_over(problem is None, timed_out, set(responders) == survivors):
        return None  # more answers may still come
    _close_phase(round_, UNMASKING, now)
    if problem is not None:
        ended_by = round_state.DEADLINE if timed_out else round_state.DROPOUTS
        closing = round_state.Closing(
            round_state.ABANDONED, problem, UNMASKING, len(responders), None, ended_by
        )
        return _abandon(session, round_, secure_round, closing, now)
    started = time.perf_counter()
    responses = {
        i: UnmaskingShares.from_json(answer, len(facts.roster))
        for i, answer in session.execute(
            select(SecureParticipant.device_index, SecureParticipant.unmasking).where(
                SecureParticipant.round_id == round_.id, SecureParticipant.sent_unmasking
            )
        )
    }
    total = server.MaskedSum(parameters)
    # One masked input in memory at a time: memory is O(model), not O(devices x model).
    for (blob,) in session.execute(
        select(SecureMaskedInput.masked_input)
        .join(SecureParticipant, SecureParticipant.assignment_id == SecureMaskedInput.assignment_id)
        .where(SecureMaskedInput.round_id == round_.id, SecureParticipant.confirmed)
        .execution_options(yield_per=8)
    ):
        total.add(decode_vector(blob, parameters))
    try:
        unmasked = server.unmask(
            parameters,
            total.total,
            participants.roster_of(session, round_.id),
            graph,
            sharers,
            survivors,
            responses,
            refused,
        )
    except server.CannotUnmask as e:
        return _abandon(session, round_, secure_round, _failed_check(str(e), len(responses)), now)
    confirmed = select(SecureParticipant.assignment_id).where(
        SecureParticipant.round_id == round_.id, SecureParticipant.confirmed
    )
    session.execute(
        update(Assignment)
        .where(Assignment.id.in_(confirmed))
        .values(status="reported", finished_at=now)
        .execution_options(synchronize_session="fetch")
    )
    round_.reported, round_.total_weight = len(survivors), float(len(survivors))
    _drop_outstanding(session, round_, secure_round, SecureParticipant.confirmed, machine.ALL, now)
    on_commit(session, PHASE_CHANGES.notify)
    secure_round.phase = DONE
    session.execute(delete(SecureMaskedInput).where(SecureMaskedInput.round_id == round_.id))
    mean = dequantize_sum(unmasked, parameters) / len(survivors)
    # A mean of vectors clipped to clip_norm is no longer than clip_norm (triangle inequality), up
    # to each coordinate's rounding of at most one step: anything longer comes from a device that
    # did not clip, which is all the server can still check once it cannot see single updates.
    bound = parameters.clip_norm * (1 + np.sqrt(parameters.vector_length) / parameters.levels)
    norm = float(np.linalg.norm(mean))
    if norm > bound:
        problem = f"the unmasked mean has norm {norm:.4g} > clip_norm {bound:.4g}"
        return _abandon(session, round_, secure_round, _failed_check(problem, len(survivors)), now)
    mean_delta = {k: v.astype(np.float32) for k, v in flat.unflatten(mean).items()}
    return Commit(mean_delta, len(survivors), time.perf_counter() - started)


def _failed_check(reason: str, had: int) -> round_state.Closing:
    """The unmasking had its devices' answers but its result failed a check."""
    return round_state.Closing(round_state.ABANDONED, reason, UNMASKING, had, None, round_state.FAILED_CHECK)
