"""The device's privacy policy: its floors, its daily cap, and a device that declines a round below
them before it sends anything of that round (the server it talks to is a real loopback server)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from android_sim.idle_store import IdleStore
from android_sim.small_cohorts import simulation_policy
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.privacy_policy import ALL_POPULATIONS, ParticipationLog, PolicyRefusal, PrivacyPolicy
from device_runtime.task_runner import TaskRunner
from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from tests.conftest import SMALL
from tests.device_runtime.hostile_orchestrator import (
    ASSIGNMENT_ID,
    POPULATION,
    TOKEN,
    HostileOrchestrator,
    json_answer,
)

DAY = 86_400.0


def params(min_survivors: int = 1_000, threshold: float = 0.7) -> RoundParameters:
    return RoundParameters("p/1/ab", 10, 32, 1.0, 2_000, 0, threshold, min_survivors)


@pytest.fixture(scope="module")
def server(export: Callable[[ModelConfig], Path]) -> Iterator[HostileOrchestrator]:
    with HostileOrchestrator(export(SMALL)) as running:
        yield running


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ExampleStore]:
    rng = np.random.default_rng(0)
    with ExampleStore(tmp_path / "device.sqlite", SMALL.features()) as opened:
        opened.add(
            Event({"item": int(i), "label": float(r)}, float(t))
            for t, (i, r) in enumerate(
                zip(rng.integers(0, SMALL.num_items, 40), rng.integers(1, 6, 40), strict=True)
            )
        )
        yield opened


def participate(
    server: HostileOrchestrator, store: ExampleStore | IdleStore, policy: PrivacyPolicy, cache: Path
) -> Participation:
    async def once() -> Participation:
        client = OrchestratorClient(server.url, TOKEN, attempts=2, backoff_seconds=0.01, timeout_seconds=5.0)
        try:
            with TaskRunner(1) as runner:
                return await DeviceAgent(
                    client, store, cache, POPULATION, runner=runner, policy=policy
                ).participate()
        finally:
            await client.aclose()

    return asyncio.run(once())


def test_the_production_default_accepts_only_large_secure_rounds() -> None:
    policy = PrivacyPolicy()

    assert policy.aggregation == {"secure"} and not policy.plaintext_evaluation
    assert policy.min_summands >= 1_000 and policy.min_threshold > 0.5
    policy.check_parameters(params())  # a round at the floors is accepted
    with pytest.raises(
        PolicyRefusal, match="sum of 999 devices' inputs; this device joins only sums of at least 1000"
    ):
        policy.check_parameters(params(min_survivors=999))
    with pytest.raises(
        PolicyRefusal, match=r"threshold of 0\.4 of the neighbours is below this device.s floor of 0\.666667"
    ):
        policy.check_parameters(params(threshold=0.4))
    with pytest.raises(PolicyRefusal, match="roster holds 12 devices"):
        policy.check_roster(12)
    with pytest.raises(PolicyRefusal, match="unmask a sum of 1 devices' inputs"):
        policy.check_survivors(1)


def test_a_policy_that_protects_nothing_is_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="min_summands must be >= 2"):
        PrivacyPolicy(min_summands=1)
    with pytest.raises(ValueError, match="aggregation must be a non-empty subset"):
        PrivacyPolicy(frozenset({"trusted"}))
    with pytest.raises(ValueError, match="max_participations_per_day must be >= 1"):
        PrivacyPolicy(max_participations_per_day=0)


def test_the_daily_cap_counts_per_population_and_utc_day(store: ExampleStore) -> None:
    policy = PrivacyPolicy(max_participations_per_day=2)
    log, other = ParticipationLog(store, "p"), ParticipationLog(store, "q")
    noon = 20_000 * DAY + DAY / 2

    log.record(noon)
    log.record(noon + 60)

    assert log.today(noon) == 2 and other.today(noon) == 0
    with pytest.raises(
        PolicyRefusal, match="2 participations in this population today; this device takes at most 2"
    ):
        log.check(policy, noon + 120)
    other.check(policy, noon)
    log.check(policy, noon + DAY)  # the next UTC day counts afresh


def test_the_device_wide_cap_counts_every_population_sharing_the_store(store: ExampleStore) -> None:
    policy = PrivacyPolicy(max_participations_per_day=5, max_device_participations_per_day=2)
    device = ParticipationLog(store, ALL_POPULATIONS)
    noon = 20_000 * DAY + DAY / 2

    device.record(noon)  # a participation in population p
    device.record(noon + 60)  # and one in q

    with pytest.raises(
        PolicyRefusal, match="2 participations in all its populations today; this device takes at most 2"
    ):
        device.check(policy, noon + 120)
    device.check(policy, noon + DAY)


def test_an_unreadable_count_is_taken_as_the_cap_reached(store: ExampleStore) -> None:
    store.save_local_state("participations/p", b"not json")

    with pytest.raises(PolicyRefusal, match="takes at most 10"):
        ParticipationLog(store, "p").check(PrivacyPolicy(max_participations_per_day=10))


def test_a_plaintext_assignment_is_declined_before_anything_is_fetched_or_sent(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path
) -> None:
    server.reset()

    result = participate(server, store, simulation_policy("secure"), tmp_path)

    # The device names why, aborts, and never reports (nor fetches the model it would train)
    assert result.status == "declined", result
    assert "privacy policy: the assignment asks for 'plaintext' aggregation" in result.detail
    assert [r.route for r in server.requests] == ["checkin", "abort"]


def test_at_the_daily_cap_the_device_does_not_even_check_in(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path
) -> None:
    server.reset()
    policy = simulation_policy("plaintext", max_participations_per_day=1)

    first = participate(server, store, policy, tmp_path)
    second = participate(server, store, policy, tmp_path)

    assert first.status == "reported", first
    assert second.status == "declined" and "takes at most 1 a day" in second.detail
    assert [r.route for r in server.seen("checkin")] == ["checkin"]


def test_an_idle_device_keeps_its_daily_cap_with_its_store_closed(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path
) -> None:
    server.reset()
    policy = simulation_policy("plaintext", max_participations_per_day=1)
    idle = IdleStore(store.path, store.count())

    first = participate(server, idle, policy, tmp_path)
    second = participate(server, idle, policy, tmp_path)
    # The participation went to the file: the same device after a restart (a new IdleStore) knows it
    restarted = participate(server, IdleStore(store.path), policy, tmp_path)

    assert first.status == "reported", first
    assert second.status == "declined" and "takes at most 1 a day" in second.detail
    assert restarted.status == "declined" and "takes at most 1 a day" in restarted.detail
    assert [r.route for r in server.seen("checkin")] == ["checkin"]
    assert ParticipationLog(store, POPULATION).today() == 1


def test_an_idle_device_checks_in_with_its_example_count_and_opens_its_store_only_for_a_round(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path
) -> None:
    server.reset()
    policy = simulation_policy("plaintext")
    idle = IdleStore(store.path, store.count())
    assert participate(server, idle, policy, tmp_path).status == "reported"
    # The file moved away: a device turned away at check-in never looks for it (an open would
    # fail: a missing store is a new one, which needs the model's features)
    store.path.rename(tmp_path / "elsewhere.sqlite")
    server.craft(
        "checkin", json_answer({"accepted": False, "reason": "this round is full", "retry_after_seconds": 3})
    )

    turned_away = participate(server, idle, policy, tmp_path)

    assert turned_away.status == "rejected" and turned_away.retry_after_seconds == 3, turned_away
    assert [r.route for r in server.seen("checkin")] == ["checkin", "checkin"]
    assert idle.count() == 40


def test_a_device_whose_store_the_fleet_just_wrote_checks_in_without_opening_it(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path
) -> None:
    server.reset()
    policy = simulation_policy("plaintext")
    moved = tmp_path / "elsewhere.sqlite"
    # A new store holds no participation log: its first check-in reads none from the file (an
    # open would fail: a missing store is a new one, which needs the model's features)
    new = IdleStore(moved, 40, new=True)
    server.craft(
        "checkin", json_answer({"accepted": False, "reason": "this round is full", "retry_after_seconds": 3})
    )

    turned_away = participate(server, new, policy, tmp_path)

    assert turned_away.status == "rejected", turned_away
    assert not moved.exists()
    assert [r.route for r in server.seen("checkin")] == ["checkin"]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            {"min_survivors": 2},
            "the round would unmask a sum of 2 devices' inputs; this device joins only sums of at least 3",
        ),
        (
            {"threshold": 0.1},
            "a secret-sharing threshold of 0.1 of the neighbours is below this device's floor of 0.25",
        ),
    ],
    ids=["cohort below the floor", "threshold below the floor"],
)
def test_secure_parameters_below_the_floors_are_declined_before_the_keys_go_out(
    server: HostileOrchestrator, store: ExampleStore, tmp_path: Path, changes: dict[str, object], reason: str
) -> None:
    server.reset()
    offered = {**params(min_survivors=3, threshold=0.5).to_json(), **changes}
    server.craft(
        "checkin",
        json_answer(
            server.assignment(
                aggregation="secure",
                secure_url=f"/v1/assignments/{ASSIGNMENT_ID}/secure",
                secure_parameters=offered,
            )
        ),
    )

    result = participate(server, store, simulation_policy("secure"), tmp_path)

    # Named, aborted, and no key, share or input went out (the hostile server has no secure routes:
    # a device that tried would have had its keys refused, not declined)
    assert result.status == "declined" and f"privacy policy: {reason}" in result.detail, result
    assert [r.route for r in server.requests] == ["checkin", "abort"]


@pytest.mark.parametrize(
    ("policy", "mixing", "reason"),
    [
        (
            simulation_policy("secure"),
            {
                "central_gradient_url": f"/v1/assignments/{ASSIGNMENT_ID}/central-gradient",
                "central_gradient_weight": 5.0,
            },
            "the central gradient's weight 5 is above this device's limit of 1",
        ),
        (
            dataclasses.replace(simulation_policy("secure"), secure_mixing=False),
            {"central_examples_url": f"/v1/assignments/{ASSIGNMENT_ID}/central-examples"},
            "this device mixes no centralized data into a secure round's update",
        ),
    ],
    ids=["a gradient weighing more than the device allows", "mixing in a secure round, refused by the app"],
)
def test_server_chosen_central_data_beyond_the_policy_is_declined_before_anything_is_fetched(
    server: HostileOrchestrator,
    store: ExampleStore,
    tmp_path: Path,
    policy: PrivacyPolicy,
    mixing: dict[str, object],
    reason: str,
) -> None:
    server.reset()
    server.craft(
        "checkin",
        json_answer(
            server.assignment(
                aggregation="secure",
                secure_url=f"/v1/assignments/{ASSIGNMENT_ID}/secure",
                secure_parameters=params(min_survivors=3, threshold=0.5).to_json(),
                **mixing,
            )
        ),
    )

    result = participate(server, store, policy, tmp_path)

    # Named and aborted; neither the central data nor the model was fetched
    assert result.status == "declined" and f"privacy policy: {reason}" in result.detail, result
    assert [r.route for r in server.requests] == ["checkin", "abort"]
