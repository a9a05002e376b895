"""Check-ins refused by a secure round's closed roster wait for the next round, up to its capacity
(a real server on loopback, real HTTP)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population
from tests.orchestrator.test_secure_protocol import SETTINGS

# Rounds of three; a roster whose devices send no shares is abandoned 2 s after it closes.
ROUNDS_OF_THREE: dict[str, Any] = {
    **SETTINGS,
    "target_reports": 3,
    "min_reports": 3,
    "retry_after_seconds": 30.0,
    "secure": {**cast(dict[str, Any], SETTINGS["secure"]), "share_keys_seconds": 2},
}


def _enrolled(url: str) -> str:
    return str(httpx.post(f"{url}/v1/devices", timeout=10).json()["token"])


def _check_in(url: str, token: str, wait: float | str | None = 30.0) -> tuple[httpx.Response, float]:
    """The answer to a check-in that can wait `wait` seconds (None: says nothing), and how long it
    took."""
    start = time.monotonic()
    answer = httpx.post(
        f"{url}/v1/populations/p/checkin",
        params=None if wait is None else {"wait": wait},
        json={"example_count": 50},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    return answer, time.monotonic() - start


def _roster_closed_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "orchestrator_checkins_total" and sample.labels.get("answer") == "roster_closed"
    )


def test_check_ins_refused_by_a_closed_roster_are_held_for_the_next_round_up_to_its_capacity(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a round of three whose roster closed (three devices advertised their keys)
    created = admin_create_population(server.url, export(BIASED), "p", json.dumps(ROUNDS_OF_THREE))
    assert created.status_code == 201, created.text
    first_tokens = [_enrolled(server.url) for _ in range(3)]
    first = [_check_in(server.url, token)[0].json() for token in first_tokens]
    params = RoundParameters.from_json(first[0]["secure_parameters"])
    for token, assignment in zip(first_tokens, first, strict=True):
        advertised = httpx.post(
            f"{server.url}{assignment['secure_url']}/keys",
            json=DeviceSession(params).advertise().to_json(),
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert advertised.status_code == 200, advertised.text
    tokens = [_enrolled(server.url) for _ in range(4)]
    before = _roster_closed_total(server.url)

    # Execute: a device that says nothing of waiting checks in while the roster is closed, then
    # four that can wait 30 s (the round is then abandoned at its share-keys deadline: nobody
    # sends shares); and check-ins that ask for a wait out of range
    impatient, impatient_seconds = _check_in(server.url, _enrolled(server.url), None)
    out_of_range = [_check_in(server.url, tokens[0], wait)[0] for wait in (0, 121, "soon")]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda token: _check_in(server.url, token), tokens))
    after = _roster_closed_total(server.url)

    # Assert: the device that could not wait was refused at once, places free or not; of the four
    # that could, three were held (a round's capacity) and admitted into the next round once the
    # first was abandoned; the fourth was refused at once and told when to come back; each
    # device's refusal counted once, however often a held one was checked in again; the waits
    # out of range refused with a clear 422
    assert not impatient.json()["accepted"] and impatient_seconds < 1.0
    accepted = [(answer.json(), seconds) for answer, seconds in answers if answer.json()["accepted"]]
    refused = [(answer, seconds) for answer, seconds in answers if not answer.json()["accepted"]]
    assert len(accepted) == 3 and len(refused) == 1, [answer.text for answer, _ in answers]
    assert {answer["round_id"] for answer, _ in accepted} == {first[0]["round_id"] + 1}
    assert all(seconds > 1.0 for _, seconds in accepted)
    ((rejection, seconds),) = refused
    assert "closed its check-ins" in rejection.json()["reason"] and seconds < 1.0
    assert int(rejection.headers["Retry-After"]) >= 1
    assert after - before == 5
    assert [answer.status_code for answer in out_of_range] == [422] * 3
    assert all("wait" in json.dumps(answer.json()["detail"]) for answer in out_of_range)
