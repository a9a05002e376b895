"""Each mixing strategy end to end over HTTP: a real orchestrator, devices made of the real runtime.

And the privacy side: a mixing strategy sends the device something new, never the other way
round. What a curious server could compute from a report (its tensors, its metadata, its weight)
is the same with and without mixing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import load_manifest
from contracts.mixing import encode_examples
from contracts.params import decode_sparse_delta, read_metadata
from model_export.config import ModelConfig
from tests.conftest import MOVIELENS
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population
from tests.orchestrator.test_end_to_end import Fleet, admin, settings

UserData = list[tuple[np.ndarray, np.ndarray, np.ndarray]]
DEVICES = 4


def _run_round(
    server: Server, tmp: Path, users: UserData, population: str
) -> tuple[list[tuple[str, str, bytes]], list[dict[str, object]]]:
    """One training round of DEVICES devices; every request they sent, and their assignments."""
    sent: list[tuple[str, str, bytes]] = []
    tmp.mkdir()

    async def capture(request: httpx.Request) -> None:
        sent.append((request.method, request.url.path, request.read()))

    async def scenario() -> list[dict[str, object]]:
        async with httpx.AsyncClient(timeout=60, event_hooks={"request": [capture]}) as http:
            fleet = await Fleet(server.url, tmp, users, list(range(DEVICES)), http, population).enroll()
            results = await fleet.participate(fleet.agents)
            assert [r.status for r in results] == ["reported"] * DEVICES, [r.detail for r in results]
            return [r.assignment.__dict__ for r in results if r.assignment is not None]

    return sent, asyncio.run(scenario())


def _reports(sent: list[tuple[str, str, bytes]]) -> list[tuple[frozenset[str], dict[str, str], set[str]]]:
    """Per training report: its tensors, its metadata (without the values of its metrics, which
    differ as the model does), and its metric names: what the server reads from it."""
    found = []
    for _, path, body in sent:
        if path.endswith("/report"):
            metadata = read_metadata(body)
            metrics = set(json.loads(metadata.pop("metrics")))
            found.append((frozenset(decode_sparse_delta(body)), metadata, metrics))
    return sorted(found, key=lambda r: r[1]["num_examples"])  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", ["parallel_training", "example_transfer", "gradient_transfer"])
def test_a_mixing_strategy_runs_end_to_end_and_the_reports_carry_nothing_new(
    strategy: str,
    server: Server,
    export: Callable[[ModelConfig], Path],
    movielens_users: UserData,
    tmp_path: Path,
) -> None:
    # Prepare: two populations on the same model and devices: one without mixing, one with.
    model_dir = export(MOVIELENS)
    manifest = load_manifest(model_dir)
    for name in ("plain", "mixed"):
        created = admin_create_population(
            server.url, model_dir, name, settings(target_reports=DEVICES, min_reports=1)
        )
        assert created.status_code == 201, created.text
    # "New" movies that none of these devices rated, rated highly by the public data.
    rated = np.concatenate([movielens_users[u][0] for u in range(DEVICES)])
    new = np.setdiff1d(np.arange(1500, 1682), rated)[:60].astype(np.int32)
    central = Examples({"item": new, "label": np.full(len(new), 5.0, np.float32)})
    mixing = {"strategy": strategy, "weight": 0.3, "central_steps": 8, "examples_per_assignment": 16}
    attached = httpx.put(
        f"{server.url}/v1/admin/populations/mixed/mixing",
        data={"mixing": json.dumps(mixing)},
        files={"examples": ("e.safetensors", encode_examples(central, manifest.features))},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert attached.status_code == 200, attached.text

    # Execute
    plain_sent, plain_assignments = _run_round(server, tmp_path / "plain", movielens_users, "plain")
    mixed_sent, mixed_assignments = _run_round(server, tmp_path / "mixed", movielens_users, "mixed")

    # Assert: both rounds committed; the strategy did its part.
    for name in ("plain", "mixed"):
        statuses = [
            r["status"] for r in admin(server.url, f"/v1/admin/populations/{name}/rounds?kind=training")
        ]
        assert statuses == ["open", "committed"], statuses
    rounds_ = admin(server.url, "/v1/admin/populations/mixed/rounds?kind=training")
    committed_round = next(r for r in rounds_ if r["status"] == "committed")
    transfers = [a["central_examples_url"] for a in mixed_assignments]
    gradients = [a["central_gradient_url"] for a in mixed_assignments]
    downloads = [p for m, p, _ in mixed_sent if m == "GET" and p.endswith("/central-examples")]
    gradient_downloads = [p for m, p, _ in mixed_sent if m == "GET" and p.endswith("/central-gradient")]
    if strategy == "parallel_training":
        assert committed_round["metrics"]["central_steps"] == 8
        assert transfers == [None] * DEVICES and not downloads
    elif strategy == "example_transfer":
        assert "central_steps" not in committed_round["metrics"]
        assert all(t is not None for t in transfers) and len(downloads) == DEVICES
    else:
        assert "central_steps" not in committed_round["metrics"]
        assert transfers == [None] * DEVICES and not downloads
        assert all(g is not None for g in gradients) and len(gradient_downloads) == DEVICES
        assert {a["central_gradient_weight"] for a in mixed_assignments} == {0.3}
    if strategy != "gradient_transfer":
        assert gradients == [None] * DEVICES and not gradient_downloads
    assert all(a["central_examples_url"] is None for a in plain_assignments)
    assert all(a["central_gradient_url"] is None for a in plain_assignments)

    # Assert, as a curious server: the reports read the same, down to each device's weight.
    assert _reports(mixed_sent) == _reports(plain_sent)
    # And nothing else goes up: the requests with a body are check-ins and reports only, and a
    # check-in states what it always states.
    for method, path, body in mixed_sent:
        if body and not path.endswith("/report"):
            assert path.endswith("/checkin") or path == "/v1/devices", (method, path)
            if path.endswith("/checkin"):
                assert set(json.loads(body)) <= {"example_count", "task", "conditions"}
