"""The round state machine on a real SQLite file, with time passed in explicitly."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load, save
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from contracts.manifest import Manifest
from contracts.params import decode_params, decode_sparse_delta, encode_params, encode_sparse_delta
from contracts.protocol import Assignment as AssignmentAnswer
from model_export.config import ModelConfig
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.differential_privacy import epsilon
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.robust import known_bounds
from orchestrator.db import Assignment, ModelVersion, Population, Report, Round, make_engine
from orchestrator.devices import authenticate, enroll
from orchestrator.migrate import migrate
from orchestrator.populations.config import population_settings
from orchestrator.populations.locks import find_population, lock_population
from orchestrator.populations.model_versions import _latest
from orchestrator.rounds import checkins
from orchestrator.rounds import reports as round_reports
from orchestrator.rounds.lifecycle import EVALUATION, TRAINING, open_round, open_rounds, summarize_metrics
from orchestrator.rounds.refusals import Refused
from orchestrator.service.checkins import CheckInCall, checkin_transaction
from orchestrator.service.population_creation import ExportedModel, PopulationError, create_population
from orchestrator.service.population_views import population_out
from tests.conftest import IMPLICIT
from tests.orchestrator.conftest import make_population


def device(factory: sessionmaker[Session]) -> str:
    with factory.begin() as session:
        _, token = enroll(session, 0.0)
    with factory() as session:
        found = authenticate(session, token)
        assert found is not None
        return found


def checkin(
    factory: sessionmaker[Session], dev: str, count: int = 50, now: float = 1.0, kind: str = "training"
):  # type: ignore[no-untyped-def]
    with factory.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        (answer,) = checkins.checkin(session, population, [checkins.CheckIn(dev, count, kind)], now)
        return answer


def report(
    factory: sessionmaker[Session],
    dev: str,
    assignment_id: str,
    body: bytes,
    now: float = 2.0,
    ctype: str = "application/octet-stream",
):  # type: ignore[no-untyped-def]
    return receive_one(factory, round_reports.Event(assignment_id, dev, body, ctype), now)


def receive_one(factory: sessionmaker[Session], event: round_reports.Event, now: float) -> Round | Refused:
    """One report or abort through the service's path (`round_reports.receive`), in a transaction of
    its own, under its population's lock as the service's run after a race takes it."""
    with factory.begin() as session:
        (answer,) = round_reports.receive(session, [event], now, locked=True)
    return answer if isinstance(answer, Refused) else answer.round


def abort(factory: sessionmaker[Session], dev: str, assignment_id: str, now: float) -> Round | Refused:
    return receive_one(factory, round_reports.Event(assignment_id, dev, abort=True), now)


def current_round(factory: sessionmaker[Session], kind: str = "training") -> Round:
    with factory() as session:
        population = session.scalars(select(Population)).one()
        return open_rounds(session, population)[kind]


def round_by_id(factory: sessionmaker[Session], round_id: int) -> Round:
    with factory() as session:
        found = session.get(Round, round_id)
        assert found is not None
        return found


def manifest_of(model: ExportedModel) -> Manifest:
    return Manifest.from_json(model.manifest)


def delta_body(
    model: ExportedModel,
    value: float,
    num_examples: int = 10,
    rows: tuple[int, ...] = (3, 7),
    metrics: dict[str, float] | None = None,
    **overrides: np.ndarray,
) -> bytes:
    delta = {s.name: np.zeros(s.shape, np.float32) for s in manifest_of(model).global_params}
    for r in rows:
        delta["item_embeddings"][r] = value
    delta["global_mean"][:] = value
    delta.update(overrides)
    return encode_sparse_delta(
        delta,
        {
            "num_examples": str(num_examples),
            "metrics": json.dumps({"update_loss": value} if metrics is None else metrics),
        },
    )


def dense_body(model: ExportedModel) -> bytes:
    """The dense form of a delta, which the protocol no longer takes."""
    delta = {s.name: np.zeros(s.shape, np.float32) for s in manifest_of(model).global_params}
    return encode_params(delta, {"num_examples": "10", "metrics": "{}"})


def sparse_body(model: ExportedModel, rows: np.ndarray) -> bytes:
    """A delta written part by part, so that its rows can be anything."""
    parts: dict[str, np.ndarray] = {}
    for spec in manifest_of(model).global_params:
        by_row = (spec.shape[0], *spec.shape[1:]) if spec.shape else (1,)
        tensor_rows = rows if spec.name == "item_embeddings" else np.arange(0, dtype=np.int32)
        parts[f"{spec.name}/rows"] = tensor_rows
        parts[f"{spec.name}/values"] = np.full((len(tensor_rows), *by_row[1:]), 0.1, np.float32)
        parts[f"{spec.name}/shape"] = np.asarray(spec.shape, np.int64)
    return save(parts, metadata={"num_examples": "10", "metrics": "{}"})


def version_params(
    factory: sessionmaker[Session], model: ExportedModel, version: int
) -> dict[str, np.ndarray]:
    with factory() as session:
        found = session.get(ModelVersion, (1, version))
        assert found is not None
        return decode_params(found.params, manifest_of(model).global_params, "version")


def test_oversampling_capacity_and_min_examples(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, oversampling=1.5, min_examples=5, min_reports=1)
    devices = [device(db) for _ in range(5)]

    answers = [checkin(db, d) for d in devices[:4]]
    too_few = checkin(db, devices[4], count=4)

    assert [type(a).__name__ for a in answers] == ["Accepted", "Accepted", "Accepted", "Refused"]
    assert "full" in answers[3].message and answers[3].retry_after > 0
    assert isinstance(too_few, Refused) and "at least 5" in too_few.message
    r = current_round(db)
    assert (r.capacity, r.checked_in, r.accepted, r.rejected_capacity, r.rejected_min_examples) == (
        3,
        5,
        3,
        1,
        1,
    )


def test_a_retried_checkin_gets_the_same_assignment(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model)
    dev = device(db)

    first, second = checkin(db, dev), checkin(db, dev)

    assert first.assignment_id == second.assignment_id
    assert current_round(db).accepted == 1


def test_a_group_beyond_capacity_admits_up_to_it_in_order(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, oversampling=2.0, min_examples=5)
    first, *devices = [device(db) for _ in range(7)]
    checkin(db, first)
    group = [checkins.CheckIn(d, 4 if d == devices[1] else 50, TRAINING) for d in devices[:5]]
    group.append(checkins.CheckIn(devices[0], 50, TRAINING))  # the same device again

    with db.begin() as session:
        population = find_population(session, "p")
        assert population is not None
        answers = checkins.checkin(session, population, group, 1.0)

    assert [type(a).__name__ for a in answers] == [
        "Accepted",
        "Refused",  # too few examples
        "Accepted",
        "Accepted",
        "Refused",  # the round is full (capacity 4)
        "Accepted",
    ]
    assert isinstance(answers[4], Refused) and "full" in answers[4].message
    assert answers[5] == answers[0]  # the repeat gets the first's assignment
    r = current_round(db)
    assert (r.capacity, r.checked_in, r.accepted, r.rejected_capacity, r.rejected_min_examples) == (
        4,
        6,
        4,
        1,
        1,
    )
    full = checkin(db, devices[5])
    assert isinstance(full, Refused) and "full" in full.message
    r = current_round(db)
    assert (r.checked_in, r.accepted, r.rejected_capacity) == (7, 4, 2)


def test_concurrent_checkins_never_exceed_capacity_nor_give_a_device_two_assignments(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Eight check-in transactions at once, as the service runs them (on PostgreSQL, without the
    # population lock first), each with a group of devices; every device is in three groups, as
    # when a client retries through other processes, so that a locked retry can meet yet another
    # process admitting one of its devices (CI once answered that race with a 500).
    make_population(db, biased_model, target_reports=10, oversampling=1.5)
    tokens: dict[str, str] = {}
    for _ in range(32):
        with db.begin() as session:
            device_id, token = enroll(session, 0.0)
        tokens[device_id] = token
    devices = list(tokens)
    groups = [devices[i * 4 : i * 4 + 4] for i in range(8)]
    groups = [
        group + groups[(i + 1) % 8][:2] + groups[(i + 3) % 8][2:] + groups[(i + 5) % 8]
        for i, group in enumerate(groups)
    ]
    start = threading.Barrier(len(groups))

    def check_in(group: list[str]) -> list[tuple[str, AssignmentAnswer | Refused]]:
        calls = [CheckInCall(tokens[d], 50, TRAINING) for d in group]
        start.wait()
        return list(zip(group, checkin_transaction(db, "p", calls, 1.0), strict=True))

    with ThreadPoolExecutor(len(groups)) as pool:
        answers = [a for group_answers in pool.map(check_in, groups) for a in group_answers]

    accepted: dict[str, set[str]] = {}
    for dev, answer in answers:
        if isinstance(answer, AssignmentAnswer):
            accepted.setdefault(dev, set()).add(answer.assignment_id)
        else:
            assert "full" in answer.message
    assert len(accepted) == 15 and all(len(ids) == 1 for ids in accepted.values())
    r = current_round(db)
    assert (r.capacity, r.accepted) == (15, 15)
    assert r.checked_in == r.accepted + r.rejected_capacity
    with db() as session:
        assigned = session.scalars(select(Assignment.device_id).where(Assignment.round_id == r.id)).all()
    assert sorted(assigned) == sorted(accepted)


def test_a_checkin_retries_while_other_processes_keep_admitting_its_devices_first(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # On PostgreSQL another process's unlocked check-in can admit a device between this
    # transaction's read of the devices' assignments and its own admission, once for each device
    # of the group: here twice, the second time while this one holds the population lock.
    if db.kw["bind"].dialect.name != "postgresql":
        pytest.skip("SQLite serializes writers: no other transaction admits in between")
    make_population(db, biased_model, target_reports=10, oversampling=1.5)
    tokens = []
    for _ in range(3):
        with db.begin() as session:
            tokens.append(enroll(session, 0.0)[1])
    opener, first, second = tokens
    checkin_transaction(db, "p", [CheckInCall(opener, 50, TRAINING)], 1.0)  # opens the round
    rivals = [first, second]  # each admitted by "another process" just before this admission
    rival_answers: list[AssignmentAnswer | Refused] = []
    in_rival = threading.local()

    def rival_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if (
            statement.lstrip().startswith("UPDATE round_admissions")
            and rivals
            and not getattr(in_rival, "on", False)
        ):
            in_rival.on = True
            try:
                rival = CheckInCall(rivals.pop(0), 50, TRAINING)
                rival_answers.extend(checkin_transaction(db, "p", [rival], 1.0))
            finally:
                in_rival.on = False

    calls = [CheckInCall(t, 50, TRAINING) for t in (first, second)]
    event.listen(db.kw["bind"], "before_cursor_execute", rival_first)
    try:
        answers = checkin_transaction(db, "p", calls, 1.0)
    finally:
        event.remove(db.kw["bind"], "before_cursor_execute", rival_first)
    assert not rivals and all(isinstance(a, AssignmentAnswer) for a in rival_answers + answers)
    # Each device got the assignment the other process gave it, and the round counted it once.
    assert [a.assignment_id for a in answers] == [a.assignment_id for a in rival_answers]  # type: ignore[union-attr]
    r = current_round(db)
    assert r.accepted == 3


def test_target_reports_commit_the_weighted_mean(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(
        db, biased_model, target_reports=2, server_optimizer={"name": "sgd", "learning_rate": 1.0}
    )
    a, b = device(db), device(db)
    first, second = checkin(db, a), checkin(db, b)
    before = version_params(db, biased_model, 0)

    report(db, a, first.assignment_id, delta_body(biased_model, 1.0, num_examples=10))
    committed = report(db, b, second.assignment_id, delta_body(biased_model, 4.0, num_examples=30))

    assert committed.status == "committed" and committed.result_version == 1
    after = version_params(db, biased_model, 1)
    expected = (1.0 * 10 + 4.0 * 30) / 40  # 3.25
    np.testing.assert_allclose(
        after["item_embeddings"][3] - before["item_embeddings"][3], expected, rtol=1e-6
    )
    np.testing.assert_allclose(after["global_mean"] - before["global_mean"], expected, rtol=1e-6)
    np.testing.assert_array_equal(after["item_embeddings"][4], before["item_embeddings"][4])
    assert current_round(db).base_version == 1  # the next round opened on the new model
    assert committed.metrics == {"update_loss": 5.0}


def test_reports_travel_and_are_stored_sparse(db: sessionmaker[Session], biased_model: ExportedModel) -> None:
    make_population(db, biased_model, target_reports=5)
    dev = device(db)
    answer = checkin(db, dev)
    body = delta_body(biased_model, 1.0)

    report(db, dev, answer.assignment_id, body)

    with db() as session:
        stored = session.scalars(select(Report)).one()
    assert stored.delta is not None
    assert len(body) < len(dense_body(biased_model)) / 10
    items = decode_sparse_delta(stored.delta)["item_embeddings"]
    assert items.rows.tolist() == [3, 7] and np.all(items.values == 1.0)


def test_deadline_commits_with_enough_reports_and_drops_the_rest(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=3, min_reports=1, round_duration_seconds=10)
    a, b = device(db), device(db)
    first, second = checkin(db, a), checkin(db, b)
    report(db, a, first.assignment_id, delta_body(biased_model, 1.0))

    late = report(db, b, second.assignment_id, delta_body(biased_model, 1.0), now=11.0)

    assert isinstance(late, Refused) and late.status == 409 and "late" in late.message
    closed = round_by_id(db, first.round_id)
    assert (closed.status, closed.reported, closed.dropped, closed.late) == ("committed", 1, 1, 1)
    assert current_round(db).base_version == 1


def test_deadline_without_enough_reports_abandons_and_keeps_the_model(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=3, min_reports=2, round_duration_seconds=10)
    a = device(db)
    first = checkin(db, a)
    report(db, a, first.assignment_id, delta_body(biased_model, 1.0))

    checkin(db, device(db), now=12.0)  # any request past the deadline advances the machine

    abandoned = round_by_id(db, first.round_id)
    assert abandoned.status == "abandoned"
    why = (abandoned.stopped_phase, abandoned.devices_had, abandoned.devices_needed, abandoned.ended_by)
    assert why == ("reporting", 1, 2, "deadline")
    assert abandoned.close_reason == "only 1 reports by the deadline; the round needed 2"
    assert current_round(db).base_version == 0
    with db() as session:
        assert session.get(ModelVersion, (1, 1)) is None


def test_min_examples_counts_a_devices_examples_not_its_query_set(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, min_examples=25)
    dev = device(db)
    answer = checkin(db, dev, count=30)

    # A device with 30 examples splits them into support and query: its weight (|query|) is 15.
    reported = report(db, dev, answer.assignment_id, delta_body(biased_model, 0.1, num_examples=15))

    assert isinstance(reported, Round) and reported.reported == 1, reported
    with db() as session:
        population = session.scalars(select(Population)).one()
        assert population_settings(population).task().min_examples == 25  # what devices apply


def test_task_config_cannot_set_a_second_min_examples(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    with pytest.raises(PopulationError, match=r"task_config.min_examples \(3\) differs.*min_examples \(25\)"):
        make_population(db, biased_model, min_examples=25, task_config={"min_examples": 3})


def test_a_population_can_keep_local_parameters_only_with_a_local_learning_rate(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    with pytest.raises(PopulationError, match=r"local_state 'keep' needs local_learning_rate > 0"):
        make_population(db, biased_model, task_config={"local_state": "keep"})

    make_population(db, biased_model, task_config={"local_state": "keep", "local_learning_rate": 0.1})

    with db() as session:
        population = session.scalars(select(Population)).one()
        task = population_settings(population).task()
        assert (task.local_state.value, task.local_learning_rate) == ("keep", 0.1)  # what devices get


def test_evaluation_report_bound_follows_negatives_per_positive(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    implicit = ExportedModel.from_dir(export(IMPLICIT))
    make_population(db, implicit, task_config={"negatives_per_positive": 8})
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        open_round(session, population, EVALUATION, 0.5)
    honest, greedy = device(db), device(db)
    answers = [checkin(db, d, count=10, kind="evaluation") for d in (honest, greedy)]

    def body(weight: int) -> bytes:
        metrics = {"loss_sum": 1.0, "squared_error_sum": 1.0, "correct_sum": 1.0, "weight_sum": weight}
        return json.dumps({"num_examples": weight, "metrics": metrics}).encode()

    # 10 shares, each with 8 sampled negatives: 90 examples, beyond the old fixed 5 per share.
    accepted = report(db, honest, answers[0].assignment_id, body(90), ctype="application/json")
    refused = report(db, greedy, answers[1].assignment_id, body(91), ctype="application/json")

    assert isinstance(accepted, Round) and accepted.reported == 1, accepted
    assert isinstance(refused, Refused) and "[1, 90]" in refused.message


@pytest.mark.parametrize(
    ("make_body", "message"),
    [
        (lambda m: b"not safetensors at all", "not a valid safetensors payload"),
        (lambda m: delta_body(m, float("nan")), "non-finite"),
        (lambda m: delta_body(m, 1.0, item_bias=np.zeros(7, np.float32)), r"expected float32\[200\]"),
        (lambda m: delta_body(m, 1.0, user_embedding=np.zeros(16, np.float32)), "unexpected"),
        (lambda m: delta_body(m, 1e4), "exceeds the bound"),
        (lambda m: delta_body(m, 1.0, num_examples=51), r"outside \[1, 50\]"),
        (lambda m: encode_sparse_delta({"item_embeddings": np.ones((200, 16), np.float32)}), "missing"),
        (
            lambda m: dense_body(m),
            r"unexpected tensor '\w+'; a report is the sparse delta.*'<name>/rows' \(int32",
        ),
        (lambda m: sparse_body(m, rows=np.array([7, 3], np.int32)), "strictly increasing"),
        (lambda m: sparse_body(m, rows=np.array([3, 200], np.int32)), r"must lie in \[0, 200\)"),
        (lambda m: sparse_body(m, rows=np.array([3, 7], np.int64)), "rows must be int32"),
    ],
)
def test_invalid_reports_are_refused_and_never_change_the_model(
    db: sessionmaker[Session], biased_model: ExportedModel, make_body, message: str
) -> None:  # type: ignore[no-untyped-def]
    make_population(db, biased_model, target_reports=1)
    dev = device(db)
    answer = checkin(db, dev, count=50)

    refused = report(db, dev, answer.assignment_id, make_body(biased_model))

    assert isinstance(refused, Refused) and refused.status == 422
    assert refused.message and __import__("re").search(message, refused.message), refused.message
    r = round_by_id(db, answer.round_id)
    assert (r.status, r.invalid, r.reported) == ("open", 1, 0)
    with db() as session:
        assert session.get(ModelVersion, (1, 1)) is None


def test_report_metadata_must_carry_num_examples(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model)
    dev = device(db)
    answer = checkin(db, dev)
    delta = {s.name: np.zeros(s.shape, np.float32) for s in manifest_of(biased_model).global_params}

    refused = report(db, dev, answer.assignment_id, encode_sparse_delta(delta))

    assert isinstance(refused, Refused) and "num_examples" in refused.message


def test_a_late_abort_is_refused_but_not_counted_as_a_late_report(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, round_duration_seconds=10)
    dev = device(db)
    answer = checkin(db, dev, now=1.0)

    refused = abort(db, dev, answer.assignment_id, 12.0)

    # The round's `late` counts late reports only, as the reports metric does.
    assert isinstance(refused, Refused) and refused.status == 409
    assert round_by_id(db, answer.round_id).late == 0


def test_ownership_unknown_repeated_and_aborted(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=5)
    owner, other = device(db), device(db)
    answer = checkin(db, owner)
    aborter = device(db)
    aborted = checkin(db, aborter)

    stolen = report(db, other, answer.assignment_id, delta_body(biased_model, 1.0))
    report(db, owner, answer.assignment_id, delta_body(biased_model, 1.0))
    repeated = report(db, owner, answer.assignment_id, delta_body(biased_model, 1.0))
    abort(db, aborter, aborted.assignment_id, 3.0)
    after_abort = report(db, aborter, aborted.assignment_id, delta_body(biased_model, 1.0))
    unknown = report(db, owner, "nope", b"", 3.0, "")
    # The aborter's answer was lost and it aborts again; another device tries it too.
    again = abort(db, aborter, aborted.assignment_id, 4.0)
    not_its = abort(db, other, aborted.assignment_id, 4.0)

    assert (stolen.status, repeated.status, after_abort.status, unknown.status) == (403, 409, 409, 404)
    assert not isinstance(again, Refused) and again.id == aborted.round_id
    assert isinstance(not_its, Refused) and not_its.status == 403
    r = round_by_id(db, answer.round_id)
    assert (r.reported, r.aborted) == (1, 1)


def test_evaluation_round_aggregates_metrics_only(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, evaluation_target_reports=2, min_evaluation_reports=2)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        open_round(session, population, EVALUATION, 0.5)
    a, b, c = device(db), device(db), device(db)
    answers = [checkin(db, d, kind="evaluation") for d in (a, b, c)]
    good = {"loss_sum": 8.0, "squared_error_sum": 8.0, "correct_sum": 3.0, "weight_sum": 10.0}

    bad = report(
        db,
        c,
        answers[2].assignment_id,
        json.dumps({"num_examples": 10, "metrics": {**good, "correct_sum": 11.0}}).encode(),
        ctype="application/json",
    )
    report(
        db,
        a,
        answers[0].assignment_id,
        json.dumps({"num_examples": 10, "metrics": good}).encode(),
        ctype="application/json",
    )
    done = report(
        db,
        b,
        answers[1].assignment_id,
        json.dumps(
            {"num_examples": 30, "metrics": {**good, "weight_sum": 30.0, "squared_error_sum": 24.0}}
        ).encode(),
        ctype="application/json",
    )

    assert isinstance(bad, Refused) and "correct_sum" in bad.message
    assert done.status == "committed" and done.result_version is None
    summary = summarize_metrics(done)
    assert summary["rmse"] == pytest.approx((32.0 / 40.0) ** 0.5)
    assert summary["accuracy"] == pytest.approx(6.0 / 40.0)
    with db() as session:
        assert session.get(ModelVersion, (1, 1)) is None  # evaluation never changes the model


def test_evaluation_rounds_open_every_k_commits(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=1, evaluation_every=2)
    for i in range(2):
        dev = device(db)
        answer = checkin(db, dev, now=1.0 + i)
        assert "evaluation" not in {r for r in _open_kinds(db)} or i == 1
        report(db, dev, answer.assignment_id, delta_body(biased_model, 0.1), now=1.5 + i)

    assert _open_kinds(db) == {"training", "evaluation"}


def _open_kinds(factory: sessionmaker[Session]) -> set[str]:
    with factory() as session:
        population = session.scalars(select(Population)).one()
        return set(open_rounds(session, population))


def test_population_creation_refuses_bad_models(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    corrupt = ExportedModel(biased_model.tflite + b"x", biased_model.manifest, biased_model.initial_global)
    wrong_params = ExportedModel(
        biased_model.tflite, biased_model.manifest, encode_params({"x": np.zeros(1, np.float32)})
    )
    cases: list[tuple[str, ExportedModel, dict[str, Any], str]] = [
        ("p", corrupt, {}, "sha256"),
        ("p", wrong_params, {}, "missing"),
        ("p", biased_model, {"target_reports": 2, "min_reports": 3}, "min_reports"),
        ("p", biased_model, {"server_optimizer": {"name": "adagrad"}}, "adagrad"),
        # Task-config numbers that would wrap in the model's int32/float32 inputs, or are absurd.
        ("p", biased_model, {"task_config": {"update_max_steps": 2**32 + 5}}, r"update_max_steps .*10000"),
        ("p", biased_model, {"task_config": {"reconstruction_max_steps": 10_001}}, r"\[0, 10000\]"),
        ("p", biased_model, {"task_config": {"update_learning_rate": 1e39}}, "update_learning_rate"),
        ("p", biased_model, {"task_config": {"shuffle_seed": 2**64}}, "shuffle_seed"),
        ("p", biased_model, {"task_config": {"l2_global": float("nan")}}, "l2_global must be finite"),
        ("p", biased_model, {"task_config": [1, 2]}, "task_config must be a JSON object"),
        ("bad name!", biased_model, {}, "name"),
    ]
    for name, model, settings, message in cases:
        with db.begin() as session, pytest.raises(PopulationError, match=message):
            create_population(session, name, model, settings, 0.0)
    make_population(db, biased_model)
    with db.begin() as session, pytest.raises(PopulationError, match="already exists"):
        create_population(session, "p", biased_model, {}, 0.0)


def test_version_zero_is_the_exported_initial_model(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, server_optimizer={"name": "adam", "learning_rate": 0.01})

    params = version_params(db, biased_model, 0)

    initial = load(biased_model.initial_global)
    for k in initial:
        np.testing.assert_array_equal(params[k], initial[k])
    with db() as session:
        state = load(session.get(ModelVersion, (1, 0)).optimizer_state)  # type: ignore[union-attr]
    assert {k.split("/")[0] for k in state} == {"m", "v"}


def test_old_model_versions_are_pruned_but_not_the_export_or_one_an_open_round_uses(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(
        db,
        biased_model,
        target_reports=1,
        keep_model_versions=1,
        evaluation_every=1,
        evaluation_round_duration_seconds=1e6,
    )
    for step in range(1, 4):
        dev = device(db)
        answer = checkin(db, dev, now=float(step))
        committed = report(db, dev, answer.assignment_id, delta_body(biased_model, 0.1), now=step + 0.5)
        assert committed.result_version == step
        if step == 1:  # the evaluation round opened on version 1 stays open (no reports)
            assert current_round(db, "evaluation").base_version == 1

    with db() as session:
        kept = session.scalars(select(ModelVersion.version).order_by(ModelVersion.version)).all()
    assert kept == [0, 1, 3]


def honest_body(model: ExportedModel, rng: np.random.Generator, rows: int = 20) -> bytes:
    """A delta of the size honest devices send: small steps on a few item rows and the mean."""
    delta = {s.name: np.zeros(s.shape, np.float32) for s in manifest_of(model).global_params}
    chosen = rng.choice(delta["item_embeddings"].shape[0], rows, replace=False)
    delta["item_embeddings"][chosen] = rng.normal(0, 0.05, (rows, delta["item_embeddings"].shape[1]))
    delta["item_bias"][chosen] = rng.normal(0, 0.05, rows)
    delta["global_mean"][:] = rng.normal(0, 0.01)
    return encode_sparse_delta(delta, {"num_examples": str(int(rng.integers(5, 40))), "metrics": "{}"})


def test_ten_hostile_devices_cannot_move_the_global_mean_under_the_defaults(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: a population with default settings (rounds of 10) that has trained two honest rounds.
    make_population(db, biased_model)
    rng = np.random.default_rng(0)
    now = 1.0
    for _ in range(2):
        for dev in [device(db) for _ in range(10)]:
            answer = checkin(db, dev, count=50, now=now)
            assert report(db, dev, answer.assignment_id, honest_body(biased_model, rng), now=now).status
    before = version_params(db, biased_model, 2)["global_mean"]

    # Execute: ten freshly enrolled devices claim the most examples they can and push the mean
    # by 999, inside the update-norm bound (1000): they fill the next round.
    hostile = [device(db) for _ in range(10)]
    answers = [checkin(db, dev, count=2**31 - 1, now=now) for dev in hostile]
    push = np.full(1, 999.0, np.float32)
    results = [
        report(
            db,
            dev,
            a.assignment_id,
            delta_body(biased_model, 0.0, num_examples=300, rows=(), global_mean=push),
            now=now,
        )
        for dev, a in zip(hostile, answers, strict=True)
    ]

    # Assert: the round took their reports and committed, yet the mean barely moved.
    assert all(not isinstance(r, Refused) for r in results), results
    assert results[-1].status == "committed" and results[-1].result_version == 3
    moved = float(version_params(db, biased_model, 3)["global_mean"][0] - before[0])
    assert 0 < moved < 0.05, moved  # the honest deltas of the mean were ~0.01; the push was 999


@pytest.mark.parametrize("method", ["none", "median"])
def test_a_round_clipped_to_the_last_rounds_norms_commits_what_the_pipeline_computes(
    db: sessionmaker[Session], biased_model: ExportedModel, method: str
) -> None:
    # Prepare: a first round leaves reference norms; the second has an outsized report to clip.
    make_population(
        db,
        biased_model,
        target_reports=4,
        robust_aggregation=method,
        server_optimizer={"name": "sgd", "learning_rate": 1.0},
        report_deltas="keep",  # the test aggregates the stored reports again
    )
    rng = np.random.default_rng(1)
    for bodies in ([honest_body(biased_model, rng) for _ in range(4)], [delta_body(biased_model, 5.0)]):
        bodies += [honest_body(biased_model, rng) for _ in range(4 - len(bodies))]
        for body in bodies:
            dev = device(db)
            answer = checkin(db, dev)
            assert report(db, dev, answer.assignment_id, body).status

    # Execute: the rule's pipeline in memory, over the second round's stored reports.
    with db() as session:
        population = session.scalars(select(Population)).one()
        rule = population_settings(population).robust()
        first, second = session.scalars(select(Round).where(Round.status == "committed").order_by(Round.id))
        stored = session.execute(
            select(Report.weight, Report.delta)
            .where(Report.round_id == second.id)
            .order_by(Report.assignment_id)
        ).all()
    shapes = {s.name: s.shape for s in manifest_of(biased_model).global_params}
    assert known_bounds(first.norm_reference, shapes, rule) is not None  # one pass over the reports
    weights = [w for w, _ in stored]
    inputs = RoundInputs(0, weights=weights, reference=NormReference.from_json(first.norm_reference))
    result = Pipeline(shapes, rule).aggregate(inputs, ((decode_sparse_delta(b), w) for w, b in stored))
    expected, reference = result.mean_delta, result.norm_reference
    assert reference is not None

    # Assert: the server committed that mean and that next reference.
    before, after = version_params(db, biased_model, 1), version_params(db, biased_model, 2)
    for name, value in expected.items():
        np.testing.assert_allclose(after[name] - before[name], value, rtol=1e-5, atol=1e-7)
    stored_reference = NormReference.from_json(second.norm_reference)
    assert stored_reference is not None and stored_reference.reference == pytest.approx(reference.reference)
    for name, history in reference.observed.items():
        assert stored_reference.observed[name] == pytest.approx(history)


# ---- DP-FedAvg ---------------------------------------------------------------------------


def dp_settings(clip_norm: float, noise_multiplier: float, **extra: object) -> dict[str, object]:
    return {
        "clip_norm": clip_norm,
        "noise_multiplier": noise_multiplier,
        "population_size": 100,
        **extra,
    }


def commit_round(
    factory: sessionmaker[Session], model: ExportedModel, reports: list[tuple[float, int]]
) -> Any:
    """For each (value, num_examples), a new device checks in and reports `delta_body`; the last answer."""
    answer: Any = None
    for value, num_examples in reports:
        dev = device(factory)
        assigned = checkin(factory, dev)
        answer = report(factory, dev, assigned.assignment_id, delta_body(model, value, num_examples))
    return answer


def test_a_dp_round_weighs_reports_equally(db: sessionmaker[Session], biased_model: ExportedModel) -> None:
    make_population(db, biased_model, target_reports=2, differential_privacy=dp_settings(100.0, 0.0))
    before = version_params(db, biased_model, 0)

    committed = commit_round(db, biased_model, [(1.0, 10), (4.0, 30)])

    after = version_params(db, biased_model, 1)
    np.testing.assert_allclose(after["global_mean"] - before["global_mean"], 2.5, rtol=1e-6)  # not 3.25
    assert committed.metrics["dp_noise_stddev"] == 0.0
    assert "dp_epsilon" not in committed.metrics  # no noise: no finite epsilon


def test_a_dp_round_noises_every_row_and_records_epsilon(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=2, differential_privacy=dp_settings(10.0, 1.0))
    before = version_params(db, biased_model, 0)

    committed = commit_round(db, biased_model, [(1.0, 10), (1.0, 10)])

    after = version_params(db, biased_model, 1)
    change = after["item_embeddings"] - before["item_embeddings"]
    assert np.count_nonzero(change) == change.size  # rows no device touched moved too
    # Noise stddev on the mean: 1.0 * 10 / 2 reports = 5 per coordinate.
    assert 4.5 < float(np.std(np.delete(change, [3, 7], axis=0))) < 5.5
    assert committed.metrics["dp_noise_stddev"] == 5.0
    with db() as session:
        population = session.scalars(select(Population)).one()
        expected = population_settings(population).privacy_spent(1).epsilon
    assert committed.metrics["dp_epsilon"] == pytest.approx(expected)


def test_a_report_above_the_dp_clip_norm_is_refused_with_the_bound(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    make_population(db, biased_model, target_reports=1, differential_privacy=dp_settings(1.0, 1.0))
    dev = device(db)
    answer = checkin(db, dev)
    assert answer.kind == "training"

    refused = report(db, dev, answer.assignment_id, delta_body(biased_model, 0.2))  # norm 0.2 * sqrt(33)

    assert isinstance(refused, Refused) and refused.status == 422
    assert "1.14891 exceeds this round's DP clip norm 1" in refused.message
    assert round_by_id(db, answer.round_id).invalid == 1


def test_the_privacy_budget_stops_training_rounds_and_says_so(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    budget = epsilon(1.0, 1 / 100, 2, 1e-5)  # exactly two rounds' worth
    dp = dp_settings(10.0, 1.0, epsilon_budget=budget)
    make_population(db, biased_model, target_reports=1, evaluation_every=0, differential_privacy=dp)

    first, second = commit_round(db, biased_model, [(0.1, 10)]), commit_round(db, biased_model, [(0.1, 10)])
    refused = checkin(db, device(db))

    assert (first.status, second.status) == ("committed", "committed")
    assert isinstance(refused, Refused) and refused.status == 409
    assert "privacy budget spent" in refused.message and "after 2 training rounds" in refused.message
    with db() as session:
        population = session.scalars(select(Population)).one()
        assert TRAINING not in open_rounds(session, population)
        status = population_out(session, population)
    assert status.privacy is not None and status.privacy.budget_spent
    assert status.privacy.epsilon == pytest.approx(budget) and status.training_rounds_committed == 2


def test_adaptive_clipping_moves_the_clip_norm_round_by_round(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # No noise, so the clip norm's step is exact: both devices unclipped (share 1) against a
    # target of 0.5 shrinks it by exp(-0.2 * 0.5).
    adaptive = {"target_unclipped_quantile": 0.5, "clip_learning_rate": 0.2, "clipped_count_stddev": 0.0}
    make_population(
        db, biased_model, target_reports=2, differential_privacy=dp_settings(10.0, 0.0, **adaptive)
    )
    a, b = device(db), device(db)
    first, second = checkin(db, a), checkin(db, b)
    within = {"dp_within_clip": 1.0}

    report(db, a, first.assignment_id, delta_body(biased_model, 0.1, metrics=within))
    committed = report(db, b, second.assignment_id, delta_body(biased_model, 0.1, metrics=within))
    following = checkin(db, device(db))

    assert first.clip_norm == 10.0
    assert committed.metrics["dp_unclipped_share"] == 1.0
    assert committed.metrics["dp_next_clip_norm"] == pytest.approx(10.0 * np.exp(-0.1))
    assert "dp_within_clip" not in committed.metrics  # only the noised share is released
    assert following.clip_norm == pytest.approx(10.0 * np.exp(-0.1))
    assert current_round(db).metrics["dp_clip_norm"] == following.clip_norm


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"update_loss": 1.0}, "'dp_within_clip' must be 1 .* or 0 .*; adaptive clipping needs it, got None"),
        ({"dp_within_clip": 0.5}, "got 0.5"),
        ({"dp_within_clip": 1.0, "dp_clip_norm": -9.0}, r"\['dp_clip_norm'\] are reserved for the server"),
    ],
)
def test_adaptive_clipping_refuses_a_missing_or_forged_count(
    db: sessionmaker[Session], biased_model: ExportedModel, metrics: dict[str, float], message: str
) -> None:
    adaptive = {"target_unclipped_quantile": 0.5, "clipped_count_stddev": 1.0}
    make_population(
        db, biased_model, target_reports=2, differential_privacy=dp_settings(10.0, 1.0, **adaptive)
    )
    dev = device(db)
    answer = checkin(db, dev)

    refused = report(db, dev, answer.assignment_id, delta_body(biased_model, 0.1, metrics=metrics))

    assert isinstance(refused, Refused) and refused.status == 422
    assert __import__("re").search(message, refused.message), refused.message
    assert current_round(db).metrics == {"dp_clip_norm": 10.0}


def test_a_commit_starts_from_the_version_this_process_committed_as_if_it_read_it_back(
    db: sessionmaker[Session], biased_model: ExportedModel, tmp_path: Path
) -> None:
    other = make_engine(f"sqlite:///{tmp_path / 'other.sqlite'}")
    migrate(str(other.url))
    elsewhere = sessionmaker(other, expire_on_commit=False)
    reads: list[str] = []

    def read(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "FROM model_versions" in statement and "params" in statement:
            reads.append(statement)

    def two_rounds(factory: sessionmaker[Session], read_back: bool) -> dict[str, np.ndarray]:
        make_population(factory, biased_model, target_reports=1, server_optimizer={"name": "adam"})
        for value in (1.0, 0.5):
            if read_back:
                _latest.clear()  # as another process, or this one restarted, would
            dev = device(factory)
            answer = checkin(factory, dev)
            reads.clear()
            event.listen(factory.kw["bind"], "before_cursor_execute", read)
            try:
                committed = report(factory, dev, answer.assignment_id, delta_body(biased_model, value))
            finally:
                event.remove(factory.kw["bind"], "before_cursor_execute", read)
            assert committed.status == "committed"
        return version_params(factory, biased_model, 2)

    kept = two_rounds(db, read_back=False)
    reads_kept = len(reads)
    read_back = two_rounds(elsewhere, read_back=True)
    other.dispose()

    assert reads_kept == 0 and len(reads) == 1  # the second commit read version 1 only when asked to
    assert kept.keys() == read_back.keys()
    for name in kept:
        np.testing.assert_array_equal(kept[name], read_back[name])
