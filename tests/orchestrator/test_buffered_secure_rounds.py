"""Buffered rounds under secure aggregation, over real HTTP with real devices (real TFLite, real
cryptography): devices are grouped into cohorts that run the secure protocol, each cohort's
unmasked sum goes into the buffer weighted by its staleness, and the server never holds one
device's update; settings under which no cohort could run are refused at creation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from safetensors.numpy import load
from sqlalchemy import create_engine, text

from contracts.manifest import load_manifest
from contracts.params import decode_params
from device_runtime.agent import DeviceAgent, Participation
from model_export.config import ModelConfig
from orchestrator.populations.settings import PopulationSettings, settings_problems
from secure_aggregation.quantization import Layout, clip
from tests.conftest import MOVIELENS
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import Fleet, UserData, admin, settings
from tests.orchestrator.test_secure_end_to_end import CLIP_NORM, SECURE

# Long phase deadlines: a cohort's devices wait, training, for the cohorts opened before theirs
# (the phases close as soon as every device has answered, not at their deadlines).
PHASES = {**SECURE, "share_keys_seconds": 60, "masked_input_seconds": 90, "unmasking_seconds": 60}


def rounds(url: str, kind: str) -> list[dict[str, Any]]:
    return sorted(
        admin(url, f"/v1/admin/populations/movies/rounds?kind={kind}&limit=100"), key=lambda r: int(r["id"])
    )


def after_earlier_cohorts(
    url: str, agent: DeviceAgent, gate_opened: Callable[[], None]
) -> Callable[[], bool]:
    """A device's training conditions: it trains until the cohorts opened before its own have
    closed (then `gate_opened()`), so cohorts finish in the order they opened."""

    def should_continue() -> bool:  # on the training thread
        assert agent.assignment is not None
        mine = agent.assignment.round_id
        give_up = time.monotonic() + 120
        while time.monotonic() < give_up:
            if all(r["status"] != "open" for r in rounds(url, "cohort") if r["id"] < mine):
                break
            time.sleep(0.1)
        gate_opened()
        return True

    return should_continue


async def until_admitted(
    url: str, agent: DeviceAgent, gate_opened: Callable[[], None] = lambda: None
) -> Participation:
    """One participation, checking in again while its cohort is full or no cohort has room."""
    for _ in range(600):
        # (the gate only on the training thread: each phase goes on, on the event loop)
        done = await agent.participate(
            should_continue=after_earlier_cohorts(url, agent, gate_opened),
            phase_continues=lambda _phase: True,
        )
        if done.status != "rejected":
            return done
        await asyncio.sleep(0.1)
    raise AssertionError("never admitted")


def test_cohorts_sums_enter_the_buffer_weighted_by_staleness_and_no_update_is_held_alone(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: cohorts of 3 (min_reports 3), 9 devices training at once, a version every 5 devices'
    # worth, f(s) = 1/(1+s). Three cohorts open on version 0; each finishes only after the cohorts
    # opened before it have closed (its devices wait, training), so A and B commit version 1 and C,
    # one version stale, goes into the next buffer with D, which trains on version 1.
    model_dir = export(MOVIELENS)
    population = settings(
        target_reports=3,
        oversampling=1.0,
        min_reports=3,
        aggregation="secure",
        secure=PHASES,
        rounds="buffered",
        buffered={"buffer_size": 5, "concurrency": 9, "max_staleness": 2, "staleness_weighting": "inverse"},
        retry_after_seconds=0.1,
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text
    engine = create_engine(server.database_url)
    held: list[list[tuple[int, int, int, bytes]]] = []  # what the server held as each gate opened

    def stored() -> list[tuple[int, int, int, bytes]]:
        with engine.connect() as db:
            rows = db.execute(
                text("SELECT round_id, buffer_id, members, total FROM cohort_sums ORDER BY round_id")
            )
            return [(int(a), int(b), int(n), bytes(t)) for a, b, n, t in rows]

    def snapshot() -> None:
        held.append(stored())

    async def scenario() -> tuple[list[Participation], list[Participation], bytes, bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(12)), http).enroll()
            first = list(
                await asyncio.gather(*(until_admitted(server.url, a, snapshot) for a in fleet.agents[:9]))
            )
            second = list(
                await asyncio.gather(*(until_admitted(server.url, a, snapshot) for a in fleet.agents[9:]))
            )
            for _ in range(200):
                if admin(server.url, "/v1/admin/populations/movies")["current_version"] == 2:
                    break
                await asyncio.sleep(0.1)
            client = fleet.agents[0].client
            return (
                first,
                second,
                await client.global_params_at("movies", 1),
                await client.global_params_at("movies", 2),
            )

    # Execute
    first, second, v1, v2 = asyncio.run(scenario())

    # Assert: four cohorts of 3 committed, one per secure round; the first three on version 0
    everyone = first + second
    assert [p.status for p in everyone] == ["reported"] * 12, [p.detail for p in everyone]
    cohorts = rounds(server.url, "cohort")
    assert [(r["status"], r["base_version"], r["counters"]["reported"]) for r in cohorts] == [
        ("committed", 0, 3),
        ("committed", 0, 3),
        ("committed", 0, 3),
        ("committed", 1, 3),
    ]
    a, b, c, d = (r["id"] for r in cohorts)
    # ... the buffers: A and B (6 devices' worth, staleness 0), then C (1 stale, weight 1/2) and D
    buffers = [r for r in rounds(server.url, "training") if r["status"] == "committed"]
    assert [(r["result_version"], r["counters"]["reported"]) for r in buffers] == [(1, 6), (2, 6)]
    assert buffers[0]["total_weight"] == pytest.approx(6.0)
    assert buffers[1]["total_weight"] == pytest.approx(3 * 0.5 + 3)
    assert buffers[1]["metrics"]["staleness_count_1"] == 3.0
    assert buffers[1]["metrics"]["staleness_count_0"] == 3.0
    # ... each version is the last plus the staleness-weighted mean of its cohorts' clipped deltas
    manifest = load_manifest(model_dir)
    layout = Layout.of(manifest.global_params)

    def summed(cohort: int) -> np.ndarray:
        deltas = [
            clip(layout.flatten(p.task.delta), CLIP_NORM)
            for p in everyone
            if p.assignment is not None and p.assignment.round_id == cohort and p.task and p.task.delta
        ]
        assert len(deltas) == 3
        return np.asarray(np.sum(deltas, axis=0))

    base = decode_params((model_dir / "global_params.safetensors").read_bytes(), manifest.global_params, "v0")
    first_v, second_v = (
        layout.flatten(decode_params(blob, manifest.global_params, "version")) for blob in (v1, v2)
    )
    assert np.allclose(first_v, layout.flatten(base) + (summed(a) + summed(b)) / 6, atol=2e-6)
    assert np.allclose(second_v, first_v + (0.5 * summed(c) + summed(d)) / 4.5, atol=2e-6)
    # The server never held one device's update: while B's devices trained it held A's sum of 3
    # alone (no report, no masked input of A), and each buffer's sums went with its commit.
    sums_seen = {tuple((r, n) for r, _, n, _ in snapshot) for snapshot in held}
    assert ((a, 3),) in sums_seen
    (a_sum,) = {t for snapshot in held for r, _, _, t in snapshot if r == a}
    assert np.allclose(layout.flatten(load(a_sum)), summed(a), atol=6e-6)
    assert all(n == 3 for snapshot in held for _, _, n, _ in snapshot)
    with engine.connect() as db:
        for table in ("cohort_sums", "reports", "secure_masked_inputs"):
            assert db.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0, table
    engine.dispose()


def test_a_cohort_too_stale_for_the_buffer_is_abandoned_and_its_sum_discarded(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: two cohorts of 3 on version 0, a version every 3 devices' worth, no staleness
    # allowed: A commits version 1, and B, which finishes after it, is one version too stale
    model_dir = export(MOVIELENS)
    population = settings(
        target_reports=3,
        oversampling=1.0,
        min_reports=3,
        aggregation="secure",
        secure=PHASES,
        rounds="buffered",
        buffered={"buffer_size": 3, "concurrency": 6, "max_staleness": 0},
        retry_after_seconds=0.1,
    )
    created = admin_create_population(server.url, model_dir, "movies", population)
    assert created.status_code == 201, created.text

    async def scenario() -> list[Participation]:
        async with httpx.AsyncClient(timeout=60) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(6)), http).enroll()
            return list(await asyncio.gather(*(until_admitted(server.url, a) for a in fleet.agents)))

    # Execute
    done = asyncio.run(scenario())

    # Assert: A's three went into version 1; B was unmasked, then abandoned as stale: no version
    # and no stored sum came of it
    a, b = rounds(server.url, "cohort")
    assert (a["status"], a["metrics"]["staleness"], b["status"], b["ended_by"]) == (
        "committed",
        0.0,
        "abandoned",
        "stale",
    )
    assert b["close_reason"] == (
        "the cohort trained on version 0, 1 versions behind the current 1; this population adds sums "
        "at most 0 versions stale: discarded"
    )
    mine: dict[int, list[str]] = {p.assignment.round_id: [] for p in done if p.assignment is not None}
    for p in done:
        assert p.assignment is not None
        mine[p.assignment.round_id].append(p.status)
    # (a device's part ends with its unmasking shares: B's devices did theirs, as in any secure
    # round whose unmasked sum the server then refuses to use)
    assert mine == {a["id"]: ["reported"] * 3, b["id"]: ["reported"] * 3}, [p.detail for p in done]
    assert b["counters"]["reported"] == 3 and "buffer_id" not in b["metrics"]
    assert admin(server.url, "/v1/admin/populations/movies")["current_version"] == 1
    engine = create_engine(server.database_url)
    with engine.connect() as db:
        for table in ("cohort_sums", "reports", "secure_masked_inputs"):
            assert db.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0, table
    engine.dispose()


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (
            {"target_reports": 4, "oversampling": 1.5, "min_reports": 3, "buffered": {"concurrency": 5}},
            "buffered.concurrency (5) must be at least one cohort: under aggregation: secure devices "
            "train in cohorts of ceil(target_reports x oversampling) = 6 devices",
        ),
        (
            {"target_reports": 4, "min_reports": 2, "buffered": {"buffer_size": 4, "concurrency": 8}},
            "secure aggregation needs min_reports >= 3 (a sum of one or two inputs reveals them), got 2",
        ),
        (
            {
                "target_reports": 300,
                "oversampling": 1.0,
                "min_reports": 3,
                "secure": {"bits": 16},
                "buffered": {"buffer_size": 300, "concurrency": 300},
            },
            "secure.bits 16 leave 109 quantization levels per device for a round of 300 devices",
        ),
    ],
)
def test_a_buffered_secure_population_no_cohort_could_run_in_is_refused_at_creation(
    settings: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValidationError) as error:
        PopulationSettings.model_validate({"rounds": "buffered", "aggregation": "secure", **settings})
    assert problem in settings_problems(error.value)


def test_the_bits_are_checked_against_a_cohort_not_the_concurrency() -> None:
    # 16 bits leave 2^15 / 130 = 252 levels for a cohort of 130: enough, however many cohorts train
    settings = PopulationSettings.model_validate(
        {
            "rounds": "buffered",
            "aggregation": "secure",
            "target_reports": 100,
            "oversampling": 1.3,
            "min_reports": 3,
            "secure": {"bits": 16},
            "buffered": {"buffer_size": 100, "concurrency": 1000},
        }
    )
    assert settings.secure_roster == 130
