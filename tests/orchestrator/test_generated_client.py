"""The OpenAPI document is a contract another language can implement: a client generated from the
live server's `/openapi.json` by a standard generator (openapi-python-client, from the registry)
runs a whole plaintext round against a real server on loopback: enroll, check in, download the
model, its manifest and the globals, train with the device runtime, report, and see the round
commit. Nothing but the generated code speaks HTTP here."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.manifest import MANIFEST_FILE, MODEL_FILE, load_manifest
from contracts.params import decode_params, encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, run_training_task
from device_runtime.example_store import Event, ExampleStore
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from orchestrator.differential_privacy import epsilon
from tests.conftest import BIASED
from tests.orchestrator.conftest import OCTETS, Server, admin_create_population

PACKAGE = "generated_orchestrator_client"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("generated-client") / "orchestrator.sqlite").start()
    try:
        yield running
    finally:
        running.stop()


def generate(url: str, where: Path) -> ModuleType:
    """The client openapi-python-client generates from the server's own document, imported."""
    spec = where / "openapi.json"
    spec.write_bytes(httpx.get(f"{url}/openapi.json", timeout=10).content)
    config = where / "config.json"
    config.write_text(json.dumps({"package_name_override": PACKAGE, "post_hooks": []}))
    generator = Path(sys.executable).parent / "openapi-python-client"
    arguments = ["--path", str(spec), "--config", str(config), "--meta", "none"]
    done = subprocess.run(
        [str(generator), "generate", *arguments, "--output-path", str(where / PACKAGE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The generator warns about what it could not express; a complete document leaves nothing out.
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    _import_unset(where / PACKAGE)
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(where))


def _import_unset(package: Path) -> None:
    """openapi-python-client 0.29.1 annotates a required body with several content types (the
    report: safetensors or JSON) as `... | Unset` without importing `Unset` (its issue #1451, fix
    pending in #1478): add the import it forgot, and nothing else."""
    for module in package.glob("api/*/*.py"):
        text = module.read_text()
        if "| Unset" in text and "import Unset" not in text and ", Unset" not in text:
            module.write_text(
                text.replace(
                    "from ...types import Response, UNSET", "from ...types import Response, UNSET, Unset"
                )
            )


def call(module: str, client: Any, **kwargs: Any) -> Any:
    """A generated operation's detailed answer (status, headers, bytes, parsed body)."""
    return importlib.import_module(f"{PACKAGE}.api.{module}").sync_detailed(client=client, **kwargs)


def test_a_client_generated_from_the_openapi_document_runs_a_round(
    server: Server, export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    # Arrange: a population whose round commits at its first report
    created = admin_create_population(server.url, export(BIASED), "p", json.dumps({"target_reports": 1}))
    assert created.status_code == 201, created.text
    generated = generate(server.url, tmp_path)
    models = importlib.import_module(f"{PACKAGE}.models")
    types = importlib.import_module(f"{PACKAGE}.types")
    anonymous = generated.Client(base_url=server.url, raise_on_unexpected_status=True)

    # Act: the round, through the generated code only
    enrolled = call("devices.enroll_device_v1_devices_post", anonymous)
    assert enrolled.status_code == 201 and isinstance(enrolled.parsed, models.Enrolled)
    device = generated.AuthenticatedClient(
        base_url=server.url, token=enrolled.parsed.token, raise_on_unexpected_status=True
    )
    unauthenticated = call(
        "devices.checkin_v1_populations_population_checkin_post",
        anonymous,
        population="p",
        body=models.CheckIn(example_count=40),
    )
    checked_in = call(
        "devices.checkin_v1_populations_population_checkin_post",
        device,
        population="p",
        body=models.CheckIn(example_count=40),
    )
    assignment = checked_in.parsed
    assert isinstance(assignment, models.Assignment), checked_in.content
    # The assignment's URLs are paths on the server the device checked in at.
    assert assignment.artifact_url == f"/v1/artifacts/{assignment.artifact_sha256}"
    artifact = call("devices.artifact_v1_artifacts_sha256_get", anonymous, sha256=assignment.artifact_sha256)
    manifest = call("devices.manifest_v1_populations_population_manifest_get", device, population="p")
    globals_ = call(
        "devices.global_params_v1_populations_population_models_version_global_get",
        device,
        population="p",
        version=assignment.model_version,
    )
    assert isinstance(manifest.parsed, models.ManifestOut)

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / MODEL_FILE).write_bytes(artifact.content)
    (model_dir / MANIFEST_FILE).write_bytes(manifest.content)
    model = TFLiteModel(model_dir)
    store = ExampleStore(tmp_path / "device.sqlite", model.manifest.features)
    rng = np.random.default_rng(0)
    store.add(
        Event({"item": int(item), "label": float(rng.integers(1, 6))}, float(t))
        for t, item in enumerate(rng.choice(BIASED.num_items, size=40, replace=False))
    )
    start = decode_params(globals_.content, model.manifest.global_params, "the global parameters")
    config = TaskConfig.from_json(assignment.task_config.to_dict())
    trained = run_training_task(model, store, start, config)
    assert trained.outcome is Outcome.COMPLETED and trained.delta is not None, trained.message
    report = encode_sparse_delta(
        trained.delta, {"num_examples": str(trained.num_examples), "metrics": json.dumps(trained.metrics)}
    )
    reported = call(
        "devices.report_v1_assignments_assignment_id_report_post",
        device,
        assignment_id=assignment.assignment_id,
        body=types.File(payload=report, mime_type="application/octet-stream"),
    )
    committed = call(
        "devices.global_params_v1_populations_population_models_version_global_get",
        device,
        population="p",
        version=assignment.model_version + 1,
    )

    # Assert
    assert unauthenticated.status_code == 401
    assert isinstance(unauthenticated.parsed, models.Error) and "Bearer" in unauthenticated.parsed.detail
    assert artifact.status_code == 200 and artifact.headers["content-type"] == "application/octet-stream"
    assert artifact.content == (export(BIASED) / MODEL_FILE).read_bytes()
    assert reported.status_code == 200, reported.content
    assert isinstance(reported.parsed, models.ReportAccepted)
    assert reported.parsed.round_status == "committed"
    after = decode_params(committed.content, model.manifest.global_params, "the committed globals")
    moved = sum(float(np.abs(after[name] - start[name]).sum()) for name in start)
    assert committed.status_code == 200 and moved > 0


def test_a_report_with_the_wrong_content_type_is_a_415_that_keeps_the_assignment(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    created = admin_create_population(server.url, export(BIASED), "q", json.dumps({"target_reports": 1}))
    assert created.status_code == 201, created.text
    token = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    assignment = httpx.post(
        f"{server.url}/v1/populations/q/checkin", json={"example_count": 40}, headers=headers, timeout=10
    ).json()
    assert assignment.get("accepted") is True, assignment

    as_text = httpx.post(
        f"{server.url}{assignment['report_url']}",
        content=b"\x00" * 16,
        headers={**headers, "Content-Type": "text/plain"},
        timeout=10,
    )
    aborted = httpx.post(f"{server.url}{assignment['abort_url']}", headers=headers, timeout=10)

    assert as_text.status_code == 415
    assert as_text.json()["detail"] == (
        "a training report is Content-Type application/octet-stream (safetensors), got 'text/plain'; "
        "nothing was stored"
    )
    assert aborted.status_code == 200  # the 415 left the assignment open


def test_a_check_in_after_the_privacy_budget_is_spent_is_a_200_rejection_for_a_day(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Arrange: a DP population whose budget allows exactly one training round, and that round
    dp = {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 100}
    dp["epsilon_budget"] = epsilon(1.0, 1 / 100, 1, 1e-5)
    settings = {"target_reports": 1, "evaluation_every": 0, "differential_privacy": dp}
    created = admin_create_population(server.url, export(BIASED), "dp", json.dumps(settings))
    assert created.status_code == 201, created.text
    manifest = load_manifest(export(BIASED))
    zero = {s.name: np.zeros(s.shape, np.float32) for s in manifest.global_params}
    body = encode_sparse_delta(zero, {"num_examples": "5", "metrics": "{}"})
    headers = {
        "Authorization": f"Bearer {httpx.post(f'{server.url}/v1/devices', timeout=10).json()['token']}"
    }
    url = f"{server.url}/v1/populations/dp/checkin"
    assignment = httpx.post(url, json={"example_count": 10}, headers=headers, timeout=10).json()
    sent = httpx.post(f"{server.url}{assignment['report_url']}", content=body, headers={**headers, **OCTETS})
    assert sent.status_code == 200 and sent.json()["round_status"] == "committed", sent.text

    # Act
    after = httpx.post(url, json={"example_count": 10}, headers=headers, timeout=10)

    # Assert: as /openapi.json and docs/reference/http-protocol.md say
    assert after.status_code == 200 and after.headers["Retry-After"] == "86400"
    assert after.json()["accepted"] is False and "privacy budget spent" in after.json()["reason"]
