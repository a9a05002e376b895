"""A round's lifecycle: opening, deadlines, commit or abandon, and the next round.

    open --(target good reports)--------------------------> committed (new model version)
    open --(deadline, >= min_reports)---------------------> committed
    open --(deadline, fewer)------------------------------> abandoned (model kept)

after which the next round opens. A population with `aggregation: "secure"` runs its training
rounds' phases in `secure_rounds` instead of taking reports; this module opens them, advances
them and commits their unmasked mean. How a round's reports combine into one mean delta is the
population's aggregation pipeline's (`pipeline`); the commit feeds it and writes the version.
Every function runs inside the caller's transaction and takes `now` explicitly.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, cast

from sqlalchemy import CursorResult, bindparam, select, update
from sqlalchemy.orm import Session

from contracts.params import Params, check_params
from orchestrator.aggregation.assemble import CentralPart, RoundInputs
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.pipeline import apply_measurements
from orchestrator.aggregation.private import CLIP_NORM, NEXT_CLIP_NORM
from orchestrator.aggregation.server_optimizer import apply_update
from orchestrator.db import Assignment, Population, Report, Round, RoundAdmission
from orchestrator.observability import metrics
from orchestrator.observability.logs import log_on_commit
from orchestrator.observability.on_commit import on_commit
from orchestrator.populations import central_training, mixing
from orchestrator.populations.config import (
    config_of,
    population_manifest,
    population_settings,
    privacy_budget_spent,
    training_rounds_done,
)
from orchestrator.populations.locks import lock_admissions, lock_rounds
from orchestrator.populations.model_versions import base_version, prune_model_versions, write_version
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds import (
    buffering,
    cohort_sums,
    evaluation_intervals,
    idle_backoff,
    pace_steering,
    pausing,
)
from orchestrator.rounds import release as round_release
from orchestrator.rounds import state as round_state
from orchestrator.rounds.secure import messages

TRAINING, EVALUATION = "training", "evaluation"
# A buffered secure population's secure rounds (`cohorts`): their sums go into its buffer, the
# training round (`cohort_sums`). Several may be open at once, so they are no kind of `open_rounds`.
COHORT = "cohort"
log = logging.getLogger("orchestrator.rounds")  # one logger for the rounds, whichever module

# Fresh values even for rounds already in the session: a check-in reads them before it takes the
# population's lock, and another server process may have reported into them meanwhile.
_OPEN_ROUNDS = (
    select(Round)
    .where(
        Round.population_id == bindparam("population_id"),
        Round.status == "open",
        Round.kind.in_((TRAINING, EVALUATION)),
    )
    .execution_options(populate_existing=True)
)
_REPORT_WEIGHTS = (  # in the order the commit reads the reports
    select(Report.weight).where(Report.round_id == bindparam("round_id")).order_by(Report.assignment_id)
)
_REPORTS = (
    select(Report.weight, Report.delta)
    .where(Report.round_id == bindparam("round_id"))
    .order_by(Report.assignment_id)
    .execution_options(yield_per=16)
)


def open_round(
    session: Session, population: Population, kind: str, now: float, duration: float | None = None
) -> Round:
    """Open a round of `kind` now; `duration`: an evaluation round's own (an operator's), instead of
    the population's `evaluation_round_duration_seconds`."""
    settings = population_settings(population)
    # A buffered secure population's buffer takes its cohorts' sums; the cohorts are secure rounds.
    by_cohorts = settings.secure_training and settings.buffered_training
    secure = kind == COHORT or (kind == TRAINING and settings.secure_training and not by_cohorts)
    if kind == COHORT:  # sized as a synchronous secure round
        target, capacity, min_reports = settings.target_reports, settings.secure_roster, settings.min_reports
        duration = settings.secure.duration_seconds
    elif kind == TRAINING:
        target, capacity, min_reports = settings.target_reports, settings.capacity, settings.min_reports
        if settings.buffered_training:  # a buffer: it commits at K reports (capacity: concurrency)
            target = settings.buffered.buffer_size
        duration = settings.secure.duration_seconds if secure else settings.round_duration_seconds
    else:
        target = settings.evaluation_target_reports
        capacity = math.ceil(target * settings.oversampling)
        # The floor: fewer devices' sums are theirs alone (round_release).
        min_reports = settings.min_evaluation_reports
        duration = settings.evaluation_round_duration_seconds if duration is None else duration
    dp = settings.dp()
    previous = _previous_round(session, population, kind)
    window = pace_steering.next_window(
        None if previous is None else previous.checkin_window,
        0 if previous is None else previous.checked_in,
        capacity,
        duration,
    )
    round_metrics = {}
    if kind == TRAINING and dp is not None and dp.adaptive:
        round_metrics[CLIP_NORM] = _next_clip_norm(previous, dp.clip_norm)
    round_ = Round(
        population_id=population.id,
        kind=kind,
        status="open",
        base_version=population.current_version,
        result_version=None,
        target=target,
        capacity=capacity,
        min_reports=min_reports,
        opened_at=now,
        deadline=now + duration,
        closed_at=None,
        checkin_window=window,
        metrics=round_metrics,
    )
    session.add(round_)
    session.flush()
    session.add(
        RoundAdmission(
            round_id=round_.id, checked_in=0, accepted=0, rejected_capacity=0, rejected_min_examples=0
        )
    )
    session.flush()
    if kind == TRAINING:
        population.next_round_at = None  # the back-off is over; idle_rounds counts on till a check-in
    log_on_commit(
        session,
        log,
        "round opened",
        population=population.name,
        round_id=round_.id,
        kind=kind,
        model_version=round_.base_version,
        target=target,
        capacity=capacity,
        deadline=round_.deadline,
    )
    if secure:
        messages.start(session, round_, population.name, settings, population_manifest(population))
    return round_


def _previous_round(session: Session, population: Population, kind: str) -> Round | None:
    """The population's last closed round of this kind: what the next one carries on from."""
    return session.scalars(
        select(Round)
        .where(Round.population_id == population.id, Round.kind == kind, Round.status != "open")
        .order_by(Round.id.desc())
        .limit(1)
    ).first()


def _next_clip_norm(last: Round | None, initial: float) -> float:
    """Adaptive clipping: the clip norm the last committed training round chose for its successor
    (an abandoned round passes its own on), or the configured one before any round."""
    if last is None:
        return initial
    key = NEXT_CLIP_NORM if last.status == "committed" else CLIP_NORM
    return float(last.metrics.get(key, initial))


def open_rounds(session: Session, population: Population) -> dict[str, Round]:
    rounds = session.scalars(_OPEN_ROUNDS, {"population_id": population.id}).all()
    return {r.kind: r for r in rounds}


def up_to_date(population: Population, current: Mapping[str, Round], now: float) -> bool:
    """Whether `advance` has nothing to do: no round to close or open, no secure phase to move."""
    return (
        (TRAINING in current or not _may_open_training(population, now))
        and all(now < r.deadline for r in current.values())
        and not config_of(population).secure_training
        # A buffered population's assignments outlive their rounds: each check-in drops the expired.
        and not config_of(population).settings.buffered_training
        and not (EVALUATION in current and privacy_budget_spent(population))
    )


def advance(
    session: Session, population: Population, now: float, current: dict[str, Round] | None = None
) -> dict[str, Round]:
    """Close rounds past their deadline (drop their outstanding assignments), open the next;
    returns the open rounds by kind. The population must be locked; `current`: its open rounds, if
    the caller has just read them under the lock."""
    current = open_rounds(session, population) if current is None else current
    if up_to_date(population, current, now):
        return current  # the common case: nothing to close, one query
    # The rounds' row locks, in id order, and their counts as they now are: a check-in admitted or
    # a report counted into one (which take no population lock) has committed before its
    # assignments are dropped, and none is admitted or counted after.
    lock_rounds(session, [population.id], [])
    settings = config_of(population).settings
    secure, buffered = settings.secure_training, settings.buffered_training
    if buffered:
        buffering.drop_expired(session, population, now)
    for round_ in sorted(current.values(), key=lambda r: r.id):
        if round_.kind == COHORT:  # a caller's locked rounds: cohorts are advanced below
            continue
        if round_.kind == TRAINING and buffered:
            _buffer_at_deadline(session, population, round_, settings, now)
            continue
        if round_.kind == TRAINING and secure:
            advance_secure(session, population, round_, now)
            continue
        if round_.kind == EVALUATION and privacy_budget_spent(population):
            _drop_outstanding(session, population, round_, now)
            _abandon(session, population, round_, round_release.BUDGET_SPENT, now)
            continue
        if not round_state.past_deadline(round_, now):
            continue
        outstanding = _drop_outstanding(session, population, round_, now)
        closing = round_state.at_deadline(round_, outstanding)
        if closing.status == round_state.COMMITTED:
            commit(session, population, round_, now, closing=closing)
        else:
            _abandon(session, population, round_, closing, now)
    if buffered and secure:
        for cohort in open_cohorts(session, population):
            advance_secure(session, population, cohort, now)
    current = open_rounds(session, population)
    if TRAINING not in current and _may_open_training(population, now):
        current[TRAINING] = open_round(session, population, TRAINING, now)
    return current


def open_cohorts(session: Session, population: Population) -> list[Round]:
    """A buffered secure population's open cohorts, oldest first."""
    return list(
        session.scalars(
            select(Round)
            .where(Round.population_id == population.id, Round.kind == COHORT, Round.status == "open")
            .order_by(Round.id)
            .execution_options(populate_existing=True)
        )
    )


def _buffer_at_deadline(
    session: Session, population: Population, buffer: Round, settings: PopulationSettings, now: float
) -> None:
    """A buffer past its deadline commits with at least `min_reports` reports; with fewer it stays
    open for another `round_duration_seconds` (abandoning it would throw away the reports it
    holds). Its devices still training keep their assignments: each has its own deadline."""
    if not round_state.past_deadline(buffer, now):
        return
    closing = round_state.at_deadline(buffer, 0)
    if closing.status == round_state.COMMITTED:
        _commit_buffer(session, population, buffer, now, closing)
    else:
        buffer.deadline = now + settings.round_duration_seconds


def _commit_buffer(
    session: Session, population: Population, buffer: Round, now: float, closing: round_state.Closing
) -> None:
    """Commit a buffer: from its reports, or under secure aggregation from its cohorts' sums."""
    config = config_of(population)
    if not config.settings.secure_training:
        commit(session, population, buffer, now, closing=closing)
        return
    mean_delta, members = cohort_sums.take(session, config.settings, buffer, config.manifest)
    commit(session, population, buffer, now, mean_delta, members, closing)


def _drop_outstanding(session: Session, population: Population, round_: Round, now: float) -> int:
    """The round's assignments still outstanding are dropped (it closes); how many there were."""
    dropped: CursorResult[Any] = session.execute(  # type: ignore[assignment]
        update(Assignment)
        .where(Assignment.round_id == round_.id, Assignment.status == "assigned")
        .values(status="dropped", finished_at=now)
    )
    if dropped.rowcount:
        metrics.count(session, metrics.DROPPED, (population.name, round_.kind), dropped.rowcount)
    return int(dropped.rowcount)


def _may_open_training(population: Population, now: float) -> bool:
    return not (
        privacy_budget_spent(population)
        or training_rounds_done(population)
        or idle_backoff.backing_off(population, now)
        or pausing.paused(population)
    )


def advance_secure(session: Session, population: Population, round_: Round, now: float) -> None:
    """Close the secure round's phases that are over; commit or abandon it when it ends."""
    settings = population_settings(population)
    outcome = messages.advance(session, round_, settings, population_manifest(population), now)
    if isinstance(outcome, messages.Commit):
        round_.metrics = {
            **round_.metrics,  # the phases' durations
            "secure_survivors": float(outcome.survivors),
            "unmask_seconds": outcome.unmask_seconds,
        }
        closing = round_state.Closing(
            round_state.COMMITTED,
            f"{outcome.survivors} devices' masked inputs unmasked",
            had=outcome.survivors,
            needed=round_.min_reports,
        )
        if round_.kind == COHORT:
            _cohort_unmasked(session, population, round_, outcome, closing, now)
        else:
            commit(session, population, round_, now, outcome.mean_delta, outcome.survivors, closing)
    elif isinstance(outcome, messages.Abandon):
        _abandon(session, population, round_, outcome.closing, now)
        # (a cohort: the next one opens when devices check in, `cohorts`)
        if round_.kind == TRAINING and _may_open_training(population, now):
            open_round(session, population, TRAINING, now)


def _cohort_unmasked(
    session: Session,
    population: Population,
    cohort: Round,
    unmasked: messages.Commit,
    closing: round_state.Closing,
    now: float,
) -> None:
    """A cohort's sum goes into the open buffer (`cohort_sums`), which commits at its target; the
    cohort is committed (into the buffer), or abandoned with its sum discarded if it cannot go in."""
    settings = population_settings(population)
    buffer = open_rounds(session, population).get(TRAINING)
    refused = cohort_sums.enter(session, settings, cohort, buffer, unmasked)
    if refused is not None:
        _abandon(session, population, cohort, refused, now)
        return
    assert buffer is not None
    lock_admissions(session, [cohort])
    round_state.close(cohort, closing, now)
    _count_closed(session, population, cohort, "committed")
    reached = round_state.target_reached(buffer)
    if reached is not None:
        _commit_buffer(session, population, buffer, now, reached)


def commit(
    session: Session,
    population: Population,
    round_: Round,
    now: float,
    mean_delta: Params | None = None,
    survivors: int = 0,
    closing: round_state.Closing | None = None,
) -> None:
    """Aggregate the round's reports into a new model version (training) or just close it.
    A secure round passes its unmasked `mean_delta` over its `survivors`, since it has no
    individual reports. How the reports combine is the population's pipeline's (`pipeline`)."""
    lock_admissions(session, [round_])  # no check-in is admitted into it meanwhile
    if round_.kind == EVALUATION:
        # Its intervals from groups of at least its floor's devices; the groups' sums go.
        round_.metrics = evaluation_intervals.settled(round_.metrics, round_.min_reports)
        round_state.close(round_, closing or _COMMITTED, now)
        _count_closed(session, population, round_, "committed")
        return
    started = time.perf_counter()
    config = config_of(population)
    manifest, pipeline = config.manifest, config.pipeline
    params, state = base_version(session, population, manifest, round_.base_version)
    mixes = mixing.strategy_of(session, population)  # one read; None for most populations
    job = (
        mixing.central_job(session, population, manifest, round_.base_version, params, config.task, mixes)
        if mixes == "parallel_training"
        else None
    )
    inputs = RoundInputs(
        rounds_committed=population.training_rounds_committed,
        metrics=round_.metrics,
        central=None if job is None else _central_part(job),
    )
    if mean_delta is None:
        if not pipeline.private:  # robust clipping's inputs (under DP every report weighs the same)
            weights = list(session.scalars(_REPORT_WEIGHTS, {"round_id": round_.id}))
            inputs = replace(inputs, weights=weights, reference=_norm_reference(session, population))
        # One report's delta in memory at a time where the stages allow it: O(model), not
        # O(reports x model). The whole stack of stages runs inside this one call, which reads
        # the stored reports from the cursor itself: no call back into this module.
        rows = session.execute(_REPORTS, {"round_id": round_.id}).tuples()
        # A training report always has its delta (only an evaluation report's is NULL).
        aggregate = pipeline.aggregate(inputs, stored=cast(Iterable[tuple[float, bytes]], rows))
    else:
        aggregate = pipeline.aggregate(inputs, secure=(mean_delta, survivors))
    new_params, new_state = apply_update(config.optimizer, params, aggregate.mean_delta, state)
    check_params(new_params, manifest.global_params, "aggregated model")
    metrics.observe(session, metrics.AGGREGATION_SECONDS, (population.name,), time.perf_counter() - started)
    # The round's changes after every read, so that they reach its row in one statement.
    round_state.close(round_, closing or _COMMITTED, now)
    round_.metrics = apply_measurements(round_.metrics, aggregate)
    if aggregate.norm_reference is not None:
        round_.norm_reference = aggregate.norm_reference.to_json()
    version = write_version(session, population, round_, new_params, new_state, now)
    if job is not None:  # the next round's central delta, computed while its devices train
        following = mixing.central_job(
            session, population, manifest, version, new_params, config.task, "parallel_training"
        )
        if following is not None:
            on_commit(session, functools.partial(central_training.precompute, following))
    # Gradient transfer: the new version's central gradient, ready before its devices ask for it.
    if mixes == "gradient_transfer":
        gradient = mixing.central_job(
            session, population, manifest, version, new_params, config.task, "gradient_transfer"
        )
        if gradient is not None:
            on_commit(session, functools.partial(central_training.precompute_gradient, gradient))
    _count_closed(session, population, round_, "committed")
    if _may_open_training(population, now):
        open_round(session, population, TRAINING, now)
    if config.settings.keep_model_versions:
        prune_model_versions(session, population, config.settings.keep_model_versions)
    evaluation = open_rounds(session, population).get(EVALUATION)
    every = config.settings.evaluation_every
    if evaluation is not None and privacy_budget_spent(population):
        _drop_outstanding(session, population, evaluation, now)
        _abandon(session, population, evaluation, round_release.BUDGET_SPENT, now)
    elif (
        every
        and evaluation is None
        and not pausing.paused(population)
        and population.training_rounds_committed % every == 0
        and round_release.may_open_evaluation(population) is None
    ):
        open_round(session, population, EVALUATION, now)


def _central_part(job: central_training.CentralJob) -> CentralPart:
    """Parallel training's central delta at the round's base version (None if it diverged)."""
    try:
        return CentralPart(central_training.central_update(job), job.mixing.weight)
    except central_training.CentralTrainingError:
        return CentralPart(None, job.mixing.weight)


def _norm_reference(session: Session, population: Population) -> NormReference | None:
    """The reference update norms (and their history) the population's last committed training
    round left, if any."""
    return NormReference.from_json(
        session.scalars(
            select(Round.norm_reference)
            .where(
                Round.population_id == population.id,
                Round.kind == TRAINING,
                Round.status == "committed",
                Round.norm_reference.is_not(None),
            )
            .order_by(Round.id.desc())
            .limit(1)
        ).first()
    )


_FORGET_DELTAS = (
    update(Report)
    .where(Report.round_id == bindparam("closed_round"), Report.delta.is_not(None))
    .values(delta=None)
    .execution_options(synchronize_session=False)
)
_COMMITTED = round_state.Closing(round_state.COMMITTED, "")


def _abandon(
    session: Session, population: Population, round_: Round, closing: round_state.Closing, now: float
) -> None:
    lock_admissions(session, [round_])  # no check-in is admitted into it meanwhile
    round_state.close(round_, closing, now)
    # What it gathered is never released: an evaluation's sums of fewer devices than its floor,
    # a DP round's raw count of devices within the clip norm.
    round_.metrics = round_release.kept_after_abandon(round_.kind, round_.metrics)
    labels = (population.name, round_.kind, closing.phase, closing.ended_by or "")
    metrics.count(session, metrics.ROUNDS_ABANDONED, labels)
    _count_closed(session, population, round_, "abandoned")


def _count_closed(session: Session, population: Population, round_: Round, transition: str) -> None:
    if config_of(population).settings.report_deltas == "until_round_closes":
        # In the closing transaction: no delta outlives its round (the aggregate has read them).
        session.execute(_FORGET_DELTAS, {"closed_round": round_.id})
    if round_.kind == TRAINING:
        idle_backoff.training_round_closed(session, population, round_, round_.closed_at or 0.0)
    why = {
        "stopped_phase": round_.stopped_phase,
        "devices_had": round_.devices_had,
        "devices_needed": round_.devices_needed,
        "ended_by": round_.ended_by,
    }
    log_on_commit(
        session,
        log,
        f"round {transition}",
        reason=round_.close_reason,
        **{k: v for k, v in why.items() if v is not None},
        population=population.name,
        round_id=round_.id,
        kind=round_.kind,
        model_version=round_.result_version,
        reported=round_.reported,
        accepted=round_.accepted,
        dropped=round_.dropped,
        aborted=round_.aborted,
        late=round_.late,
        invalid=round_.invalid,
    )


def summarize_metrics(round_: Round) -> dict[str, float]:
    """Per-round metrics: the sums devices sent, and the example-weighted means they stand for
    (`<name>` for each `<name>_sum`; also `rmse` from `squared_error` and `accuracy` from `correct`);
    a committed evaluation round's also with their 95% intervals (`<name>_low`, `<name>_high`,
    `evaluation_intervals`). Only what the round may release (`round_release.released`)."""
    sums = round_release.released(round_)
    out = dict(sums)
    for prefix in ("", "query_"):
        weight = sums.get(f"{prefix}weight_sum", 0.0)
        if weight > 0:
            for key, total in sums.items():
                if not key.endswith("_sum") or key.startswith("query_") != (prefix == "query_"):
                    continue
                name = key.removeprefix(prefix).removesuffix("_sum")
                if name != "weight":
                    out[f"{prefix}{name}"] = total / weight
            if f"{prefix}squared_error_sum" in sums:
                out[f"{prefix}rmse"] = math.sqrt(max(sums[f"{prefix}squared_error_sum"], 0.0) / weight)
            if f"{prefix}correct_sum" in sums:
                out[f"{prefix}accuracy"] = sums[f"{prefix}correct_sum"] / weight
    if round_.reported:
        for k in ("reconstruction_loss", "update_loss"):
            if k in sums:
                out[k] = sums[k] / round_.reported
        if buffering.STALENESS_TOTAL in sums:  # a buffer's: how many versions behind its reports were
            out["staleness_mean"] = sums[buffering.STALENESS_TOTAL] / round_.reported
    return out
