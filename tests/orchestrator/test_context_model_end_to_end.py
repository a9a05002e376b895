"""A user's ranking model with a context feature (tests/device_runtime/hour_recommender.py) in real
rounds: its examples imported from a CSV, devices (device_runtime, real TFLite) against a real
orchestrator process on loopback, then served for an hour from the federation's globals."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from contracts.manifest import load_manifest
from device_runtime.__main__ import main
from device_runtime.agent import DeviceAgent, Participation
from device_runtime.example_store import Event, ExampleStore
from device_runtime.examples_table import store_path
from device_runtime.orchestrator_client import OrchestratorClient
from tests.conftest import BIASED, DEVICE_POLICY
from tests.device_runtime.test_context_ranking import MORNING, NIGHT, shares_csv
from tests.orchestrator.conftest import Server, admin_create_population
from tests.orchestrator.test_end_to_end import admin

ROUNDS = 4
SETTINGS = {
    "target_reports": 2,
    "oversampling": 1.5,  # a slot for the device that aborts: an aborted slot is not reopened
    "min_reports": 2,
    "round_duration_seconds": 60,
    "min_examples": 5,
    "task_config": {"negatives_per_positive": 1, "update_max_epochs": 5},
}


def test_import_rounds_over_http_and_recommend_for_the_hour(
    server: Server, hour_recommender_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the population of the user's model; its devices' stores imported from the CSV, and
    # one device whose store holds another model's examples (ratings of items)
    created = admin_create_population(server.url, hour_recommender_model, "hourrec", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    stores = tmp_path / "stores"
    table = shares_csv(tmp_path / "shares.csv")
    assert (
        main(
            [
                "import",
                "--model-dir",
                str(hour_recommender_model),
                "--examples",
                str(table),
                "--out",
                str(stores),
            ]
        )
        == 0
    )
    capsys.readouterr()
    odd = ExampleStore(tmp_path / "ratings.sqlite", BIASED.features())
    odd.add(Event({"item": i, "label": 4.0}, float(i)) for i in range(10))

    async def scenario() -> tuple[list[list[Participation]], Participation, bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            agents = []
            for store in (
                ExampleStore(store_path(stores, "ana")),
                ExampleStore(store_path(stores, "ben")),
                odd,
            ):
                client = OrchestratorClient(server.url, http=http)
                await client.enroll()
                agents.append(DeviceAgent(client, store, tmp_path / "cache", "hourrec", policy=DEVICE_POLICY))
            # Execute: the wrong device tries first (its assignment must come back), then rounds
            wrong = await agents[2].participate("training")
            rounds = [
                list(await asyncio.gather(*(a.participate("training", seed=r) for a in agents[:2])))
                for r in range(ROUNDS)
            ]
            latest = await agents[0].client.global_params_at("hourrec", ROUNDS)
            for agent in agents:
                assert isinstance(agent.store, ExampleStore)
                agent.store.close()
            return rounds, wrong, latest

    rounds, wrong, latest = asyncio.run(scenario())

    # Assert: the store that does not fit ended its participation with the reason named, and the
    # server got its slot back (the rounds still committed with the two others)
    assert wrong.status == "aborted" and wrong.detail.startswith("incompatible_store: "), wrong.detail
    assert (
        "holds examples of (item int32, label float32 (label)); the model takes (expression int32"
        in wrong.detail
    )
    assert all(p.status == "reported" for r in rounds for p in r), [p.detail for r in rounds for p in r]
    assert admin(server.url, "/v1/admin/populations/hourrec")["current_version"] == ROUNDS
    # The phone serves from the federation's globals, for the hour asked
    globals_file = tmp_path / "global.safetensors"
    globals_file.write_bytes(latest)
    common = [
        "--store",
        str(store_path(stores, "ana")),
        "--model-dir",
        str(hour_recommender_model),
        "--globals",
        str(globals_file),
        "--include-used",
        "-k",
        "5",
        "--json",
    ]
    rankings = {}
    for hour in (21, 8):
        assert main(["recommend", *common, "--context", f"hour={hour}"]) == 0
        rankings[hour] = json.loads(capsys.readouterr().out)
    assert rankings[21]["source"] == "personalized" and rankings[21]["context"] == {"hour": 21}
    assert set(rankings[21]["items"]) == set(NIGHT) and set(rankings[8]["items"]) == set(MORNING), rankings
    assert load_manifest(hour_recommender_model).context_features[0].name == "hour"
