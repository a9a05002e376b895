"""A stateful (FURL) population over a real orchestrator process on loopback: kept locals persist
across rounds and app restarts, seen devices run StandardEval, and what a curious server learns
about the kept locals from the reports."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from contracts.params import decode_sparse_delta, read_metadata
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import ExampleStore
from device_runtime.local_state import LocalStateStore
from device_runtime.orchestrator_client import OrchestratorClient
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import DEVICE_POLICY, MOVIELENS
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import Fleet, UserData, admin, settings

KEEP_TASK = {"update_learning_rate": 0.5, "local_state": "keep", "local_learning_rate": 0.1}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_a_stateful_population_keeps_locals_on_devices_across_rounds_and_restarts(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    model_dir = export(MOVIELENS)
    created = admin_create_population(
        server.url,
        model_dir,
        "furl",
        settings(
            target_reports=4,
            min_reports=1,
            evaluation_target_reports=4,
            min_evaluation_reports=4,
            task_config=KEEP_TASK,
        ),
    )
    assert created.status_code == 201, created.text
    model = TFLiteModel(model_dir)
    sent: list[tuple[str, str, bytes]] = []
    kept_after: list[list[bytes]] = []  # per round, each device's kept locals as bytes

    async def capture(request: httpx.Request) -> None:
        sent.append((request.method, request.url.path, request.read()))

    def kept_bytes(stores: list[ExampleStore]) -> list[bytes]:
        return [LocalStateStore(s, "furl").load(model).params["user_embedding"].tobytes() for s in stores]

    async def scenario() -> tuple[list[list[Participation]], list[Participation], list[int]]:
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [capture]}) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, list(range(4)), http, "furl").enroll()
            rounds = []
            for _ in range(2):
                rounds.append(await fleet.participate(fleet.agents))
                kept_after.append(kept_bytes(fleet.stores))
            # The app restarts: new store handles and agents on the same files, the same credentials.
            for store in fleet.stores:
                store.close()
            restarted, reopened = [], []
            for agent, old in zip(fleet.agents, fleet.stores, strict=True):
                store = ExampleStore(old.path)
                reopened.append(store)
                restarted.append(DeviceAgent(agent.client, store, fleet.cache, "furl", policy=DEVICE_POLICY))
            rounds.append(await fleet.participate(restarted))
            tasks = [LocalStateStore(store, "furl").load(model).tasks for store in reopened]
            kept_after.append(kept_bytes(reopened))
            admin(server.url, "/v1/admin/populations/furl/evaluations", "POST")
            # A device that never trained has no kept locals to measure: it aborts its evaluation.
            newcomer_store = Fleet(server.url, tmp_path / "new", movielens_users, [10], http).stores[0]
            newcomer = DeviceAgent(
                OrchestratorClient(server.url, http=http),
                newcomer_store,
                fleet.cache,
                "furl",
                policy=DEVICE_POLICY,
            )
            await newcomer.client.enroll()
            evaluation = [await newcomer.participate("evaluation")]
            evaluation += await fleet.participate(restarted, "evaluation")
            return rounds, evaluation, tasks

    (tmp_path / "new").mkdir()
    rounds, evaluation, tasks = asyncio.run(scenario())

    assert all(p.status == "reported" for batch in rounds for p in batch), [
        p.detail for b in rounds for p in b
    ]
    assert all("no kept local parameters yet" in p.task.message for p in rounds[0])  # type: ignore[union-attr]
    assert all(p.task.message == "" for p in rounds[1] + rounds[2])  # type: ignore[union-attr]
    assert tasks == [3, 3, 3, 3]
    # The locals moved every round: each round started from the previous round's.
    for before, after in itertools.pairwise(kept_after):
        assert all(b != a for b, a in zip(before, after, strict=True))
    assert evaluation[0].status == "aborted" and "has none" in evaluation[0].detail
    assert [p.status for p in evaluation[1:]] == ["reported"] * 4
    # StandardEval on the newest 10% of each device's ratings.
    held_out = [max(1, round(min(300, len(movielens_users[u][0])) * 0.1)) for u in range(4)]
    latest = admin(server.url, "/v1/admin/populations/furl/rounds?kind=evaluation&limit=1")[0]
    assert latest["metrics"]["weight_sum"] == sum(held_out)
    # Nothing private in plain form: no kept locals (any round's) in any request body, and the
    # training reports hold only the globals' deltas.
    secrets = [b for per_round in kept_after for b in per_round]
    global_names = {s.name for s in model.manifest.global_params}
    for method, path, body in sent:
        assert not any(secret in body for secret in secrets), f"kept locals in {method} {path}"
        if path.endswith("/report") and body[:1] != b"{":
            assert set(decode_sparse_delta(body)) == global_names
        elif path.endswith("/report"):
            assert set(json.loads(body)["metrics"]) == {
                "loss_sum",
                "squared_error_sum",
                "correct_sum",
                "weight_sum",
            }


def test_a_curious_server_estimates_kept_locals_from_a_plaintext_report(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    """The attack: with item biases, an item row's embedding delta divided by its bias delta is the
    user embedding at the update step that used the row (the locals train jointly, so one step's
    worth apart from the kept ones). Plaintext aggregation gives kept locals away as it gives away
    reconstructed ones (DESIGN.md, Privacy); only secure aggregation hides a device's report."""
    model_dir = export(MOVIELENS)
    created = admin_create_population(
        server.url, model_dir, "furl", settings(target_reports=2, min_reports=1, task_config=KEEP_TASK)
    )
    assert created.status_code == 201, created.text
    model = TFLiteModel(model_dir)
    bodies: list[bytes] = []

    async def capture(request: httpx.Request) -> None:
        if request.url.path.endswith("/report"):
            bodies.append(request.read())

    async def scenario() -> Fleet:
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [capture]}) as http:
            fleet = await Fleet(server.url, tmp_path, movielens_users, [0, 1], http, "furl").enroll()
            for _ in range(3):
                bodies.clear()
                results = await fleet.participate(fleet.agents)
                assert [r.status for r in results] == ["reported", "reported"]
            return fleet

    fleet = asyncio.run(scenario())

    # What the server computes from the last round's reports alone.
    for body in bodies:
        delta = decode_sparse_delta(body)
        embeddings, biases = delta["item_embeddings"].values, delta["item_bias"].values
        usable = np.abs(biases) > 1e-4
        per_row = embeddings[usable] / biases[usable][:, None]
        estimate = np.median(per_row, axis=0)
        # Whose report it is: the server knows from the assignment; here, the one it matches best.
        kept = [LocalStateStore(s, "furl").load(model).params["user_embedding"] for s in fleet.stores]
        similarity = max(cosine(estimate, k) for k in kept)
        assert similarity > 0.95, similarity
        assert int(read_metadata(body)["num_examples"]) > 0
