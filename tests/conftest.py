"""Shared fixtures: exported models (cached per session) and the public data sets.

The data sets come through the project's fetcher (`python -m android_sim.datasets fetch NAME`):
a test that needs one skips with a line naming it and that command when it is missing and cannot
be fetched (offline), unless FEDRECON_REQUIRE_DATA is set (CI, which has the data): then it fails."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

from android_sim.datasets import DATASETS, FETCH_COMMAND, DatasetError, fetch
from android_sim.small_cohorts import simulation_policy
from model_export.config import Feedback, ModelConfig
from model_export.in_subprocess import export_in_subprocess, export_spec_in_subprocess
from model_runtime.interpreter import BACKENDS as INTERPRETER_BACKENDS

ROOT = Path(__file__).resolve().parent.parent
REQUIRE_DATA = "FEDRECON_REQUIRE_DATA"
# The tests' phones: both modes and the small floors of rounds of a few devices (threshold 0.4,
# sums of 3); tests/privacy sets its own floors and attacks them.
DEVICE_POLICY = simulation_policy("plaintext", "secure")

# The interpreter backends: every test that takes the `backend` fixture runs on each.
BACKENDS = INTERPRETER_BACKENDS

# Small models of different shapes, feedback and parameter sets.
SMALL = ModelConfig(num_items=60, embedding_dim=8, batch_size=4, max_batches=6, top_k=20)
BIASED = ModelConfig(
    num_items=200,
    embedding_dim=16,
    batch_size=5,
    max_batches=8,
    top_k=30,
    item_bias=True,
    user_bias=True,
    global_mean=True,
    global_mean_init=3.5,
)
# Huber loss: random parameters and ratings put errors on both sides of delta.
ROBUST = replace(BIASED, num_items=120, huber_delta=0.75)
IMPLICIT = ModelConfig(
    num_items=150,
    embedding_dim=12,
    batch_size=8,
    max_batches=10,
    top_k=25,
    feedback=Feedback.IMPLICIT,
    item_bias=True,
    user_bias=True,
)
MOVIELENS = ModelConfig(
    num_items=1682,
    embedding_dim=16,
    batch_size=5,
    max_batches=64,
    top_k=50,
    item_bias=True,
    user_bias=True,
    global_mean=True,
    global_mean_init=3.53,
)


@pytest.fixture(scope="session")
def export(tmp_path_factory: pytest.TempPathFactory) -> Callable[[ModelConfig], Path]:
    """Export a config once per session; returns its model directory."""

    def get(config: ModelConfig) -> Path:
        key = json.dumps(config.to_json(), sort_keys=True)
        return exported_once(tmp_path_factory, key, lambda out: export_in_subprocess(config, out))

    return get


def exported_once(tmp_path_factory: pytest.TempPathFactory, key: str, build: Callable[[Path], Path]) -> Path:
    """The model `build` exports for `key`, exported once per test run: under pytest-xdist the
    workers share one folder (a TensorFlow export takes seconds; each worker would repeat it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    out = base / "exported-models" / hashlib.sha256(key.encode()).hexdigest()[:16]
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "manifest.json").exists():
            build(out)
    return out


# A user's own Keras model (neither MF nor an LSTM), exported through `--model`.
GENRE_RATING = "tests.model_export.genre_rating:build"


@pytest.fixture(scope="session")
def genre_rating_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported `tests/model_export/genre_rating.py`, once per session."""
    return _spec_once(tmp_path_factory, GENRE_RATING)


# The next-word LSTM (`model_export.models.next_word:build`) at tiny sizes: 50 global tokens, 4
# local OOV buckets, windows of 8 tokens.
NEXT_WORD_SIZES: dict[str, int | bool] = {
    "num_global_tokens": 50,
    "num_oov_buckets": 4,
    "oov_local": True,
    "seq_len": 8,
    "embedding_dim": 8,
    "lstm_units": 8,
    "batch_size": 4,
    "max_batches": 3,
}


@pytest.fixture(scope="session")
def next_word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny next-word model (`NEXT_WORD_SIZES`), exported once per session."""
    return _spec_once(tmp_path_factory, "model_export.models.next_word:build", NEXT_WORD_SIZES)


@pytest.fixture(scope="session")
def next_word_fedavg_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny next-word model with its OOV rows global too: a model without local variables."""
    return _spec_once(
        tmp_path_factory, "model_export.models.next_word:build", {**NEXT_WORD_SIZES, "oov_local": False}
    )


def _spec_once(
    tmp_path_factory: pytest.TempPathFactory, target: str, model_args: dict[str, int | bool] | None = None
) -> Path:
    key = json.dumps([target, model_args or {}], sort_keys=True)
    build = functools.partial(export_spec_in_subprocess, target, model_args=model_args)
    return exported_once(tmp_path_factory, key, lambda out: build(out=out))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@functools.cache
def _fetched(name: str) -> Path | str:
    """The data set's folder, fetched once per session if it is missing; else why not."""
    try:
        return fetch(name, timeout=20.0)
    except DatasetError as error:
        return str(error)


def dataset_folder(name: str) -> Path:
    """The verified folder of data set `name`; skips the test (fails it under CI) without it."""
    got = _fetched(name)
    if isinstance(got, Path):
        return got
    message = f"{DATASETS[name].title} is not available; fetch it with `{FETCH_COMMAND} {name}`"
    if os.environ.get(REQUIRE_DATA):
        pytest.fail(f"{message} ({REQUIRE_DATA} is set: {got})", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def movielens_100k() -> Path:
    """MovieLens 100K's ratings file (u.data)."""
    return dataset_folder("movielens-100k") / "u.data"


@pytest.fixture(scope="session")
def tiny_shakespeare() -> Path:
    """Tiny Shakespeare's folder (input.txt and SHA256SUMS)."""
    return dataset_folder("tinyshakespeare")


@pytest.fixture(scope="session")
def movielens_users(movielens_100k: Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(items 0-based, ratings, timestamps) per MovieLens 100K user."""
    from android_sim.movielens import load_ratings

    ratings = load_ratings(movielens_100k)
    return [(ratings.item[r], ratings.rating[r], ratings.timestamp[r]) for r in ratings.by_user()]


def perturbed_globals(params: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Globals with every tensor nonzero, so each term of the maths is exercised."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in params.items()}


# A user's own ranking model with a context feature (the hour) and two local tensors, exported
# through `--model` (`tests/device_runtime/hour_recommender.py`).
HOUR_RECOMMENDER = "tests.device_runtime.hour_recommender:build"


@pytest.fixture(scope="session")
def hour_recommender_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported hour-aware expression recommender, once per session."""
    return _spec_once(tmp_path_factory, HOUR_RECOMMENDER)


@pytest.fixture(scope="session")
def sticker_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The context-aware sticker ranking model (`model_export.models.stickers`), once per session."""
    return _spec_once(tmp_path_factory, "model_export.models.stickers:build")


def pytest_collection_finish(session: pytest.Session) -> None:
    """TensorFlow must never load into the test process: tflite_runtime then fails to load models
    ("vector::reserve", then a segmentation fault). Tests export in subprocesses; a test module
    that imports a Keras builder at module level would break every later tflite_runtime test."""
    import sys

    if "tensorflow" in sys.modules:
        raise pytest.UsageError(
            "a test module imported TensorFlow into the test process; export in a subprocess "
            "(model_export.in_subprocess) and read what the test needs from the manifest"
        )
