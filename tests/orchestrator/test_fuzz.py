"""Property-based fuzz of the whole HTTP API from its own OpenAPI description (schemathesis): whatever
a client sends, the server answers without a 5xx, and keeps answering, with a status the description
documents for that operation (and for a refusal, its one error body).

Requests go to a real server process on loopback. So that they get past authentication and the
look-ups, most carry a real device token (the admin token on admin routes), and most path
parameters are swapped for a population, an assignment and a model version that exist; the rest
are left as generated, to fuzz those too. Bounded: a few dozen cases per operation. One exception to
"documented": a generated header that breaks HTTP/1.1's own framing gets uvicorn's plain-text 400
(see FRAMING_HEADERS).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from model_export.config import ModelConfig
from orchestrator.app import create_app
from orchestrator.settings import Settings
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

CASES_PER_OPERATION = 80
# Headers that frame the HTTP/1.1 message itself. A generated value can break the framing (an empty
# Transfer-Encoding beside a Content-Length): uvicorn's parser refuses such a request before the
# application sees it, with its own one-line plain-text 400, and closes the connection.
FRAMING_HEADERS = frozenset({"transfer-encoding", "content-length", "host", "connection"})


@dataclass(frozen=True)
class Target:
    url: str
    device_token: str
    existing: dict[str, str]  # path parameter -> a value that exists


@pytest.fixture(scope="module")
def target(
    tmp_path_factory: pytest.TempPathFactory, export: Callable[[ModelConfig], Path]
) -> Iterator[Target]:
    server = Server(tmp_path_factory.mktemp("fuzz") / "orchestrator.sqlite").start()
    try:
        model_dir = export(BIASED)
        settings = {"target_reports": 1000, "evaluation_target_reports": 1000}
        created = admin_create_population(server.url, model_dir, "p", json.dumps(settings))
        assert created.status_code == 201, created.text
        token = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]
        assignment = httpx.post(
            f"{server.url}/v1/populations/p/checkin",
            json={"example_count": 50},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).json()
        existing = {
            "population": "p",
            "name": "p",
            "assignment_id": assignment["assignment_id"],
            "version": "0",
            "sha256": created.json()["artifact_sha256"],
        }
        yield Target(server.url, token, existing)
    finally:
        server.stop()


# The description the server publishes at /openapi.json, built from the same app in this process
# so that each operation is a test of its own.
SCHEMA = schemathesis.openapi.from_dict(
    create_app(Settings(database_url="sqlite://", admin_token=SecretStr(ADMIN_TOKEN))).openapi()
)


def operations() -> list[tuple[str, str]]:
    found = []
    for result in SCHEMA.get_all_operations():
        assert isinstance(result, Ok), f"the server's OpenAPI description is invalid: {result}"
        found.append((result.ok().method.upper(), result.ok().path))
    return found


OPERATIONS = operations()


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_request_makes_the_server_fail(method: str, path: str, target: Target) -> None:
    operation = SCHEMA[path][method]
    # Requests that fit the description and requests that break it (wrong types, missing fields).
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

    @given(case=st.one_of(*(operation.as_strategy(mode) for mode in modes)))
    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        derandomize=True,  # the same cases in every CI run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case) -> None:
        # A stable choice per case: 3 in 4 cases authenticate, 3 in 4 name things that exist.
        choice = zlib.crc32(repr((case.path_parameters, case.query, case.body)).encode())
        headers = {}
        if choice % 4:
            admin = path.startswith("/v1/admin") or path == "/metrics"
            headers["Authorization"] = f"Bearer {ADMIN_TOKEN if admin else target.device_token}"
        if (choice >> 2) % 4:
            for name in case.path_parameters or {}:
                if name in target.existing:
                    case.path_parameters[name] = target.existing[name]

        response = case.call(base_url=target.url, headers=headers, timeout=30)

        plain_text = response.headers.get("content-type", [""])[0].startswith("text/plain")
        if (
            FRAMING_HEADERS & {name.lower() for name in case.headers or {}}
            and response.status_code == 400
            and plain_text
        ):
            assert response.text == "Invalid HTTP request received."
            assert httpx.get(f"{target.url}/health", timeout=10).status_code == 200  # and still serves
            return

        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} answered {response.status_code}: {response.text[:500]}"
        )
        documented = operation.definition.raw["responses"]
        assert str(response.status_code) in documented, (
            f"{case.method} {case.formatted_path} answered {response.status_code}, which /openapi.json "
            f"does not document for it ({sorted(documented)}): {response.text[:300]}"
        )
        if response.status_code >= 400:
            assert isinstance(response.json()["detail"], str), response.text[:300]

    fuzz()
