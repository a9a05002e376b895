"""Ranking with context: a user's hour-aware recommender (tests/device_runtime/hour_recommender.py),
its examples imported from a CSV, trained by the device task, and served for an hour."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import INITIAL_GLOBAL_FILE, load_manifest
from contracts.params import decode_params, encode_params
from contracts.task_config import LocalState, TaskConfig
from device_runtime.__main__ import main
from device_runtime.client_task import Outcome, Task, run_evaluation_task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.examples_table import store_path
from device_runtime.local_state import LocalStateStore
from device_runtime.recommender import Recommender
from device_runtime.task_environment import Environment
from model_export.config import ModelConfig
from model_runtime.support_query import add_negatives
from model_runtime.tflite_model import TFLiteModel
from tests.conftest import BIASED

NIGHT, MORNING = [0, 1, 2, 3, 4], [10, 11, 12, 13, 14]


def shares_csv(path: Path) -> Path:
    """Two devices over a week: 'ana' shares expressions 0-4 at 21h and 10-14 at 8h; 'ben' shares
    20-24 at any hour. Implicit feedback: the label column is left out (every row is a share)."""
    rows = ["device_id,timestamp,expression,hour"]
    for day in range(7):
        t = 1_795_000_000 + day * 86_400
        rows += [f"ana,{t + 21 * 3600 + i},{e},21" for i, e in enumerate(NIGHT)]
        rows += [f"ana,{t + 8 * 3600 + i},{e},8" for i, e in enumerate(MORNING)]
        rows += [f"ben,{t + h * 3600},{20 + (day + h) % 5},{h}" for h in (9, 13, 18)]
    path.write_text("\n".join(rows) + "\n")
    return path


def recommend(capsys: pytest.CaptureFixture[str], *args: str | Path) -> dict:  # type: ignore[type-arg]
    assert main(["recommend", *map(str, args), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_import_train_and_recommend_for_the_hour(
    hour_recommender_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: the user's CSV imported into one store per device
    model_dir = hour_recommender_model
    stores = tmp_path / "stores"
    code = main(
        [
            "import",
            "--model-dir",
            str(model_dir),
            "--examples",
            str(shares_csv(tmp_path / "s.csv")),
            "--out",
            str(stores),
        ]
    )
    assert code == 0 and "91 examples of 91 rows in 2 example stores" in capsys.readouterr().out
    model = TFLiteModel(model_dir)
    globals_ = model.get_global()
    config = TaskConfig(
        local_state=LocalState.KEEP, local_learning_rate=0.5, update_max_epochs=5, negatives_per_positive=1
    )

    # Execute: FURL tasks on both devices, each delta applied (a federation of two, one at a time)
    for task in range(15):
        for device in ("ana", "ben"):
            with ExampleStore(store_path(stores, device)) as store:
                result = run_training_task(
                    model, Environment.of(store), globals_, Task(config, population="p", seed=task)
                )
            assert result.outcome is Outcome.COMPLETED, result.message
            assert result.delta is not None
            globals_ = {k: v + result.delta[k] for k, v in globals_.items()}
    trained = tmp_path / "globals.safetensors"
    trained.write_bytes(encode_params(globals_))
    ana = store_path(stores, "ana")
    common: list[str | Path] = [
        "--store", ana, "--model-dir", model_dir, "--globals", trained, "--locals", "kept",
        "--population", "p", "--include-used", "-k", "5",
    ]  # fmt: skip
    at_night = recommend(capsys, *common, "--context", "hour=21")
    in_the_morning = recommend(capsys, *common, "--context", "hour=8")

    # Assert: the same user, two hours, two rankings, each the hour's own expressions
    assert at_night["local_params"] == "kept" and at_night["context"] == {"hour": 21}
    assert set(at_night["items"]) == set(NIGHT), at_night
    assert set(in_the_morning["items"]) == set(MORNING), in_the_morning
    # Both local tensors stayed on the device, trained in the hours the user shared in only
    with ExampleStore(ana) as store:
        kept = LocalStateStore(store, "p").load(model)
    assert set(kept.params) == {"user_embedding", "hour_preference"} and kept.trained
    used = np.flatnonzero(np.any(kept.params["hour_preference"] != 0, axis=1))
    assert used.tolist() == [8, 21]


def test_reconstructed_locals_serve_the_hour_too(
    hour_recommender_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stores = tmp_path / "stores"
    main(
        [
            "import",
            "--model-dir",
            str(hour_recommender_model),
            "--examples",
            str(shares_csv(tmp_path / "s.csv")),
            "--out",
            str(stores),
        ]
    )
    capsys.readouterr()
    common: list[str | Path] = [
        "--store",
        store_path(stores, "ana"),
        "--model-dir",
        hour_recommender_model,
        "-k",
        "3",
    ]

    first = recommend(capsys, *common, "--context", "hour=21")
    again = recommend(capsys, *common, "--context", "hour=21")

    assert first["source"] == "personalized" and first["local_params"] == "reconstructed"
    assert first["items"] == again["items"] and not set(first["items"]) & set(NIGHT + MORNING)


def test_negatives_stand_in_the_context_of_their_share(hour_recommender_model: Path) -> None:
    manifest = load_manifest(hour_recommender_model)
    shares = Examples(
        {
            "expression": np.array([3, 5, 7], np.int32),
            "hour": np.array([21, 8, 13], np.int32),
            "label": np.ones(3, np.float32),
        }
    )

    mixed = add_negatives(shares, manifest, 4, np.random.default_rng(0))

    negative = mixed["label"] == 0
    assert negative.sum() == 12 and mixed.num_examples == 15
    assert not set(mixed["expression"][negative].tolist()) & {3, 5, 7}
    assert sorted(mixed["hour"][negative].tolist()) == [8] * 4 + [13] * 4 + [21] * 4


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ([], "this model needs a value of each context feature ['hour']: give --context hour=VALUE"),
        (["--context", "hour=24"], "--context hour: got '24'; expected an integer in [0, 23]"),
        (["--context", "hour=nine"], "--context hour: got 'nine'; expected an integer in [0, 23]"),
        (
            ["--context", "surface=2"],
            "the model has no context feature 'surface'; the model's context features",
        ),
        (["--context", "hour"], "--context 'hour': expected NAME=VALUE"),
    ],
)
def test_a_wrong_context_is_one_line(
    hour_recommender_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    context: list[str],
    message: str,
) -> None:
    store = tmp_path / "s.sqlite"
    ExampleStore(store, load_manifest(hour_recommender_model).features).close()

    code = main(["recommend", "--store", str(store), "--model-dir", str(hour_recommender_model), *context])

    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_model_without_context_takes_none(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s.sqlite"
    ExampleStore(store, BIASED.features()).close()

    code = main(
        ["recommend", "--store", str(store), "--model-dir", str(export(BIASED)), "--context", "hour=3"]
    )

    assert code == 2 and "the model has no context feature 'hour'; the model's context features are []" in (
        capsys.readouterr().err
    )


def test_recommend_and_predict_refuse_the_other_task_before_anything_starts(
    genre_rating_model: Path, hour_recommender_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.sqlite"

    assert main(["recommend", "--store", str(missing), "--model-dir", str(genre_rating_model)]) == 2
    err = capsys.readouterr().err
    assert (
        "is a regression model: `recommend` ranks a ranking model's catalog; use `device-runtime predict`"
        in err
    )
    assert main(["predict", "--store", str(missing), "--model-dir", str(hour_recommender_model)]) == 2
    err = capsys.readouterr().err
    assert "is a ranking model: `predict` is for classification and regression models" in err
    assert not missing.exists()


def test_predict_a_regression_with_the_users_locals(
    genre_rating_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = load_manifest(genre_rating_model)
    path = tmp_path / "s.sqlite"
    ExampleStore(path, manifest.features).close()
    args = ["predict", "--store", str(path), "--model-dir", str(genre_rating_model), "--json"]
    inputs = ["--input", "movie=3", "--input", "genre=3"]

    assert main([*args, *inputs]) == 0
    fresh = json.loads(capsys.readouterr().out)
    with ExampleStore(path, manifest.features) as store:
        store.add(Event({"movie": m, "genre": m % 5, "rating": 5.0}, float(m)) for m in range(12))
    assert main([*args, *inputs]) == 0
    personal = json.loads(capsys.readouterr().out)

    assert fresh["local_params"] == "initial" and personal["local_params"] == "reconstructed"
    assert fresh["inputs"] == {"movie": 3, "genre": 3}
    # The user rates everything 5: the reconstructed user vector lifts the prediction toward it.
    assert personal["predictions"] > fresh["predictions"]
    assert main([*args[:-1], "--input", "movie=3"]) == 2
    assert (
        "needs a value of each input feature ['genre']: give --input genre=VALUE" in capsys.readouterr().err
    )
    assert main([*args[:-1], *inputs]) == 0
    assert "prediction: " in capsys.readouterr().out


def test_a_store_of_another_model_ends_the_task_with_a_named_reason(
    hour_recommender_model: Path, tmp_path: Path
) -> None:
    model = TFLiteModel(hour_recommender_model)
    store = ExampleStore(tmp_path / "ratings.sqlite", BIASED.features())
    store.add([Event({"item": 3, "label": 4.0}, 1.0)])
    globals_ = decode_params(
        (hour_recommender_model / INITIAL_GLOBAL_FILE).read_bytes(), model.manifest.global_params, "g"
    )

    for result in (
        run_training_task(model, Environment.of(store), globals_, Task(TaskConfig())),
        run_evaluation_task(model, Environment.of(store), globals_, Task(TaskConfig())),
        run_training_task(
            model,
            Environment.of(store),
            globals_,
            Task(TaskConfig(local_state=LocalState.KEEP, local_learning_rate=0.5), population="p"),
        ),
    ):
        assert result.outcome is Outcome.INCOMPATIBLE_STORE
        assert "holds examples of (item int32, label float32 (label)); the model takes (expression int32" in (
            result.message
        )


def test_the_catalog_is_scored_in_the_context_given(hour_recommender_model: Path, backend: str) -> None:
    """`infer` against the model's maths by hand: <e, u + h[hour]> + b for every expression."""
    model = TFLiteModel(hour_recommender_model, backend=backend)
    rng = np.random.default_rng(1)
    globals_ = {k: rng.normal(0, 0.5, v.shape).astype(np.float32) for k, v in model.get_global().items()}
    locals_ = {s.name: rng.normal(0, 0.5, s.shape).astype(np.float32) for s in model.manifest.local_params}
    model.set_global(globals_)
    model.set_local(locals_)
    exclude = np.zeros(30, bool)
    exclude[[1, 2]] = True

    for hour in (0, 7, 23):
        ranking = model.infer(exclude, {"hour": hour})

        user = locals_["user_embedding"] + locals_["hour_preference"][hour]
        expected = globals_["expression_embeddings"] @ user + globals_["expression_bias"]
        np.testing.assert_allclose(ranking.scores, expected, rtol=1e-5, atol=1e-5)
        best = [i for i in np.argsort(-expected, kind="stable") if i not in (1, 2)][:10]
        assert ranking.top_items.tolist() == best


def test_a_phone_without_examples_is_shown_the_popular_ones_in_its_context(
    hour_recommender_model: Path, tmp_path: Path
) -> None:
    """The cold start ranks by the model's scores with its initial locals, in the context asked."""
    model = TFLiteModel(hour_recommender_model)
    params = model.get_global()
    bias = np.zeros_like(params["expression_bias"])
    bias[[7, 3, 5]] = [3.0, 2.0, 1.0]
    params["expression_bias"] = bias
    with ExampleStore(tmp_path / "new.sqlite", model.manifest.features) as store:
        top = Recommender(model, store, params).recommend(3, context={"hour": 21})

    assert top.source == "popularity"
    assert top.items.tolist() == [7, 3, 5]
