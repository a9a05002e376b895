"""The main job's quality in about a minute: its data, split, model, task and held-out evaluation,
with the rounds run in-process (`android_sim.simulation.simulate`) instead of by the fleet over HTTP.

    .venv/bin/python -m benchmarks.main_quality [SETTINGS_JSON ...]

Each argument is one configuration, a JSON object over the main job's defaults:
`{"task": {...}}` task config fields, `{"server": {...}}` server optimizer fields,
`{"model": {...}}` model config fields (a new export), `"rounds"` (60), `"clients"` (40 reports
a round), `"seed"` (the data's, the held-out draw's and the client sampling's; 0), `"serve"`
(task config fields the held-out devices reconstruct with, over the population's task config,
which a device serves with), `"serve_model"` (model config fields of the export the held-out
devices reconstruct and rank with, over the trained one's: the same parameters, e.g. another
`history_start`; a serving-only trial of a model change), `"serve_bagging"` (the held-out devices
rank by a bagged reconstruction: `device_runtime.recommender.Bagging`'s fields, e.g.
`{"members": 8}`), `"validation"` (true: score as many validation devices, drawn from the training ones and
kept out of training, in place of the held-out ones, which then train nothing either: a
choice made on them never saw the held-out devices), `"uniform"` (every report weighs the
same, as under secure aggregation or DP) and `"secure"` (secure aggregation's arithmetic:
deltas clipped to this L2 norm, quantized to 32 bits, summed and dequantized, uniform weights;
the main job's `--aggregation secure` clips to 10). Prints one line per configuration:
FedRecon's expected hit rate@10 with its 95% interval, its hit rate over the newest shares, by
history size, the ceilings on the same held-out devices, the serving cost (the wall time of the
held-out devices' `recommend`, reconstruction included, in all and a device), and
after a seed's first configuration FedRecon's paired difference from it (same devices), over
every device and per history size. Configurations that differ only in the serving keys
(`"serve"`, `"serve_model"`, `"serve_bagging"`) share one training. This is how
the main job's defaults were tuned (docs/benchmarks.md, "Quality: the main job's held-out devices");
the fleet adds device availability, dropouts and staleness, so confirm a change with `./dev main`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from android_sim import recommendations
from android_sim.algorithm import optimizer_over
from android_sim.builtin_data import builtin_workload, export, load_data, model_config
from android_sim.hit_rates import HISTORY_BUCKETS, expected_hit_rate, history_bucket
from android_sim.intervals import Interval, bootstrap_means, resample_rows
from android_sim.recommendations import HitRates, score_held_out
from android_sim.run import future_count, write_store
from android_sim.run_config import RunConfig
from android_sim.simulation.command import simulation_task
from android_sim.simulation.protocol import UserSplit
from android_sim.simulation.rounds import Rounds, Server
from android_sim.simulation.simulate import SimulationOptions, simulate
from android_sim.workload import newest_first, split_newest
from benchmarks.quality_methods import SecureQuantization
from benchmarks.quality_study import SECURE_BITS, SECURE_OVERSAMPLING
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from device_runtime.examples_table import store_path
from device_runtime.recommender import Bagging, Recommendation, Recommender
from model_runtime.tflite_model import TFLiteModel
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from secure_aggregation.quantization import Layout

# The keys that change only how the held-out devices serve: configurations that differ in these
# alone share one training (the rounds are deterministic: the same spec trains the same globals).
SERVING_KEYS = ("serve", "serve_model", "serve_bagging")


class TimedRecommender(Recommender):
    """The held-out devices' `Recommender`, adding up the wall time of their `recommend` calls
    (reconstruction or reconstructions, and ranking): the serving cost."""

    seconds = 0.0
    calls = 0

    def recommend(self, *args: Any, **kwargs: Any) -> Recommendation:
        started = time.perf_counter()
        try:
            return super().recommend(*args, **kwargs)
        finally:
            TimedRecommender.seconds += time.perf_counter() - started
            TimedRecommender.calls += 1


setattr(recommendations, "Recommender", TimedRecommender)  # noqa: B010 (the held-out devices use it)


def run(spec: dict[str, Any], work: Path, trained: dict[str, SimpleNamespace]) -> HitRates:
    """`spec`'s hit rates; `trained`: the trainings so far, by their spec without the serving keys."""
    key = json.dumps({k: v for k, v in spec.items() if k not in SERVING_KEYS}, sort_keys=True)
    if key not in trained:
        trained[key] = train(spec, work)
    return serve(spec, work, trained[key])


def train(spec: dict[str, Any], work: Path) -> SimpleNamespace:
    seed, rounds, clients = spec.get("seed", 0), spec.get("rounds", 60), spec.get("clients", 40)
    config = RunConfig(
        work_dir=work, seed=seed, task=spec.get("task", {}), server_optimizer=spec.get("server", {})
    )
    data = load_data(config)
    model = replace(model_config(data), **spec.get("model", {}))
    tag = hashlib.sha256(json.dumps(model.to_json(), sort_keys=True).encode()).hexdigest()[:12]
    model_dir = export(model, work / "models" / tag)
    workload = builtin_workload(config, data, model_dir)
    # The main job's split (`run.prepare_devices`): the same held-out devices and kept-aside shares.
    count = len(workload.devices)
    held = sorted(np.random.default_rng(seed).permutation(count)[: round(config.held_out_fraction * count)])
    if spec.get("validation"):
        # As many validation devices, drawn from the rest, are scored instead; the held-out ones
        # still train nothing, so a choice made on the validation devices never saw them.
        rest = sorted(set(range(count)) - set(held))
        excluded = set(held)
        held = sorted(np.random.default_rng((seed, 1)).choice(rest, len(held), replace=False).tolist())
    else:
        excluded = set()
    stored, future = {}, {}
    for i in held:
        device = workload.devices[i]
        kept_aside = future_count(device.examples.num_examples)
        stored[i] = device
        if kept_aside:
            stored[i], future[i] = split_newest(device, kept_aside)
    devices = [newest_first(stored.get(i, d)) for i, d in enumerate(workload.devices)]
    training = [i for i in range(count) if i not in stored and i not in excluded]
    eligible = [i for i in training if devices[i].num_examples >= config.min_examples]
    task = simulation_task(workload, config.task, config.min_examples)
    server = ServerOptimizerConfig.from_json(
        optimizer_over(workload.server_optimizer, config.server_optimizer)
    )
    secure = None
    if "secure" in spec:
        secure = SecureQuantization(
            float(spec["secure"]), SECURE_BITS, math.ceil(clients * SECURE_OVERSAMPLING)
        )
        task = replace(task, clip_norm=secure.clip_norm)

    def make_server(initial: Params, manifest: Manifest) -> Server:
        layout = Layout.of(manifest.global_params)
        arithmetic = None if secure is None else (secure.parameters(layout.length), layout)
        return (
            UniformServer(initial, server, secure=arithmetic)
            if spec.get("uniform")
            else Server(initial, server, secure=arithmetic)
        )

    options = SimulationOptions(Rounds(rounds, clients, rounds, seed), task, server, workers=2)
    split = UserSplit(eligible, held[:10], held)
    result = simulate(model_dir, devices, options, make_server, split)
    return SimpleNamespace(
        seed=seed, tag=tag, model=model, model_dir=model_dir, workload=workload, task=task, held=held,
        stored=stored, future=future, training=training, params=result.params,
    )  # fmt: skip


def serve(spec: dict[str, Any], work: Path, trained: SimpleNamespace) -> HitRates:
    """The held-out devices' hit rates with `trained`'s globals, served as `spec` says."""
    fleet = []
    for i in trained.held:
        # A new store each time: no device serves from a cache another configuration left.
        path = store_path(work / "stores" / f"{trained.tag}-{trained.seed}", trained.stored[i].device_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_store(path, trained.stored[i], trained.workload)
        fleet.append(
            SimpleNamespace(index=i, store_path=path, num_examples=trained.stored[i].examples.num_examples)
        )
    # Held-out devices serve with the population's task config, as the main job's do; "serve"
    # overrides fields of it (a serving-only trial).
    task = TaskConfig.from_json({**trained.task.to_json(), **spec.get("serve", {})})
    serving_dir = trained.model_dir
    if "serve_model" in spec:
        serving = replace(trained.model, **spec["serve_model"])
        serving_tag = hashlib.sha256(json.dumps(serving.to_json(), sort_keys=True).encode()).hexdigest()[:12]
        serving_dir = export(serving, work / "models" / serving_tag)
    bagging = Bagging.from_json(spec["serve_bagging"]) if "serve_bagging" in spec else None
    TimedRecommender.seconds, TimedRecommender.calls = 0.0, 0
    found, _ = score_held_out(
        TFLiteModel(serving_dir),
        trained.params,
        "final",
        fleet,
        trained.future,
        trained.workload,
        trained.training,
        0,
        task,
        bagging,
    )
    assert found is not None
    return found


class UniformServer(Server):
    """Every report weighs the same (secure aggregation's and DP's mean), in plaintext."""

    def commit(self, reports: Any, merge: Any = None) -> int:
        return super().commit([None if r is None else (r[0], 1.0) for r in reports], merge)


def line(spec: dict[str, Any], found: HitRates) -> str:
    methods = found.evaluation.methods
    mine = methods["personalized"]
    rule = methods["topic_rule"]
    by_size = " / ".join(
        f"{b} {mine.by_history[b]['expected'].value:.1%}"  # type: ignore[union-attr]
        f" (topic rule {rule.by_history[b]['expected'].value:.1%})"  # type: ignore[union-attr]
        for b in HISTORY_BUCKETS
    )
    ceilings = ", ".join(
        f"{m} {methods[m].expected.value:.1%}"  # type: ignore[union-attr]
        for m in ("most_shared", "topic_rule", "central_mf", "bayes", "oracle")
    )
    per_device = 1000 * TimedRecommender.seconds / max(TimedRecommender.calls, 1)
    to_bayes = paired_text(
        per_device_expected(found, "bayes"), per_device_expected(found), history_buckets(found)
    )
    return (
        f"{json.dumps(spec)}: FedRecon expected {mine.expected}, newest {mine.newest}; "
        f"by history {by_size}; {ceilings}; FedRecon minus Bayes {to_bayes}; "
        f"serving {TimedRecommender.seconds:.2f} s ({per_device:.1f} ms a device)"
    )


def per_device_expected(found: HitRates, method: str = "personalized") -> dict[int, float]:
    """Each scored device's expected hit rate@10 of `method`'s top-10 (FedRecon's), by the device's index."""
    return {
        d.index: expected_hit_rate(np.asarray(d.tops[method]), d.probabilities)
        for d in found.scored
        if d.probabilities is not None
    }


def history_buckets(found: HitRates) -> dict[int, str]:
    """Each scored device's history size bucket (1, 2-4, 5+), by the device's index."""
    return {d.index: history_bucket(d.history) for d in found.scored}


def paired(first: dict[int, float], other: dict[int, float], only: set[int] | None = None) -> Interval:
    """`other` minus `first` over the devices both scored (the same held-out draw: the same seed),
    bootstrapped over devices: the draw's noise cancels, what is left is the change's. `only`:
    over these devices alone (e.g. one history size)."""
    common = sorted(first.keys() & other.keys() & (first.keys() if only is None else only))
    differences = np.array([other[i] - first[i] for i in common])
    return bootstrap_means(differences, resample_rows(len(common), np.random.default_rng(0)))


def paired_text(first: dict[int, float], other: dict[int, float], buckets: dict[int, str]) -> str:
    """The paired difference over every device and per history size."""
    by_size = ", ".join(
        f"{b} {paired(first, other, {i for i, s in buckets.items() if s == b})}" for b in HISTORY_BUCKETS
    )
    return f"{paired(first, other)} (by history {by_size})"


def main() -> None:
    specs = [json.loads(a) for a in sys.argv[1:]] or [{}]
    for spec in specs:  # a bad serving setting is refused before any training
        try:
            Bagging.from_json(spec.get("serve_bagging", {}))
        except ValueError as e:
            sys.exit(f"main_quality: {e}")
    # The first configuration of each seed (and scored set: held-out or validation devices).
    baseline: dict[tuple[int, bool], dict[int, float]] = {}
    trained: dict[str, SimpleNamespace] = {}
    with tempfile.TemporaryDirectory() as work:
        for spec in specs:
            found = run(spec, Path(work), trained)
            text = line(spec, found)
            seed, mine = (int(spec.get("seed", 0)), bool(spec.get("validation"))), per_device_expected(found)
            if seed in baseline:
                text += "; paired minus this seed's first configuration " + paired_text(
                    baseline[seed], mine, history_buckets(found)
                )
            baseline.setdefault(seed, mine)
            print(text, flush=True)


if __name__ == "__main__":
    main()
