"""The OpenAPI document is a contract another language can implement: a client generated from the
live server's `/openapi.json` by a standard generator (openapi-python-client, from the registry,
with the configuration docs/reference/http-protocol.md gives) runs the protocol against a real
server on loopback: enroll, create a population, check in, download the model, its manifest and
the globals, train with the device runtime, report, see the round commit, and attach mixing
data. Nothing but the generated code speaks HTTP here."""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.manifest import INITIAL_GLOBAL_FILE, MANIFEST_FILE, MODEL_FILE, load_manifest
from contracts.mixing import encode_examples
from contracts.params import decode_params, encode_sparse_delta
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.tflite_model import TFLiteModel
from orchestrator.aggregation.differential_privacy import epsilon
from tests.conftest import BIASED, ROOT
from tests.orchestrator.conftest import ADMIN_TOKEN, OCTETS, Server, admin_create_population
from tests.orchestrator.test_mixing import central_examples

PACKAGE = "generated_orchestrator_client"
PAGE = ROOT / "docs" / "reference" / "http-protocol.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("generated-client") / "orchestrator.sqlite").start()
    try:
        yield running
    finally:
        running.stop()


def documented_config() -> dict[str, Any]:
    """The generator configuration the protocol page gives (its fix of the generator's bug)."""
    found = re.search(r"^<!-- generator-config -->\n```json\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    assert found, f"{PAGE} has no generator-config block"
    config: dict[str, Any] = json.loads(found[1])
    return config


def generate(url: str, where: Path) -> ModuleType:
    """The client openapi-python-client generates from the server's own document, imported."""
    spec = where / "openapi.json"
    spec.write_bytes(httpx.get(f"{url}/openapi.json", timeout=10).content)
    config = where / "config.json"
    config.write_text(json.dumps({**documented_config(), "package_name_override": PACKAGE}))
    generator = Path(sys.executable).parent / "openapi-python-client"
    arguments = ["--path", str(spec), "--config", str(config), "--meta", "none"]
    done = subprocess.run(
        [str(generator), "generate", *arguments, "--output-path", str(where / PACKAGE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The generator warns about what it could not express (and about a post-hook that failed); a
    # complete document leaves nothing out.
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(where))


def call(module: str, client: Any, **kwargs: Any) -> Any:
    """A generated operation's detailed answer (status, headers, bytes, parsed body)."""
    return importlib.import_module(f"{PACKAGE}.api.{module}").sync_detailed(client=client, **kwargs)


def test_a_client_generated_from_the_openapi_document_runs_the_protocol(
    server: Server, export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    # Arrange: the generated client, and the operator's (admin) client
    generated = generate(server.url, tmp_path)
    models = importlib.import_module(f"{PACKAGE}.models")
    types = importlib.import_module(f"{PACKAGE}.types")
    anonymous = generated.Client(base_url=server.url, raise_on_unexpected_status=True)
    operator = generated.AuthenticatedClient(
        base_url=server.url, token=ADMIN_TOKEN, raise_on_unexpected_status=True
    )
    exported = export(BIASED)

    def part(name: str) -> Any:
        return types.File(payload=(exported / name).read_bytes(), file_name=name)

    # Act: the round, through the generated code only
    enrolled = call("devices.enroll_device_v1_devices_post", anonymous)
    assert enrolled.status_code == 201 and isinstance(enrolled.parsed, models.Enrolled)
    created = call(
        "admin.create_v1_admin_populations_post",
        operator,
        body=models.BodyCreateV1AdminPopulationsPost(
            name="p",
            model=part(MODEL_FILE),
            manifest=part(MANIFEST_FILE),
            global_params=part(INITIAL_GLOBAL_FILE),
            settings=json.dumps({"target_reports": 1}),  # the round commits at its first report
        ),
    )
    assert created.status_code == 201, created.content
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
    trained = run_training_task(model, Environment.of(store), start, Task(config))
    assert trained.outcome is Outcome.COMPLETED and trained.delta is not None, trained.message
    # The report's metadata as the document's TrainingReportMetadata schema has it.
    metadata = models.TrainingReportMetadata(
        num_examples=str(trained.num_examples), metrics=json.dumps(trained.metrics)
    )
    report = encode_sparse_delta(trained.delta, metadata.to_dict())
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
    examples = encode_examples(central_examples(model.manifest, 30), model.manifest.features)
    mixed = call(
        "admin.attach_mixing_v1_admin_populations_name_mixing_put",
        operator,
        name="p",
        body=models.BodyAttachMixingV1AdminPopulationsNameMixingPut(
            mixing=json.dumps({"strategy": "parallel_training", "weight": 0.3}),
            examples=types.File(payload=examples, file_name="examples.safetensors"),
        ),
    )
    attached = call("admin.get_mixing_v1_admin_populations_name_mixing_get", operator, name="p")

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
    assert artifact.headers["cache-control"] == committed.headers["cache-control"]
    assert "immutable" in committed.headers["cache-control"]
    assert mixed.status_code == 200, mixed.content
    assert json.loads(attached.content)["num_examples"] == 30


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


def test_a_rejection_s_retry_after_header_is_its_body_s_time_rounded_up(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    settings = {"target_reports": 1, "min_examples": 20}
    created = admin_create_population(server.url, export(BIASED), "few", json.dumps(settings))
    assert created.status_code == 201, created.text
    token = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]

    # Act: too few examples: come back after the round's deadline, plus a random time (fractional)
    rejected = httpx.post(
        f"{server.url}/v1/populations/few/checkin",
        json={"example_count": 3},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )

    # Assert: the header is the body's time rounded up (HTTP's whole seconds), never earlier
    body = rejected.json()
    assert body["accepted"] is False, rejected.text
    assert int(rejected.headers["Retry-After"]) == max(1, math.ceil(body["retry_after_seconds"]))
    assert body["retry_after_seconds"] != int(body["retry_after_seconds"])  # a time, not a rounded one


def test_retry_after_is_never_earlier_than_the_body_says() -> None:
    from orchestrator.api.routes.populations import retry_after_header

    assert [retry_after_header(s) for s in (0.0, 0.3, 1.0, 67.2, 67.96, 86400.0)] == [1, 1, 1, 68, 68, 86400]
