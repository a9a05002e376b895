"""A model file that does not load is refused when the population is created (a 422 that says
what is wrong), even when its manifest's sha256 matches its bytes; one that fails later (a
damaged copy, a population made before models were checked) answers 503 with the reason."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from contracts.manifest import load_manifest
from contracts.mixing import encode_examples
from model_export.config import ModelConfig
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server
from tests.orchestrator.test_mixing import attach, central_examples


def flipped(data: bytes, bit: int) -> bytes:
    changed = bytearray(data)
    changed[bit // 8] ^= 1 << (bit % 8)
    return bytes(changed)


# Each damage, and what the refusal must name. The flipped bits: one in the file identifier
# ("TFL3"), one in the first tensor name that says "global_mean" (the file still parses, but a
# signature's tensors are no longer the manifest's).
DAMAGES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "random bytes": (lambda data: hashlib.shake_256(data).digest(len(data)), "not a loadable TFLite model"),
    "truncated": (lambda data: data[: len(data) // 2], "not a loadable TFLite model"),
    "a flipped bit (identifier)": (lambda data: flipped(data, 4 * 8), "not a loadable TFLite model"),
    "a flipped bit (tensor name)": (
        lambda data: flipped(data, data.index(b"global_mean") * 8),
        "disagree with the manifest",
    ),
    "100 MB of zeros": (lambda data: bytes(100 * 1024 * 1024), "not a loadable TFLite model"),
}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("models") / "orchestrator.sqlite").start() as server:
        yield server


def create(
    url: str, name: str, tflite: bytes, manifest: dict[str, object], model_dir: Path
) -> httpx.Response:
    files = {
        "model": ("model.tflite", tflite),
        "manifest": ("manifest.json", json.dumps(manifest).encode()),
        "global_params": (
            "global_params.safetensors",
            (model_dir / "global_params.safetensors").read_bytes(),
        ),
    }
    return httpx.post(
        f"{url}/v1/admin/populations",
        data={"name": name, "settings": "{}"},
        files=files,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=120,
    )


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_model_that_does_not_load_is_refused_at_creation_whatever_its_manifest_says(
    running: Server, export: Callable[[ModelConfig], Path], damage: str
) -> None:
    model_dir = export(BIASED)
    make, named = DAMAGES[damage]
    tflite = make((model_dir / "model.tflite").read_bytes())
    manifest = json.loads((model_dir / "manifest.json").read_text())
    # The manifest agrees with the damaged bytes: its checksum cannot tell.
    manifest["model"] = {
        **manifest["model"],
        "sha256": hashlib.sha256(tflite).hexdigest(),
        "bytes": len(tflite),
    }

    answer = create(running.url, "damaged", tflite, manifest, model_dir)

    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert named in detail and "\n" not in detail and "/tmp" not in detail
    listed = httpx.get(
        f"{running.url}/v1/admin/populations", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    )
    assert "damaged" not in listed.text  # nothing was kept


def test_the_intact_model_is_still_accepted(running: Server, export: Callable[[ModelConfig], Path]) -> None:
    model_dir = export(BIASED)
    manifest = json.loads((model_dir / "manifest.json").read_text())

    answer = create(running.url, "intact", (model_dir / "model.tflite").read_bytes(), manifest, model_dir)

    assert answer.status_code == 201, answer.text


def test_a_model_that_fails_later_answers_503_with_the_reason_on_the_central_gradient(
    tmp_path: Path, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a gradient-transfer population, then its stored model damaged (a population made
    # by a server that did not check models, or a copy damaged since).
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    database = tmp_path / "orchestrator.sqlite"
    with Server(database).start() as server:
        created = create(
            server.url,
            "p",
            (model_dir / "model.tflite").read_bytes(),
            json.loads((model_dir / "manifest.json").read_text()),
            model_dir,
        )
        assert created.status_code == 201, created.text
        examples = encode_examples(central_examples(manifest, 20, seed=5), manifest.features)
        assert (
            attach(server.url, "p", {"strategy": "gradient_transfer", "weight": 0.5}, examples).status_code
            == 200
        )
        with sqlite3.connect(database) as connection:
            connection.execute("UPDATE artifacts SET content = ?", (b"\0" * 4096,))
        token = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]
        auth = {"Authorization": f"Bearer {token}"}

        # Execute
        assignment = httpx.post(
            f"{server.url}/v1/populations/p/checkin", json={"example_count": 20}, headers=auth, timeout=10
        ).json()
        gradient = httpx.get(f"{server.url}{assignment['central_gradient_url']}", headers=auth, timeout=60)
        health = httpx.get(f"{server.url}/health", timeout=10)

    # Assert
    assert gradient.status_code == 503, gradient.text
    assert "cannot be loaded" in gradient.json()["detail"] and "/tmp" not in gradient.json()["detail"]
    assert health.status_code == 200
