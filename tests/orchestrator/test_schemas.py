"""The server's request and response models are the protocol's dataclasses: a message the server
accepts is one the device accepts and the reverse, and the OpenAPI description carries the
contract's bounds and descriptions."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError

from contracts import protocol
from orchestrator.api import schemas
from orchestrator.app import create_app
from orchestrator.settings import Settings
from tests.orchestrator.conftest import ADMIN_TOKEN

NUMBERS = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([protocol.MAX_COUNT, protocol.MAX_COUNT + 1, 2**63, -(2**63), 2.592e6, 2.6e6]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
)
CONDITIONS = st.dictionaries(
    st.text(min_size=62, max_size=66) | st.text(max_size=2),
    st.booleans() | st.integers(0, 1),
    max_size=34,
)


def verdicts(adapter: TypeAdapter[Any] | type[BaseModel], message: type, data: Any) -> tuple[bool, bool]:
    """Whether the server (its pydantic model) and the device (`protocol.parse`) accept `data`."""
    try:
        if isinstance(adapter, TypeAdapter):
            adapter.validate_python(data)
        else:
            adapter.model_validate(data)
        server = True
    except ValidationError:
        server = False
    try:
        protocol.parse(message, data, "the message")
        device = True
    except protocol.InvalidMessage:
        device = False
    return server, device


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    body=st.fixed_dictionaries(
        {"example_count": NUMBERS},
        optional={
            "task": st.sampled_from(["training", "evaluation", "mining", 1, None]),
            "conditions": CONDITIONS,
            "items": st.just([1, 2]),
        },
    )
)
def test_the_server_and_the_device_accept_the_same_check_ins(body: dict[str, Any]) -> None:
    server, device = verdicts(schemas.CHECK_IN, protocol.CheckIn, body)

    assert server == device, body


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    answer=st.fixed_dictionaries(
        {"reason": st.text(max_size=3) | st.just("x" * 2001) | NUMBERS, "retry_after_seconds": NUMBERS},
        optional={"accepted": st.sampled_from([False, True, 0])},
    )
)
def test_the_server_and_the_device_accept_the_same_rejections(answer: dict[str, Any]) -> None:
    server, device = verdicts(schemas.RejectionOut, protocol.Rejection, answer)

    assert server == device, answer


def test_the_openapi_description_carries_the_contracts_bounds_and_descriptions() -> None:
    app = create_app(Settings(database_url="sqlite://", admin_token=SecretStr(ADMIN_TOKEN)))

    components = app.openapi()["components"]["schemas"]

    check_in = components["CheckIn"]["properties"]
    assert check_in["example_count"]["maximum"] == protocol.MAX_COUNT
    assert check_in["example_count"]["description"] == "how many examples the device holds"
    assert check_in["conditions"]["maxProperties"] == protocol.MAX_CONDITIONS
    assert check_in["conditions"]["propertyNames"] == {"maxLength": protocol.MAX_CONDITION_NAME}
    assert components["CheckIn"]["additionalProperties"] is False
    assignment = components["Assignment"]["properties"]
    assert assignment["assignment_id"]["pattern"] == protocol.ID_PATTERN
    assert assignment["deadline"]["description"] == "server time (unix seconds) by which to report"
    assert components["Enrolled"]["properties"]["token"]["pattern"] == protocol.TOKEN_PATTERN
    assert "maxLength" in components["Rejection"]["properties"]["reason"]
