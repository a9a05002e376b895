"""Mixing centralized data: attaching a strategy and dataset, and what each strategy changes."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from orchestrator.populations.config import population_manifest, population_settings
from orchestrator.populations.locks import find_population, lock_population
from orchestrator.service.population_creation import ExportedModel
from safetensors.numpy import save
from sqlalchemy.orm import Session, sessionmaker

from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.mixing import (
    GROUP_TENSOR,
    CentralDataset,
    MixingConfig,
    MixingError,
    decode_central,
    decode_examples,
    encode_examples,
    transferred_gradient,
)
from contracts.params import Params, decode_params, decode_sparse_delta, encode_params
from contracts.task_config import TaskConfig
from model_export.config import ModelConfig
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel
from orchestrator.__main__ import main as orchestrator_cli
from orchestrator.db import make_engine
from orchestrator.populations import central_training
from orchestrator.populations import mixing as mixing_data
from tests.conftest import BIASED, IMPLICIT
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population, make_population
from tests.orchestrator.test_rounds import checkin, delta_body, device, report, round_by_id, version_params

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def central_examples(manifest: Manifest, count: int, seed: int = 0) -> Examples:
    """`count` examples that fit the manifest's feature spec (values drawn inside each range)."""
    rng = np.random.default_rng(seed)
    columns: dict[str, np.ndarray] = {}
    for f in manifest.features:
        low, high = f.value_range if f.value_range is not None else (0.0, 1.0)
        if f.dtype == "int32":
            columns[f.name] = rng.integers(int(low), int(high) + 1, size=(count, *f.shape)).astype(np.int32)
        else:
            values = rng.uniform(low, high, size=(count, *f.shape))
            columns[f.name] = (np.round(values) if f.discrete else values).astype(np.float32)
    return Examples(columns)


def with_groups(manifest: Manifest, count: int, groups: np.ndarray) -> bytes:
    """`count` examples and a GROUP_TENSOR of any dtype and shape, as an operator could upload."""
    examples = central_examples(manifest, count)
    return save({**{f.name: examples[f.name] for f in manifest.features}, GROUP_TENSOR: groups})


def attach(url: str, name: str, mixing: Any, examples: bytes | None) -> httpx.Response:
    files = {"examples": ("examples.safetensors", examples)} if examples is not None else None
    return httpx.put(
        f"{url}/v1/admin/populations/{name}/mixing",
        data={"mixing": json.dumps(mixing)},
        files=files,
        headers=ADMIN,
        timeout=30,
    )


def test_attaching_bad_mixing_is_a_4xx_that_says_why_and_changes_nothing(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a population with a valid dataset attached under parallel training.
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    assert admin_create_population(server.url, model_dir, "p", "{}").status_code == 201
    good = encode_examples(central_examples(manifest, 40), manifest.features)
    first = attach(server.url, "p", {"strategy": "parallel_training", "weight": 0.3}, good)
    assert first.status_code == 200, first.text
    before = httpx.get(f"{server.url}/v1/admin/populations/p/mixing", headers=ADMIN, timeout=10).json()
    assert before["num_examples"] == 40 and before["mixing"]["weight"] == 0.3
    assert before["groups"] is None  # no '@group' ids: pseudo-users are runs of examples

    item = next(f for f in manifest.features if f.tables)
    outside = central_examples(manifest, 5)
    outside = Examples({**outside.columns, item.name: outside[item.name] + int(item.value_range[1]) + 1})  # type: ignore[index]
    missing = Examples({k: v for k, v in central_examples(manifest, 5).columns.items() if k != item.name})
    cases = {
        "outside": ({"strategy": "example_transfer"}, encode_examples(outside, manifest.features), "outside"),
        "missing": (
            {"strategy": "example_transfer"},
            encode_examples(missing, [f for f in manifest.features if f.name != item.name]),
            "missing",
        ),
        "not safetensors": ({"strategy": "example_transfer"}, b"\x00" * 64, "safetensors"),
        "unknown strategy": ({"strategy": "telepathy"}, good, "strategy must be one of"),
        "alpha above 1": ({"strategy": "parallel_training", "weight": 1.5}, good, "weight"),
        "negative alpha": ({"strategy": "parallel_training", "weight": -0.1}, good, "weight"),
        "unknown setting": ({"strategy": "parallel_training", "alfa": 0.1}, good, "unknown mixing settings"),
        "too many per assignment": (
            {"strategy": "example_transfer", "examples_per_assignment": 10_000},
            good,
            "examples_per_assignment",
        ),
        "gradient weight above its bound": ({"strategy": "gradient_transfer", "weight": 101}, good, "weight"),
        "empty pseudo-users": (
            {"strategy": "parallel_training", "examples_per_pseudo_user": 0},
            good,
            "examples_per_pseudo_user",
        ),
        "pseudo-users beyond one call": (
            {"strategy": "gradient_transfer", "examples_per_pseudo_user": 10 * manifest.max_examples},
            good,
            "examples_per_pseudo_user",
        ),
        "float group ids": (
            {"strategy": "parallel_training"},
            with_groups(manifest, 40, np.zeros(40, np.float32)),
            "expected int32 or int64 of shape [40]",
        ),
        "a group id short": (
            {"strategy": "parallel_training"},
            with_groups(manifest, 40, np.zeros(39, np.int64)),
            "have shape [39]; expected int32 or int64 of shape [40]",
        ),
        "group ids as a matrix": (
            {"strategy": "parallel_training"},
            with_groups(manifest, 40, np.zeros((40, 1), np.int64)),
            "have shape [40, 1]",
        ),
        "a negative group id": (
            {"strategy": "gradient_transfer"},
            with_groups(manifest, 40, np.arange(40, dtype=np.int64) - 1),
            "include -1",
        ),
    }
    for case, (mixing, blob, expected) in cases.items():
        # Execute
        answer = attach(server.url, "p", mixing, blob)
        # Assert
        assert answer.status_code == 422, (case, answer.text)
        assert expected in answer.json()["detail"], (case, answer.json())
    after = httpx.get(f"{server.url}/v1/admin/populations/p/mixing", headers=ADMIN, timeout=10).json()
    assert after == before
    unknown = attach(server.url, "nobody", {"strategy": "none"}, None)
    assert unknown.status_code == 404


def _attach_in(factory: sessionmaker[Session], mixing: dict[str, Any], examples: Examples) -> None:
    with factory.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        manifest = population_manifest(population)
        mixing_data.attach(
            session, population, manifest, mixing, encode_examples(examples, manifest.features), 0.0
        )


def _independent_central_delta(
    model_dir: Path, base: Params, examples: Examples, steps: int, learning_rate: float
) -> Params:
    """Algorithm 2's server step written out: one pseudo-user (the 20 examples fit one task) whose
    locals are reconstructed on the even batches, then J update steps on the odd ones."""
    model = TFLiteModel(model_dir)
    manifest, task = model.manifest, TaskConfig.from_manifest(model.manifest)
    b = manifest.batch_size
    batches = [examples.select(slice(i, i + b)) for i in range(0, examples.num_examples, b)]
    model.set_global(base)
    model.reset_local()
    support = TaskBatches.pack(batches[0::2], manifest)
    model.reconstruct(
        support,
        min(task.reconstruction_max_steps, task.reconstruction_max_epochs * len(batches[0::2])),
        task.reconstruction_learning_rate,
    )
    return model.update(TaskBatches.pack(batches[1::2], manifest), steps, learning_rate).delta


def test_parallel_training_merges_alpha_of_the_central_delta_with_the_federated_one(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: one report a round, SGD at rate 1 (the new model is base + merged delta).
    model_dir = export(BIASED)
    model = ExportedModel.from_dir(model_dir)
    make_population(db, model, target_reports=1)
    examples = central_examples(Manifest.from_json(model.manifest), 20, seed=3)
    alpha, steps, rate = 0.25, 2, 0.3
    _attach_in(
        db,
        {
            "strategy": "parallel_training",
            "weight": alpha,
            "central_steps": steps,
            "central_learning_rate": rate,
        },
        examples,
    )
    for version in (0, 1):  # the first round computes inline, the second may find it precomputed
        base = version_params(db, model, version)
        dev = device(db)
        answer = checkin(db, dev, now=1.0 + version)
        body = delta_body(model, 0.01, rows=(3, 7))
        federated = {k: v.dense() for k, v in decode_sparse_delta(body).items()}

        # Execute
        report(db, dev, answer.assignment_id, body, now=2.0 + version)

        # Assert
        central = _independent_central_delta(model_dir, base, examples, steps, rate)
        assert any(np.abs(v).max() > 1e-4 for v in central.values())  # the central data moved the model
        merged = version_params(db, model, version + 1)
        for name in base:
            expected = base[name] + (1 - alpha) * federated[name] + alpha * central[name]
            np.testing.assert_allclose(merged[name], expected, atol=2e-6, err_msg=name)
        committed = round_by_id(db, answer.round_id)
        assert committed.metrics["central_steps"] == steps


def test_without_mixing_the_commit_is_the_federated_mean(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    model = ExportedModel.from_dir(export(BIASED))
    make_population(db, model, target_reports=1)
    _attach_in(db, {"strategy": "none"}, central_examples(Manifest.from_json(model.manifest), 20))
    base = version_params(db, model, 0)
    dev = device(db)
    answer = checkin(db, dev)
    body = delta_body(model, 0.01)

    report(db, dev, answer.assignment_id, body)

    federated = {k: v.dense() for k, v in decode_sparse_delta(body).items()}
    merged = version_params(db, model, 1)
    for name in base:
        np.testing.assert_allclose(merged[name], base[name] + federated[name], atol=1e-7)


def test_the_cli_attaches_mixing_and_refuses_bad_input_without_changing_it(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    examples = tmp_path / "central.safetensors"
    examples.write_bytes(encode_examples(central_examples(manifest, 30), manifest.features))
    assert (
        orchestrator_cli(["--database-url", url, "create-population", "p", "--model-dir", str(model_dir)])
        == 0
    )

    # Execute
    attached = orchestrator_cli(
        [
            "--database-url",
            url,
            "mix",
            "p",
            "--mixing",
            '{"strategy": "example_transfer"}',
            "--examples",
            str(examples),
        ]
    )
    capsys.readouterr()
    refused = orchestrator_cli(
        ["--database-url", url, "mix", "p", "--mixing", '{"strategy": "parallel_training", "weight": 2}']
    )
    error = capsys.readouterr().err
    negative = tmp_path / "negative-ids.safetensors"
    negative.write_bytes(with_groups(manifest, 30, np.full(30, -2, np.int64)))
    refused_ids = orchestrator_cli(
        [
            "--database-url",
            url,
            "mix",
            "p",
            "--mixing",
            '{"strategy": "parallel_training"}',
            "--examples",
            str(negative),
        ]
    )
    ids_error = capsys.readouterr().err

    # Assert
    assert attached == 0 and refused == 2 and refused_ids == 2
    assert "weight" in error and "[0, 1]" in error
    assert "group ids '@group' include -2" in ids_error
    engine = make_engine(url)
    with Session(engine) as session:
        population = find_population(session, "p")
        assert population is not None
        shown = mixing_data.describe(session, population)
    engine.dispose()
    assert shown["mixing"]["strategy"] == "example_transfer" and shown["num_examples"] == 30


def test_an_example_transfer_assignment_carries_a_sample_of_the_central_examples_for_its_device_only(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    assert admin_create_population(server.url, model_dir, "p", '{"target_reports": 3}').status_code == 201
    dataset = central_examples(manifest, 50, seed=4)
    mixing = {"strategy": "example_transfer", "examples_per_assignment": 7}
    accounts = np.arange(50, dtype=np.int64) // 5
    assert (
        attach(server.url, "p", mixing, encode_examples(dataset, manifest.features, accounts)).status_code
        == 200
    )
    tokens = [httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"] for _ in range(2)]

    # Execute
    answer = httpx.post(
        f"{server.url}/v1/populations/p/checkin",
        json={"example_count": 20},
        headers={"Authorization": f"Bearer {tokens[0]}"},
        timeout=10,
    ).json()
    url = f"{server.url}{answer['central_examples_url']}"
    first, again, other = (
        httpx.get(url, headers={"Authorization": f"Bearer {t}"}, timeout=10)
        for t in (tokens[0], tokens[0], tokens[1])
    )

    # Assert: 7 of the dataset's examples, the same on a retried download, and only for the device;
    # the examples only (decode_examples refuses any other tensor): no group ids go to a device.
    assert first.status_code == 200 and first.content == again.content
    sample = decode_examples(first.content, manifest.features, "sample", 1 << 20)
    assert sample.num_examples == 7
    pairs = {(int(i), float(y)) for i, y in zip(dataset["item"], dataset["label"], strict=True)}
    assert {(int(i), float(y)) for i, y in zip(sample["item"], sample["label"], strict=True)} <= pairs
    assert other.status_code == 404


def test_gradient_transfer_is_refused_for_a_model_exported_without_the_gradient_signature(
    export: Callable[[ModelConfig], Path],
) -> None:
    data = json.loads((export(BIASED) / "manifest.json").read_text())
    config = MixingConfig(strategy="gradient_transfer", weight=0.5)
    config.check_model(Manifest.from_json(data), 10)  # the current export has it: accepted
    del data["signatures"]["gradient"]
    data["signatures"]["update"]["inputs"] = [
        s
        for s in data["signatures"]["update"]["inputs"]
        if not s["name"].endswith("_central_gradient") and s["name"] != "central_gradient_weight"
    ]

    with pytest.raises(MixingError, match="needs the export's `gradient` signature"):
        config.check_model(Manifest.from_json(data), 10)


def _independent_central_gradient(model_dir: Path, base: Params, examples: Examples) -> dict[str, np.ndarray]:
    """Algorithm 4's server step written out: one pseudo-user (the 20 examples fit one task) whose
    locals are reconstructed on the even batches; the `gradient` signature on the odd ones."""
    model = TFLiteModel(model_dir)
    manifest, task = model.manifest, TaskConfig.from_manifest(model.manifest)
    b = manifest.batch_size
    batches = [examples.select(slice(i, i + b)) for i in range(0, examples.num_examples, b)]
    model.set_global(base)
    model.reset_local()
    model.reconstruct(
        TaskBatches.pack(batches[0::2], manifest),
        min(task.reconstruction_max_steps, task.reconstruction_max_epochs * len(batches[0::2])),
        task.reconstruction_learning_rate,
    )
    return {
        k: v.dense() for k, v in model.gradient(TaskBatches.pack(batches[1::2], manifest)).gradient.items()
    }


def test_a_gradient_transfer_assignment_carries_the_central_gradient_at_its_globals_for_its_device_only(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare
    model_dir = export(BIASED)
    manifest = load_manifest(model_dir)
    assert admin_create_population(server.url, model_dir, "p", '{"target_reports": 3}').status_code == 201
    dataset = central_examples(manifest, 20, seed=5)
    mixing = {"strategy": "gradient_transfer", "weight": 0.7}
    assert attach(server.url, "p", mixing, encode_examples(dataset, manifest.features)).status_code == 200
    tokens = [httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"] for _ in range(2)]
    auth = [{"Authorization": f"Bearer {t}"} for t in tokens]

    # Execute
    answer = httpx.post(
        f"{server.url}/v1/populations/p/checkin", json={"example_count": 20}, headers=auth[0], timeout=10
    ).json()
    url = f"{server.url}{answer['central_gradient_url']}"
    first, again = (httpx.get(url, headers=auth[0], timeout=60) for _ in range(2))
    other = httpx.get(url, headers=auth[1], timeout=10)
    base = httpx.get(f"{server.url}{answer['params_url']}", headers=auth[0], timeout=10)

    # Assert: the weight, and the gradient of the central loss at the assignment's globals.
    assert answer["central_gradient_weight"] == 0.7 and answer["central_examples_url"] is None
    assert first.status_code == 200, first.text
    assert first.content == again.content and other.status_code == 404
    sent = transferred_gradient(first.content, manifest)
    expected = _independent_central_gradient(
        model_dir, decode_params(base.content, manifest.global_params, "base"), dataset
    )
    for name, value in expected.items():
        np.testing.assert_allclose(sent[name].dense(), value, rtol=1e-5, atol=1e-7, err_msg=name)
    # Rows only: the item rows the centralized data's query half uses, not the whole table.
    items = next(s for s in manifest.global_params if s.row_sparse is not None)
    assert 0 < len(sent[items.name].rows) <= 10 < items.shape[0]


def test_the_next_versions_central_gradient_is_taken_at_the_committed_globals(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: one report a round; the commit precomputes version 1's gradient in the background.
    model_dir = export(BIASED)
    model = ExportedModel.from_dir(model_dir)
    make_population(db, model, target_reports=1)
    examples = central_examples(Manifest.from_json(model.manifest), 20, seed=6)
    _attach_in(db, {"strategy": "gradient_transfer", "weight": 0.5}, examples)
    dev = device(db)
    answer = checkin(db, dev)
    report(db, dev, answer.assignment_id, delta_body(model, 0.05, rows=(3, 7)))

    # Execute: what an assignment of the next round is served.
    committed = version_params(db, model, 1)
    with db() as session:
        population = find_population(session, "p")
        assert population is not None and population.current_version == 1
        manifest = population_manifest(population)
        job = mixing_data.central_job(
            session,
            population,
            manifest,
            1,
            committed,
            population_settings(population).task(),
            "gradient_transfer",
        )
    assert job is not None
    served = central_training.central_gradient(job).gradient

    # Assert: version 1's globals, not version 0's.
    expected = _independent_central_gradient(model_dir, committed, examples)
    stale = _independent_central_gradient(model_dir, version_params(db, model, 0), examples)
    for name, value in expected.items():
        np.testing.assert_allclose(served[name].dense(), value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert any(not np.allclose(expected[k], stale[k], atol=1e-6) for k in expected)


def test_a_central_gradient_that_is_not_finite_is_a_503_that_says_why(
    server: Server, export: Callable[[ModelConfig], Path], tmp_path: Path
) -> None:
    # Prepare: version 0's globals so large that the centralized loss's gradient overflows.
    model_dir = tmp_path / "huge"
    shutil.copytree(export(BIASED), model_dir)
    manifest = load_manifest(model_dir)
    huge = {s.name: np.full(s.shape, 3e38, np.float32) for s in manifest.global_params}
    (model_dir / "global_params.safetensors").write_bytes(encode_params(huge))
    assert admin_create_population(server.url, model_dir, "p", '{"target_reports": 3}').status_code == 201
    mixing = {"strategy": "gradient_transfer", "weight": 0.5}
    examples = encode_examples(central_examples(manifest, 20, seed=7), manifest.features)
    assert attach(server.url, "p", mixing, examples).status_code == 200
    token = httpx.post(f"{server.url}/v1/devices", timeout=10).json()["token"]
    auth = {"Authorization": f"Bearer {token}"}
    answer = httpx.post(
        f"{server.url}/v1/populations/p/checkin", json={"example_count": 20}, headers=auth, timeout=10
    ).json()

    # Execute
    served = httpx.get(f"{server.url}{answer['central_gradient_url']}", headers=auth, timeout=60)

    # Assert: no gradient bytes, a status a device retries, and the reason.
    assert served.status_code == 503, served.text
    assert "not finite" in served.json()["detail"]


def test_pseudo_users_of_a_set_size_each_get_their_own_locals(export: Callable[[ModelConfig], Path]) -> None:
    # Prepare: 20 examples as two pseudo-users of 10 (e.g. two accounts' shares, in account order).
    model_dir = export(BIASED)
    model = TFLiteModel(model_dir)
    base = model.get_global()
    examples = central_examples(model.manifest, 20, seed=8)
    task = TaskConfig.from_manifest(model.manifest)
    dataset = CentralDataset(examples)

    # Execute
    two = central_training.gradient_on_central(model, base, dataset, task, 0, examples_per_pseudo_user=10)
    one = central_training.gradient_on_central(model, base, dataset, task, 0)

    # Assert: the mean of each half's gradient with its own reconstructed locals (equal weights);
    # not the gradient of one pseudo-user holding all 20.
    halves = [
        _independent_central_gradient(model_dir, base, examples.select(slice(i, i + 10))) for i in (0, 10)
    ]
    for name, tensor in two.gradient.items():
        np.testing.assert_allclose(
            tensor.dense(), (halves[0][name] + halves[1][name]) / 2, rtol=1e-5, atol=1e-7, err_msg=name
        )
    assert any(
        not np.allclose(one.gradient[k].dense(), two.gradient[k].dense(), atol=1e-6) for k in two.gradient
    )
    assert len(central_training.groups_of(examples, model.manifest, task, 10)) == 2
    with pytest.raises(ValueError, match="at least 1 example"):
        central_training.groups_of(examples, model.manifest, task, 0)


def test_a_datasets_group_ids_are_its_pseudo_users(export: Callable[[ModelConfig], Path]) -> None:
    # Prepare: the same two accounts of 10 examples, their examples interleaved, told apart by
    # group ids (3 and 7); examples_per_pseudo_user is then ignored.
    model_dir = export(BIASED)
    model = TFLiteModel(model_dir)
    base = model.get_global()
    examples = central_examples(model.manifest, 20, seed=8)
    task = TaskConfig.from_manifest(model.manifest)
    interleave = np.ravel(np.column_stack([np.arange(10), np.arange(10, 20)]))
    ids = np.where(interleave < 10, 3, 7).astype(np.int64)

    # Execute
    by_ids = central_training.gradient_on_central(
        model, base, CentralDataset(examples.select(interleave), ids), task, 0, examples_per_pseudo_user=4
    )

    # Assert: each account's gradient with its own locals, as if the dataset were in account order.
    halves = [
        _independent_central_gradient(model_dir, base, examples.select(slice(i, i + 10))) for i in (0, 10)
    ]
    for name, tensor in by_ids.gradient.items():
        np.testing.assert_allclose(
            tensor.dense(), (halves[0][name] + halves[1][name]) / 2, rtol=1e-5, atol=1e-7, err_msg=name
        )


def test_a_group_larger_than_one_call_is_split_into_near_equal_pseudo_users(
    export: Callable[[ModelConfig], Path],
) -> None:
    # Prepare: one account of 2 x capacity + 1 examples and one of 3.
    manifest = load_manifest(export(BIASED))
    task = TaskConfig.from_manifest(manifest)
    capacity = central_training.pseudo_user_capacity(manifest, task)
    big = 2 * capacity + 1
    examples = central_examples(manifest, big + 3, seed=9)
    ids = np.array([1] * 2 + [0] * big + [1], np.int64)

    # Execute
    groups = central_training.groups_of(examples, manifest, task, None, ids)

    # Assert: in id order; account 0 as three parts of at most the capacity; account 1 whole, in
    # dataset order; every example once.
    assert [g.num_examples for g in groups] == [len(p) for p in np.array_split(np.arange(big), 3)] + [3]
    assert all(g.num_examples <= capacity for g in groups)
    np.testing.assert_array_equal(groups[3]["item"], examples["item"][[0, 1, big + 2]])
    np.testing.assert_array_equal(
        np.concatenate([g["item"] for g in groups[:3]]), examples["item"][2 : big + 2]
    )


@pytest.mark.parametrize("model_config", [BIASED, IMPLICIT], ids=["ratings", "implicit"])
def test_every_example_of_a_default_pseudo_user_is_used(
    export: Callable[[ModelConfig], Path], model_config: ModelConfig
) -> None:
    # Prepare: a dataset of many default pseudo-users; implicit labels get 4 negatives per share
    # (a pseudo-user of one update call's worth of shares, the former default, used 40% at most).
    manifest = load_manifest(export(model_config))
    task = TaskConfig.from_manifest(manifest, negatives_per_positive=4, reuse_below=10)
    examples = central_examples(manifest, 5 * manifest.max_examples, seed=10)
    if manifest.task.negative_sampling:
        label = manifest.label_features[0].name
        examples = Examples({**examples.columns, label: np.ones(examples.num_examples, np.float32)})
    rng = np.random.default_rng(0)

    # Execute
    groups = central_training.groups_of(examples, manifest, task)
    batches = [central_training.pseudo_user_batches(manifest, g, task, rng) for g in groups]

    # Assert: every example and negative is in a batch that one call takes and its steps visit.
    for group, (support, query) in zip(groups, batches, strict=True):
        negatives = 0
        if manifest.task.negative_sampling:  # as many as the catalog has beside the group's shares
            shares = len(np.unique(group["item"]))
            negatives = min(shares * task.negatives_per_positive, manifest.catalog_size - shares)
        expected = group.num_examples + negatives
        assert sum(b.num_examples for b in support + query) == expected
        assert len(support) <= min(manifest.max_batches, task.reconstruction_max_steps)
        assert len(query) <= min(manifest.max_batches, task.update_max_steps)
    assert sum(g.num_examples for g in groups) == examples.num_examples


def test_group_ids_are_kept_with_the_dataset_and_reach_the_central_job(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare
    model_dir = export(BIASED)
    model = ExportedModel.from_dir(model_dir)
    make_population(db, model, target_reports=1)
    manifest = Manifest.from_json(model.manifest)
    examples = central_examples(manifest, 12, seed=11)
    accounts = np.array([5, 5, 0, 0, 0, 9, 9, 9, 9, 0, 5, 2], np.int32)
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        blob = encode_examples(examples, manifest.features, accounts)
        mixing_data.attach(session, population, manifest, {"strategy": "gradient_transfer"}, blob, 0.0)

    # Execute: a later transaction, as a commit or an assignment would read it.
    with db.begin() as session:
        population = lock_population(session, "p")
        assert population is not None
        params = TFLiteModel(model_dir).get_global()
        task = TaskConfig.from_manifest(manifest)
        job = mixing_data.central_job(session, population, manifest, 0, params, task, "gradient_transfer")
        shown = mixing_data.describe(session, population)

    # Assert
    assert job is not None and job.dataset.groups is not None
    np.testing.assert_array_equal(job.dataset.groups, accounts)
    np.testing.assert_array_equal(job.dataset.examples["item"], examples["item"])
    assert shown["num_examples"] == 12 and shown["groups"] == 4  # accounts 0, 2, 5 and 9
    assert decode_central(blob, manifest.features, "blob", 1 << 20).groups is not None


def test_the_server_loads_a_model_for_central_training_without_leaving_its_files(
    export: Callable[[ModelConfig], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the process's temporary directory is one this test can list.
    model_dir = export(BIASED)
    model = ExportedModel.from_dir(model_dir)
    manifest = Manifest.from_json(model.manifest)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    models = central_training._ServerModels()

    # Execute: load it, then use it again (from memory).
    with models.model(manifest.model_sha256, manifest, model.tflite) as loaded:
        first = loaded.get_global()
    with models.model(manifest.model_sha256, manifest, None) as again:
        second = again.get_global()

    # Assert: the model works after its files are gone, and none are left behind (a server that
    # left one directory a process filled /tmp over restarts).
    assert list(scratch.iterdir()) == []
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
