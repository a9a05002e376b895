"""Check-ins refused by a secure round's closed roster wait for the next round, up to its capacity
(a real server on loopback, real HTTP)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
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

# Rounds of three, whose phases wait for the test.
ROUNDS_OF_THREE: dict[str, Any] = {
    **SETTINGS,
    "target_reports": 3,
    "min_reports": 3,
    "retry_after_seconds": 30.0,
    "secure": {**cast(dict[str, Any], SETTINGS["secure"]), "share_keys_seconds": 60},
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


def _as(token: str, url: str, body: object) -> httpx.Response:
    """A device's POST of `body` (JSON; None: no body)."""
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


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
        advertised = _as(
            token, f"{server.url}{assignment['secure_url']}/keys", DeviceSession(params).advertise().to_json()
        )
        assert advertised.status_code == 200, advertised.text
    tokens = [_enrolled(server.url) for _ in range(4)]
    before = _roster_closed_total(server.url)

    # Execute: while the roster is closed, a device that says nothing of waiting checks in, and
    # check-ins ask for waits out of range; then four devices that can wait 30 s check in
    # together; once one of them has its answer, the first round's devices abort (it is
    # abandoned: too few left)
    impatient, _ = _check_in(server.url, _enrolled(server.url), None)
    out_of_range = [_check_in(server.url, tokens[0], wait)[0] for wait in (0, 121, "soon")]
    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(_check_in, server.url, token) for token in tokens]
        done, _ = wait(waiting, timeout=30, return_when=FIRST_COMPLETED)
        time.sleep(0.5)  # any other answer that was not held would be in by now
        answered_before_the_round_ended = sum(future.done() for future in waiting)
        for token, assignment in zip(first_tokens, first, strict=True):
            aborted = _as(token, f"{server.url}{assignment['abort_url']}", None)
            assert aborted.status_code == 200, aborted.text
        answers = [future.result(timeout=60) for future in waiting]
    after = _roster_closed_total(server.url)

    # Assert: the device that could not wait was refused at once (the round was still under way),
    # places free or not; of the four that could, one was refused at once and told when to come
    # back, and three were held (a round's capacity) until the first round ended, then admitted
    # into the next; each device's refusal counted once, however often a held one was checked in
    # again; the waits out of range refused with a clear 422
    assert not impatient.json()["accepted"] and "closed its check-ins" in impatient.json()["reason"]
    assert len(done) == 1 and answered_before_the_round_ended == 1
    ((rejection, _),) = [answer for answer in answers if not answer[0].json()["accepted"]]
    assert "closed its check-ins" in rejection.json()["reason"]
    assert int(rejection.headers["Retry-After"]) >= 1
    accepted = [answer.json() for answer, _ in answers if answer.json()["accepted"]]
    assert len(accepted) == 3 and {a["round_id"] for a in accepted} == {first[0]["round_id"] + 1}
    assert after - before == 5
    assert [answer.status_code for answer in out_of_range] == [422] * 3
    assert all("wait" in json.dumps(answer.json()["detail"]) for answer in out_of_range)
