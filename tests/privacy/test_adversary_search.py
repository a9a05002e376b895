"""The server adversary that searches (tests/privacy/adversary.py), within a CI budget.

Against the device runtime's real secure-round code, every strategy it tries leaves every device's
masked input unreadable alone; an honest server's round commits; and the search is shown to find
leaks where there are some: a device that skips the signed-view check gives one away.
"""

from __future__ import annotations

import pytest

from device_runtime import secure_round
from tests.privacy.adversary import Strategy, play, search


def test_an_honest_server_gets_the_sum_and_no_single_input() -> None:
    outcome = play(Strategy(), n=5)

    assert outcome.statuses == ["reported"] * 5, outcome.details
    assert outcome.committed and outcome.leaked == {}


def test_no_strategy_in_the_budget_unmasks_one_devices_input() -> None:
    # Execute: exhaustive survivor-view splits around each device, random strategies, then
    # mutations of those that got the most secrets of one device
    report = search(n=5, random_budget=120, guided_budget=60, seed=46)

    # Assert: nothing leaked, and the search covered what it says it did
    assert report.leaks == [], [(s.describe(), o.leaked) for s, o in report.leaks[:3]]
    assert report.exhaustive == 5 * 2**5 and report.random == 120 and report.guided == 60
    assert report.committed > 0  # some strategies were close enough to honest to commit


def test_the_search_finds_the_leak_of_a_device_that_reveals_without_the_signed_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: devices that reveal by whatever survivor set the server shows (no quorum, no
    # partner statements): the hidden-confirmations and split-view attacks work on them
    monkeypatch.setattr(secure_round, "check_view", lambda view, confirmations, statements: None)

    # Execute: the exhaustive part of the search alone
    report = search(n=5, random_budget=0, guided_budget=0, seed=46)

    # Assert: the server read some device's update off its masked input, exactly
    assert report.leaks, "the search found no leak in devices that check nothing"
    assert max(c for _, o in report.leaks for c in o.leaked.values()) > 0.999
