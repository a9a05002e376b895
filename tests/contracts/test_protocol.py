"""Reading the protocol's messages: what a well-formed message becomes, and what each malformed one
is told (the field, what it held and what was expected)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest

from contracts.protocol import (
    MAX_COUNT,
    Assignment,
    CheckIn,
    InvalidMessage,
    PopulationView,
    RoundView,
    parse,
)

ASSIGNMENT = Assignment(
    assignment_id="a1b2",
    round_id=3,
    kind="training",
    deadline=1_700_000_000.5,
    seconds_left=30.0,
    model_version=2,
    artifact_sha256="ab" * 32,
    artifact_url="/v1/artifacts/" + "ab" * 32,
    params_url="/v1/populations/p/models/2/global",
    manifest_url="/v1/populations/p/manifest",
    report_url="/v1/assignments/a1b2/report",
    abort_url="/v1/assignments/a1b2/abort",
    task_config={"update_epochs": 1},
    aggregation="secure",
    secure_url="/v1/assignments/a1b2/secure",
)
ROUND = RoundView(
    id=1,
    kind="evaluation",
    status="open",
    base_version=0,
    result_version=None,
    target=10,
    capacity=13,
    min_reports=5,
    opened_at=0.0,
    deadline=60.0,
    closed_at=None,
    counters={"checked_in": 2},
    total_weight=0.0,
    metrics={},
)


def as_json(message: Any) -> Any:
    return json.loads(json.dumps(dataclasses.asdict(message)))


SENT = as_json(ASSIGNMENT)
EMPTY_POPULATION = as_json(PopulationView("p", 0, 0, "ab" * 32, {}, []))


def test_a_message_reads_back_from_its_json() -> None:
    population = PopulationView("p", 2, 2, "ab" * 32, {"target_reports": 10}, [ROUND], None)

    read = parse(Assignment, as_json(ASSIGNMENT), "the assignment")
    status = parse(PopulationView, as_json(population), "the status")

    assert read == ASSIGNMENT
    assert status == population and isinstance(status.open_rounds[0], RoundView)


def test_fields_with_a_default_may_be_left_out() -> None:
    answer = {k: v for k, v in as_json(ASSIGNMENT).items() if k not in ("aggregation", "secure_url")}

    read = parse(Assignment, answer, "the assignment")
    check_in = parse(CheckIn, {"example_count": 5}, "the check-in")

    assert (read.aggregation, read.secure_url, read.accepted) == ("plaintext", None, True)
    assert check_in == CheckIn(5, "training", {})


@pytest.mark.parametrize(
    ("message", "data", "expected"),
    [
        (
            CheckIn,
            {"example_count": MAX_COUNT + 1},
            r"example_count is 2147483648; expected an integer in \[0, 2147483647\]",
        ),
        (CheckIn, {"example_count": True}, r"example_count is True; expected a 64-bit integer"),
        (CheckIn, {"example_count": 1, "task": "mining"}, r"task is 'mining'; expected 'training' or"),
        (
            CheckIn,
            {"example_count": 1, "conditions": {"idle": "yes"}},
            r"conditions\['idle'\] is 'yes'; expected true or false",
        ),
        (
            CheckIn,
            {"example_count": 1, "conditions": {"x" * 65: True}},
            r"a key of conditions is 'x+'; expected a string of at most 64 characters",
        ),
        (
            CheckIn,
            {"example_count": 1, "conditions": {f"c{i}": True for i in range(33)}},
            r"conditions is .*; expected a JSON object of at most 32 entries",
        ),
        (CheckIn, {"example_count": 1, "items": [3]}, r"unexpected fields \['items'\]"),
        (CheckIn, [1], r"the message is a JSON list; expected a JSON object"),
        (
            PopulationView,
            {**EMPTY_POPULATION, "open_rounds": [{**as_json(ROUND), "kind": 1}]},
            r"open_rounds\[0\]\.kind is 1; expected 'training' or 'evaluation'",
        ),
        (
            Assignment,
            {**SENT, "secure_url": None},
            r"secure_url is None; expected a URL on the orchestrator's origin when aggregation is 'secure'",
        ),
        (
            Assignment,
            {**SENT, "aggregation": "plaintext", "secure_url": None, "secure_parameters": {}},
            r"secure_parameters come only with aggregation 'secure'",
        ),
        (Assignment, {**SENT, "secure_parameters": [1]}, r"secure_parameters is \[1\]; expected"),
        (Assignment, {**SENT, "seconds_left": 1e300}, r"seconds_left is 1e\+300; expected a finite"),
        (Assignment, {**SENT, "report_url": "x" * 2001}, r"report_url is 'x+\.\.\.; expected a string"),
    ],
)
def test_a_malformed_message_names_the_field_and_what_was_expected(
    message: type, data: Any, expected: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        parse(message, data, "the message")

    assert re.search(expected, str(refused.value)), str(refused.value)
    assert str(refused.value).startswith("the message")
