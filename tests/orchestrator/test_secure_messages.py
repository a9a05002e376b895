"""Phase messages that arrive together are handled in one transaction, each as it would be alone (a
real SQLite file, time passed in explicitly)."""

from __future__ import annotations

from typing import Any

from orchestrator.rounds.refusals import Refused
from orchestrator.rounds.secure import messages as secure_rounds
from orchestrator.service.population_creation import ExportedModel
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.devices import enroll
from orchestrator.service.secure_messages import MessageCall, handle_messages
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from tests.orchestrator.conftest import make_population
from tests.orchestrator.test_rounds import checkin
from tests.orchestrator.test_secure_rounds import SECURE, state


def _enrolled(db: sessionmaker[Session]) -> tuple[str, str]:
    with db.begin() as session:
        return enroll(session, 0.0)


def _handled(db: sessionmaker[Session], calls: list[MessageCall], now: float) -> tuple[list[Any], int, int]:
    """The answers, how many transactions and how many SQL statements were run for them."""
    transactions = statements = 0

    def began(*_args: Any) -> None:
        nonlocal transactions
        transactions += 1

    def counted(*_args: Any) -> None:
        nonlocal statements
        statements += 1

    engine = db.kw["bind"]
    event.listen(engine, "begin", began)
    event.listen(engine, "before_cursor_execute", counted)
    try:
        return handle_messages(db, calls, now), transactions, statements
    finally:
        event.remove(engine, "begin", began)
        event.remove(engine, "before_cursor_execute", counted)


def _status(answer: Any) -> Any:
    return answer.status if isinstance(answer, Refused) else answer


def test_keys_sent_together_close_the_roster_in_one_transaction_and_refusals_change_nothing(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    # Prepare: five devices in a secure round of four (capacity 5, roster closes at four keys
    # only once its advertise phase ends; here at the fifth device's or the deadline)
    make_population(db, biased_model, **{**SECURE, "target_reports": 5})
    enrolled = [_enrolled(db) for _ in range(5)]
    answers = [checkin(db, device_id, now=1.0) for device_id, _ in enrolled]
    params = RoundParameters.from_json(state(db, enrolled[0][0], answers[0].assignment_id, 1.0)["parameters"])
    keys = [DeviceSession(params).advertise().to_json() for _ in enrolled]
    advertise = secure_rounds.advertise
    calls = [
        MessageCall(advertise, a.assignment_id, token, body, "share_keys")
        for (_, token), a, body in zip(enrolled, answers, keys, strict=True)
    ]
    wrong_token = MessageCall(
        secure_rounds.advertise, answers[1].assignment_id, enrolled[2][1], keys[1], None
    )
    unknown = MessageCall(advertise, "0" * 32, enrolled[0][1], keys[0], None)
    malformed = MessageCall(advertise, answers[4].assignment_id, enrolled[4][1], {"x": 1}, None)

    # Execute: the first device alone; then three more with a device using another's assignment,
    # an unknown assignment and a malformed advertisement (from the fifth device); then the fifth
    # device's keys and a repeat of the first device's
    (alone,), _, statements_alone = _handled(db, calls[:1], 2.0)
    together, transactions, statements_together = _handled(
        db, [*calls[1:4], wrong_token, unknown, malformed], 2.0
    )
    last, _, _ = _handled(db, [calls[4], calls[0]], 2.0)

    # Assert: each device its own index in arrival order, the refused ones refused as the route
    # refuses them and counted nowhere (the fifth device then advertises and closes the roster:
    # its answer carries the share-keys state with all five); the group is one transaction, which
    # runs fewer statements than its three accepted messages would alone
    assert alone["index"] == 1 and alone["state"]["phase"] == "advertise"
    assert [a["index"] for a in together[:3]] == [2, 3, 4]
    assert [_status(a) for a in together[3:]] == [403, 404, 422]
    assert last[0]["index"] == 5
    assert last[0]["state"]["phase"] == "share_keys" and len(last[0]["state"]["roster"]) == 5
    assert _status(last[1]) == 409  # the first device's keys a second time
    assert transactions == 1
    assert statements_together < 3 * statements_alone, (statements_together, statements_alone)
