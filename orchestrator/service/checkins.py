"""Check-ins as a service: the group commit that collects them per population, and the one
transaction that answers a group (authentication, the round's admission, the assignments); the
route only parses the request and writes the answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from contracts.mixing import MixingConfig
from contracts.protocol import Assignment, TaskKind
from orchestrator.devices import UNAUTHENTICATED, authenticate_all
from orchestrator.populations import mixing
from orchestrator.populations.config import population_settings
from orchestrator.populations.locks import find_population
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds import checkins
from orchestrator.rounds.lifecycle import TRAINING
from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages
from orchestrator.service.database import DATABASE_UNAVAILABLE, run_db
from orchestrator.service.group_commit import GroupCommit


@dataclass(frozen=True)
class CheckInCall:
    token: str
    example_count: int
    kind: str
    held: bool = False  # again, from the waiting room


# How often a check-in transaction is tried, the first ones without the population's lock: each
# retry is lost to another process closing the round, or admitting one more of the group's
# devices first, which needs a concurrent duplicate.
CHECKIN_ATTEMPTS, UNLOCKED_ATTEMPTS = 5, 2

CheckInGroups = GroupCommit[str, CheckInCall, Assignment | Refused]


def checkin_groups(app: Starlette, window_seconds: float) -> CheckInGroups:
    """The group commit of check-ins, keyed by population."""

    async def transaction(population: str, calls: Sequence[CheckInCall]) -> list[Assignment | Refused]:
        return await run_db(
            app, checkin_transaction, app.state.sessionmaker, population, calls, app.state.clock()
        )

    return GroupCommit(transaction, window_seconds, fail_together=DATABASE_UNAVAILABLE, name="checkin")


def checkin_transaction(
    factory: sessionmaker[Session], population: str, calls: Sequence[CheckInCall], now: float
) -> list[Assignment | Refused]:
    """One transaction for check-ins that arrived together; each call gets its own answer.

    Run again when another server process closed the round or gave one of these devices its
    assignment at the same time (checkins.checkin): first still without the population's lock (the
    round that closed has usually committed with its successor open, and the device's assignment
    is then found), then with it. The lock keeps rounds from closing but not another process's
    unlocked check-in from admitting the same device between this transaction's read and its
    insert, so that race can repeat: each retry reads the assignment the other one committed and
    answers with it."""
    for attempt in range(CHECKIN_ATTEMPTS):
        try:
            return _checkin_once(factory, population, calls, now, lock=attempt >= UNLOCKED_ATTEMPTS)
        except (checkins.RoundClosed, IntegrityError):
            if attempt == CHECKIN_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _checkin_once(
    factory: sessionmaker[Session], population: str, calls: Sequence[CheckInCall], now: float, lock: bool
) -> list[Assignment | Refused]:
    with factory.begin() as session:
        device_ids = authenticate_all(session, [call.token for call in calls])
        known = [
            checkins.CheckIn(device_id, call.example_count, call.kind, call.held)
            for call, device_id in zip(calls, device_ids, strict=True)
            if device_id is not None
        ]
        found = find_population(session, population)
        mixed = mixing.mixing_of(session, found) if found is not None else MixingConfig()
        answers = (
            checkins.checkin(session, found, known, now, lock)
            if found is not None
            else [Refused(404, f"no population {population!r}")] * len(known)
        )
        # What the answers need, read in the transaction; they are built after its commit, so that
        # the round's row is not held meanwhile.
        of = None
        if found is not None:
            of = _Of(found.name, found.artifact_sha256, population_settings(found))
        secure = {
            answer.round_id: messages.parameters(session, answer.round_id)
            for answer in answers
            if isinstance(answer, checkins.Accepted) and of is not None and _secure(of, answer)
        }
    out = iter(answers)
    return [
        _assignment_out(of, next(out), now, mixed, secure.get)
        if device_id is not None
        else Refused(401, UNAUTHENTICATED)
        for device_id in device_ids
    ]


@dataclass(frozen=True)
class _Of:
    """The population an answer is of: its name, model and settings."""

    name: str
    artifact_sha256: str
    settings: PopulationSettings


def _secure(of: _Of, answer: checkins.Accepted) -> bool:
    return answer.kind == TRAINING and of.settings.secure_training


def _assignment_out(
    of: _Of | None,
    answer: checkins.Accepted | Refused,
    now: float,
    mixed: MixingConfig,
    secure_parameters: Callable[[int], dict[str, Any] | None],
) -> Assignment | Refused:
    if isinstance(answer, Refused):
        return answer
    assert of is not None  # only a population hands out assignments
    sha, name, settings = of.artifact_sha256, of.name, of.settings
    secure = _secure(of, answer)
    version, assignment = answer.model_version, answer.assignment_id
    training = answer.kind == TRAINING
    gradient = training and mixed.strategy == "gradient_transfer"
    return Assignment(
        assignment_id=assignment,
        round_id=answer.round_id,
        kind=cast(TaskKind, answer.kind),  # a round is of one of the two kinds
        deadline=answer.deadline,
        seconds_left=answer.deadline - now,
        model_version=version,
        artifact_sha256=sha,
        artifact_url=f"/v1/artifacts/{sha}",
        params_url=f"/v1/populations/{name}/models/{version}/global",
        manifest_url=f"/v1/populations/{name}/manifest",
        report_url=f"/v1/assignments/{assignment}/report",
        abort_url=f"/v1/assignments/{assignment}/abort",
        # Under adaptive clipping, with the round's clip norm.
        task_config=(
            settings.task_config
            if answer.clip_norm is None
            else {**settings.task_config, "clip_norm": answer.clip_norm}
        ),
        aggregation="secure" if secure else "plaintext",
        secure_url=f"/v1/assignments/{assignment}/secure" if secure else None,
        # Saves the device a round trip before its keys: the advertise phase is the round's longest.
        secure_parameters=secure_parameters(answer.round_id) if secure else None,
        central_examples_url=(
            f"/v1/assignments/{assignment}/central-examples"
            if training and mixed.strategy == "example_transfer"
            else None
        ),
        central_gradient_url=f"/v1/assignments/{assignment}/central-gradient" if gradient else None,
        central_gradient_weight=mixed.weight if gradient else None,
    )
