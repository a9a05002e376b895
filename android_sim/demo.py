"""The single-device walk-through: export, fill a store from MovieLens, one client task, top-10."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from android_sim.movielens import load_ratings, load_titles
from contracts.manifest import INITIAL_GLOBAL_FILE
from contracts.params import decode_params
from contracts.task_config import TaskConfig
from device_runtime.client_task import Task, run_training_task
from device_runtime.example_store import Event, ExampleStore
from device_runtime.recommender import Recommender
from device_runtime.task_environment import Environment
from model_export.config import ITEM, LABEL
from model_runtime.tflite_model import TFLiteModel


def run_demo(ratings_path: Path, work_dir: Path | None = None, user: int = 0) -> int:
    from model_export.config import ModelConfig
    from model_export.export import export_spec
    from model_export.matrix_factorization import build_spec

    work = Path(work_dir or tempfile.mkdtemp(prefix="fedrecon-demo-"))
    ratings = load_ratings(ratings_path)
    titles = load_titles(ratings_path, ratings)
    mean = float(ratings.rating.mean())
    print(f"MovieLens: {len(ratings.rating):,} ratings, {ratings.num_users} users, {ratings.num_items} items")

    t0 = time.perf_counter()
    config = ModelConfig(
        num_items=ratings.num_items, item_bias=True, user_bias=True, global_mean=True, global_mean_init=mean
    )
    result = export_spec(build_spec(config), work / "model")
    print(
        f"exported {result.model_dir} in {time.perf_counter() - t0:.1f} s "
        f"({result.tflite_bytes:,} bytes; signatures {', '.join(sorted(result.manifest.signatures))})"
    )

    model = TFLiteModel(work / "model")
    rows = ratings.by_user()[user]
    store_path = work / f"device-{user}.sqlite"
    store_path.unlink(missing_ok=True)
    with ExampleStore(store_path, model.manifest.features) as store:
        store.add(
            Event({ITEM: int(ratings.item[i]), LABEL: float(ratings.rating[i])}, float(ratings.timestamp[i]))
            for i in rows
        )
        print(f"device {user}: {store.count()} examples in {store_path} (interpreter: {model.backend})")

        global_params = decode_params(
            (work / "model" / INITIAL_GLOBAL_FILE).read_bytes(),
            model.manifest.global_params,
            "initial globals",
        )
        task = TaskConfig.from_manifest(model.manifest)
        t0 = time.perf_counter()
        outcome = run_training_task(model, Environment.of(store), global_params, Task(task))
        ms = (time.perf_counter() - t0) * 1000
        print(
            f"client task: {outcome.outcome.value} in {ms:.1f} ms; weight |query| = {outcome.num_examples}; "
            f"reconstruction loss {outcome.metrics.get('reconstruction_loss', float('nan')):.3f}, "
            f"update loss {outcome.metrics.get('update_loss', float('nan')):.3f}"
        )
        if outcome.delta is not None:
            norms = {k: float(np.linalg.norm(v)) for k, v in outcome.delta.items()}
            print("delta norms: " + ", ".join(f"{k} {v:.4f}" for k, v in norms.items()))
            # What the server would do with one report under server SGD at rate 1.0.
            global_params = {k: global_params[k] + outcome.delta[k] for k in global_params}

        recommender = Recommender(model, store, global_params)
        t0 = time.perf_counter()
        top = recommender.recommend(10)
        ms = (time.perf_counter() - t0) * 1000
        print(
            f"top-10 for device {user} ({top.source}, {ms:.1f} ms incl. reconstruction), "
            "excluding rated movies:"
        )
        for rank, (item, score) in enumerate(zip(top.items, top.scores, strict=True), start=1):
            print(f"  {rank:2d}. {titles[int(item)]:<60s} {score:5.2f}")
    return 0
