"""The fleet run's stall message names the cause the rounds show (android_sim/stall.py)."""

from __future__ import annotations

from typing import Any

from android_sim.stall import stall_message


def abandoned(checked_in: int, reported: int, late: int) -> dict[str, Any]:
    return {"status": "abandoned", "counters": {"checked_in": checked_in, "reported": reported, "late": late}}


def test_late_reports_point_at_the_round_deadline_not_at_more_devices() -> None:
    message = stall_message(120, [abandoned(12, 3, 7), abandoned(11, 2, 8)], "the report is late")

    assert message.startswith("no training round committed for 120 s: 15 reports arrived after")
    assert "raise --round-seconds" in message and "--devices" not in message
    assert "(last problem: the report is late)" in message


def test_no_check_ins_point_at_more_devices() -> None:
    message = stall_message(60, [abandoned(0, 0, 0)] * 3, "")

    assert "no device checked in to the last 3 rounds" in message and "more --devices" in message
    assert "--round-seconds" not in message and "last problem" not in message


def test_too_few_in_time_point_at_the_round_size() -> None:
    message = stall_message(60, [abandoned(4, 1, 0)], "")

    assert "4 check-ins and 1 reports in the last 1 rounds were too few" in message
    assert "a lower --target-reports" in message


def test_no_round_closed_says_so() -> None:
    assert "no round closed meanwhile" in stall_message(60, [], "orchestrator unreachable")
