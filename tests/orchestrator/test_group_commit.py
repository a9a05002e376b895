"""Group commit: requests that arrive together share one transaction; each gets its own answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from orchestrator.service.group_commit import GroupCommit


class Recorder:
    """A transaction that records its groups and rolls back when it holds a request from `bad`."""

    def __init__(self, bad: frozenset[int] = frozenset()) -> None:
        self.groups: list[list[int]] = []
        self.bad = bad

    async def transaction(self, key: str, requests: Sequence[int]) -> list[str]:
        self.groups.append(list(requests))
        if self.bad & set(requests):
            raise RuntimeError("rolled back")
        return [f"{key}:{r}" for r in requests]


def test_requests_that_arrive_together_share_one_transaction_and_get_their_own_answers() -> None:
    recorder = Recorder()

    async def run() -> list[str]:
        groups = GroupCommit(recorder.transaction, window_seconds=1.0)
        return await asyncio.gather(*(groups.submit("p", i) for i in range(5)), groups.submit("q", 9))

    answers = asyncio.run(run())

    assert answers == ["p:0", "p:1", "p:2", "p:3", "p:4", "q:9"]
    assert sorted(recorder.groups) == [[0, 1, 2, 3, 4], [9]]


def test_a_lone_request_does_not_wait_for_the_window() -> None:
    recorder = Recorder()

    async def run() -> str:
        groups = GroupCommit(recorder.transaction, window_seconds=5.0)
        return await groups.submit("p", 1)

    started = time.perf_counter()
    answer = asyncio.run(run())

    assert answer == "p:1" and time.perf_counter() - started < 1.0


def test_requests_arriving_while_a_group_is_collected_join_it() -> None:
    recorder = Recorder()

    async def run() -> list[str]:
        groups = GroupCommit(recorder.transaction, window_seconds=1.0)

        async def after_one_turn(i: int) -> str:
            await asyncio.sleep(0)  # arrives a turn of the event loop after the first request
            return await groups.submit("p", i)

        return list(await asyncio.gather(groups.submit("p", 0), after_one_turn(1), after_one_turn(2)))

    assert asyncio.run(run()) == ["p:0", "p:1", "p:2"]
    assert recorder.groups == [[0, 1, 2]]


def test_a_failed_group_is_retried_one_by_one_so_only_the_breaking_request_fails() -> None:
    recorder = Recorder(bad=frozenset({1}))

    async def run() -> list[str | BaseException]:
        groups = GroupCommit(recorder.transaction, window_seconds=1.0)
        return list(await asyncio.gather(*(groups.submit("p", i) for i in range(3)), return_exceptions=True))

    results = asyncio.run(run())

    assert recorder.groups == [[0, 1, 2], [0], [1], [2]]
    assert results[0] == "p:0" and results[2] == "p:2"
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "rolled back"


def test_a_lone_request_that_fails_is_not_retried() -> None:
    recorder = Recorder(bad=frozenset({0}))

    async def run() -> str:
        return await GroupCommit(recorder.transaction, window_seconds=1.0).submit("p", 0)

    try:
        asyncio.run(run())
    except RuntimeError as error:
        assert str(error) == "rolled back"
    else:
        raise AssertionError("the failure must reach the caller")
    assert recorder.groups == [[0]]
