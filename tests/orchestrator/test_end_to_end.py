"""Real devices (device_runtime, real TFLite) against a real orchestrator process on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from contracts.params import decode_params, decode_sparse_delta, encode_params
from contracts.protocol import Assignment
from contracts.task_config import TaskConfig
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.device_identity import DeviceIdentity
from device_runtime.example_store import Event, ExampleStore
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.protocol_errors import ProtocolError
from device_runtime.task_examples import prepare
from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import DEVICE_POLICY, MOVIELENS
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

UserData = list[tuple[np.ndarray, np.ndarray, np.ndarray]]
TASK = {"update_learning_rate": 0.5, "reconstruction_learning_rate": 0.1}


def settings(**overrides: object) -> str:
    base = {
        "target_reports": 8,
        "oversampling": 1.5,
        "min_reports": 4,
        "round_duration_seconds": 60,
        "min_examples": 10,
        "task_config": TASK,
        "evaluation_target_reports": 20,
    }
    return json.dumps({**base, **overrides})


def fill_store(path: Path, user: tuple[np.ndarray, np.ndarray, np.ndarray]) -> ExampleStore:
    store = ExampleStore(path, MOVIELENS.features())
    items, ratings, times = user
    store.add(
        Event({"item": int(i), "label": float(r)}, float(t))
        for i, r, t in zip(items, ratings, times, strict=True)
    )
    return store


class Fleet:
    """Devices made of the real runtime, each with its own store, sharing one HTTP client."""

    def __init__(
        self,
        url: str,
        tmp: Path,
        users: UserData,
        indices: list[int],
        http: httpx.AsyncClient,
        population: str = "movies",
        authority: EnrollmentAuthority | None = None,
    ) -> None:
        """With an `authority`, each device has a signing key it certified and accepts only
        rosters of keys it certified (the production policy's rule)."""
        self.url, self.http, self.population = url, http, population
        self.authority = authority
        self.agents: list[DeviceAgent] = []
        self.stores = [fill_store(tmp / f"device-{u}.sqlite", users[u]) for u in indices]
        self.cache = tmp / "model-cache"

    async def enroll(self) -> Fleet:
        for store in self.stores:
            client = OrchestratorClient(self.url, http=self.http)
            await client.enroll()
            policy, identity = DEVICE_POLICY, None
            if self.authority is not None:
                policy = dataclasses.replace(DEVICE_POLICY, certified_roster=True)
                identity = DeviceIdentity.enroll(self.authority.certify, self.authority.public_key)
            self.agents.append(
                DeviceAgent(client, store, self.cache, self.population, policy=policy, identity=identity)
            )
        return self

    async def participate(self, agents: list[DeviceAgent], task: str = "training") -> list[Participation]:
        return list(await asyncio.gather(*(a.participate(task) for a in agents)))


def admin(url: str, path: str, method: str = "GET") -> dict:  # type: ignore[type-arg]
    response = httpx.request(
        method, f"{url}{path}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    assert response.status_code < 300, response.text
    return response.json()  # type: ignore[no-any-return]


async def evaluate(fleet: Fleet) -> dict[str, float]:
    admin(fleet.url, f"/v1/admin/populations/{fleet.population}/evaluations", "POST")
    results = await fleet.participate(fleet.agents, "evaluation")
    assert all(r.status == "reported" for r in results), [r.detail for r in results]
    latest = admin(fleet.url, f"/v1/admin/populations/{fleet.population}/rounds?kind=evaluation&limit=1")[0]
    assert latest["status"] == "committed"
    return latest["metrics"]  # type: ignore[no-any-return]


def test_rounds_commit_with_oversampling_and_the_model_improves(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    created = admin_create_population(server.url, export(MOVIELENS), "movies", settings())
    assert created.status_code == 201, created.text

    async def scenario() -> tuple[dict[str, float], dict[str, float], list[list[Participation]]]:
        async with httpx.AsyncClient(timeout=60) as http:
            train = await Fleet(
                server.url, tmp_path / "train", movielens_users, list(range(0, 120)), http
            ).enroll()
            held_out = await Fleet(
                server.url, tmp_path / "held", movielens_users, list(range(900, 920)), http
            ).enroll()
            before = await evaluate(held_out)
            rounds = []
            rng = np.random.default_rng(0)
            for _ in range(12):
                chosen = [train.agents[i] for i in rng.choice(len(train.agents), 12, replace=False)]
                rounds.append(await train.participate(chosen))
            after = await evaluate(held_out)
            return before, after, rounds

    (tmp_path / "train").mkdir()
    (tmp_path / "held").mkdir()
    before, after, rounds = asyncio.run(scenario())

    # 12 devices per batch for a target of 8: oversampling lets a round commit at 8 reports;
    # reports that arrive after it closed are refused as late, and devices that check in
    # after the commit join the next round. Device-side and server-side counts reconcile.
    participations = [p for batch in rounds for p in batch]
    outcomes = [p.status for p in participations]
    rejections = [p.detail for p in participations if p.status == "rejected"]
    assert set(outcomes) <= {"reported", "refused", "rejected"}
    history = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=100")
    committed = [r for r in history if r["status"] == "committed"]
    assert len(committed) >= 12
    assert all(r["counters"]["reported"] == 8 for r in committed)
    assert outcomes.count("reported") == sum(r["counters"]["reported"] for r in history)
    assert outcomes.count("refused") == sum(r["counters"]["late"] for r in history) > 0
    # Turned away because the round was full, or because the device already took part in it.
    full = [d for d in rejections if "full" in d]
    assert len(full) == sum(r["counters"]["rejected_capacity"] for r in history)
    assert all("already took part" in d for d in rejections if d not in full)
    assert admin(server.url, "/v1/admin/populations/movies")["current_version"] == len(committed)
    assert after["rmse"] < before["rmse"] - 0.01, (before, after)


def test_dropouts_deadlines_late_reports_and_small_devices(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    created = admin_create_population(
        server.url,
        export(MOVIELENS),
        "movies",
        settings(
            target_reports=3, oversampling=2.0, min_reports=2, round_duration_seconds=3, min_examples=25
        ),
    )
    assert created.status_code == 201, created.text
    small = {u for u in range(200) if len(movielens_users[u][0]) < 25}
    # Devices just above min_examples: their query set (about half their examples) is below it,
    # and their reports must count all the same (one min_examples rule, on the device's examples).
    big = [u for u in range(200) if 25 <= len(movielens_users[u][0]) < 50][:6]

    async def scenario() -> tuple[list[Participation], Participation, ProtocolError, list[Participation]]:
        async with httpx.AsyncClient(timeout=60) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, [*big, min(small)], http).enroll()
            # Round 1: three devices check in and vanish (they drop out mid-task) ...
            dropped = [await a.client.checkin("movies", a.store.count()) for a in fleet.agents[3:6]]
            assert all(isinstance(d, Assignment) for d in dropped)
            # ... and two report: under the target, so the round waits for its deadline.
            reported = await fleet.participate(fleet.agents[:2])
            too_small = await fleet.agents[6].participate()
            await asyncio.sleep(4.0)
            late_device = fleet.agents[3]
            late_assignment = dropped[0]
            assert isinstance(late_assignment, Assignment)
            model = TFLiteModel(await late_device.client.model_dir(late_assignment, fleet.cache))
            delta = {s.name: np.zeros(s.shape, np.float32) for s in model.manifest.global_params}
            with pytest.raises(ProtocolError) as late:
                await late_device.client.report_training(late_assignment, delta, 10, {})
            # Round 2 opened on the committed model; nobody reports, so it is abandoned.
            rejoin = await fleet.participate(fleet.agents[:1])
            return reported, too_small, late.value, rejoin

    reported, too_small, late, _ = asyncio.run(scenario())

    assert [p.status for p in reported] == ["reported", "reported"]
    assert too_small.status == "rejected" and "at least 25" in too_small.detail
    assert late.status == 409 and "late" in late.message
    first = admin(server.url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")[-1]
    assert first["status"] == "committed"
    counters = first["counters"]
    assert (counters["accepted"], counters["reported"], counters["dropped"], counters["late"]) == (5, 2, 3, 1)
    assert counters["rejected_min_examples"] == 1
    status = admin(server.url, "/v1/admin/populations/movies")
    assert status["current_version"] == 1


def test_nothing_private_goes_over_the_wire(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    model_dir = export(MOVIELENS)
    created = admin_create_population(
        server.url, model_dir, "movies", settings(target_reports=4, min_reports=1)
    )
    assert created.status_code == 201, created.text
    sent: list[tuple[str, str, bytes]] = []

    async def capture(request: httpx.Request) -> None:
        sent.append((request.method, request.url.path, request.read()))

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [capture]}) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(4)), http).enroll()
            results = await fleet.participate(fleet.agents)
            assert [r.status for r in results] == ["reported"] * 4
            admin(server.url, "/v1/admin/populations/movies/evaluations", "POST")
            results = await fleet.participate(fleet.agents, "evaluation")
            assert [r.status for r in results] == ["reported"] * 4

    asyncio.run(scenario())

    # What each device's reconstructed local parameters were, recomputed the same way.
    model = TFLiteModel(model_dir)
    globals_ = decode_params(
        (model_dir / "global_params.safetensors").read_bytes(), model.manifest.global_params, "g"
    )
    secrets: list[bytes] = []
    for u in range(4):
        store = fill_store(tmp_path / f"replay-{u}.sqlite", movielens_users[u])
        config = TaskConfig.from_manifest(model.manifest, **TASK)
        data = prepare(store, model.manifest, config, seed=0)
        from model_runtime.task_batches import TaskBatches

        model.set_global(globals_)
        model.reset_local()
        support = TaskBatches.pack(data.support, model.manifest)
        model.reconstruct(support, min(50, 5 * support.num_batches), config.reconstruction_learning_rate)
        secrets.append(model.get_local()["user_embedding"].tobytes())
        items = movielens_users[u][0]
        secrets.append(encode_params({"x": items[:8].astype(np.int64)})[-64:])  # raw item ids, as bytes

    global_names = {s.name for s in model.manifest.global_params}
    reports = 0
    for method, path, body in sent:
        for secret in secrets:
            assert secret not in body, f"private bytes in {method} {path}"
        if not body:
            continue
        if path.endswith("/checkin"):
            data = json.loads(body)
            assert set(data) <= {"example_count", "task", "conditions"}
            assert isinstance(data["example_count"], int)
        elif path.endswith("/report") and body[:1] != b"{":
            # The changed rows of the global tensors, and nothing else: which item rows changed is
            # what a dense delta's nonzero rows showed too.
            delta = decode_sparse_delta(body)
            assert set(delta) == global_names, "a training report holds exactly the global deltas"
            reports += 1
        elif path.endswith("/report"):
            data = json.loads(body)
            assert set(data) == {"num_examples", "metrics"}
            assert set(data["metrics"]) == {"loss_sum", "squared_error_sum", "correct_sum", "weight_sum"}
        else:
            pytest.fail(f"unexpected request body on {method} {path}")
    assert reports == 4


def test_server_killed_mid_round_loses_nothing_and_counts_nothing_twice(
    export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    database = tmp_path / "orchestrator.sqlite"
    server = Server(database).start()
    try:
        created = admin_create_population(
            server.url, export(MOVIELENS), "movies", settings(target_reports=6, min_reports=6)
        )
        assert created.status_code == 201, created.text

        async def first_half() -> Fleet:
            async with httpx.AsyncClient(timeout=60) as http:
                fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(10)), http).enroll()
                # Round 1 commits, then three reports into round 2.
                assert [p.status for p in await fleet.participate(fleet.agents[:6])].count("reported") == 6
                assert [p.status for p in await fleet.participate(fleet.agents[6:9])] == ["reported"] * 3
                return fleet

        fleet = asyncio.run(first_half())
        server.kill()

        with sqlite3.connect(database) as conn:
            versions = [v for (v,) in conn.execute("SELECT version FROM model_versions ORDER BY version")]
            open_round = conn.execute(
                "SELECT id, reported FROM rounds WHERE status = 'open' AND kind = 'training'"
            ).fetchone()
            stored = conn.execute(
                "SELECT COUNT(*) FROM reports WHERE round_id = ?", (open_round[0],)
            ).fetchone()[0]
        assert versions == [0, 1]
        assert open_round[1] == stored == 3

        server = Server(database, port=server.port).start()

        async def second_half() -> list[Participation]:
            async with httpx.AsyncClient(timeout=60) as http:
                for agent in fleet.agents:
                    agent.client._http = http  # same devices, same tokens, new connection pool
                # A device that already reported tries again: turned away, not counted twice.
                again = await fleet.agents[6].participate()
                assert again.status == "rejected" and "already took part" in again.detail
                return await fleet.participate([*fleet.agents[9:], *fleet.agents[:2]])

        results = asyncio.run(second_half())
        assert [p.status for p in results] == ["reported"] * 3
        with sqlite3.connect(database) as conn:
            round_two = conn.execute(
                "SELECT status, reported, result_version FROM rounds WHERE id = ?", (open_round[0],)
            ).fetchone()
            versions = [v for (v,) in conn.execute("SELECT version FROM model_versions ORDER BY version")]
            reports = conn.execute(
                "SELECT COUNT(*) FROM reports WHERE round_id = ?", (open_round[0],)
            ).fetchone()[0]
        assert round_two == ("committed", 6, 2)
        assert reports == 6
        assert versions == [0, 1, 2]
    finally:
        server.stop()
