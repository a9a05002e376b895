"""The quality benchmark command: FedRecon and the paper's baselines on MovieLens (the methods
are in `quality_methods.py`, what is reported in `quality_report.py`), its ablations, DP and secure
aggregation rows, and the staleness and implicit-feedback studies it runs beside them.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.device_data import expression_fleet
from android_sim.expressions import SyntheticConfig
from android_sim.simulation.protocol import (
    UserSplit,
    split_users,
)
from android_sim.simulation.rounds import (
    Rounds,
)
from benchmarks.figures import mean_over_runs_interval, paired_interval
from benchmarks.implicit import movielens_shares, run_implicit
from benchmarks.model_cache import ModelCache
from benchmarks.quality_methods import (
    BETTER,
    CENTRALIZED,
    FAITHFUL,
    FURL,
    Dataset,
    FedReconSettings,
    SecureQuantization,
    load_dataset,
    run_centralized_recon_eval,
    run_centralized_standard_eval,
    run_fedavg_stateful,
    run_fedrecon,
    run_shared_user,
    whole_user_model,
)
from benchmarks.quality_report import (
    MethodResult,
    ceiling_note,
    check_targets,
    figure,
    plot_curves,
    quality_table,
    shown,
)
from benchmarks.staleness import StalenessOptions, plot_staleness, run_staleness
from contracts.task_config import TaskConfig
from orchestrator.aggregation.differential_privacy import DPConfig, epsilon, population_size_for

METHODS = (
    "fedrecon",
    "better",
    "better_seeds",
    "fedavg_standard_eval",
    "fedavg_recon_eval",
    "fedavg_shared_user",
    "centralized_recon_eval",
    "centralized_better_recon_eval",
    "centralized_standard_eval",
    "kr_ablation",
    "ku_ablation",
    "staleness",
    "dp_fedrecon",
    "secure_fedrecon",
    "implicit_movielens",
    "implicit_expressions",
)
ABLATION_STEPS = (0, 1, 2, 5, 10)
UPDATE_ABLATION_STEPS = (1, 2, 5, 10)
# DP-FedAvg on the protocol's FedRecon: the clip norm is about the median client delta norm
# after a few dozen rounds (5.4 at round 60; 9-11 in the first rounds); noise 0 is clipping only.
DP_CLIP_NORM = 5.0
DP_NOISE_MULTIPLIERS = (0.0, 0.3, 0.7, 1.0)
DP_DELTA = 1e-5
DP_TARGET_EPSILON = 5.0
SPLIT_SEEDS = (0, 1, 2, 3, 4)
# Secure aggregation as the orchestrator runs it by default: 32 bits, capacity = target x 1.3.
SECURE_BITS = 32
SECURE_OVERSAMPLING = 1.3


@dataclass(frozen=True)
class QualityOptions:
    ratings: Path
    out: Path
    models_dir: Path
    methods: tuple[str, ...] = METHODS
    rounds: Rounds = field(default_factory=Rounds)
    workers: int = 2
    better: FedReconSettings = BETTER
    split_seeds: tuple[int, ...] = SPLIT_SEEDS
    centralized_epochs: int = 30
    staleness: StalenessOptions = field(default_factory=StalenessOptions)
    dp_clip_norm: float = DP_CLIP_NORM
    dp_noise_multipliers: tuple[float, ...] = DP_NOISE_MULTIPLIERS
    secure_bits: int = SECURE_BITS

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
        if self.workers < 1 or self.centralized_epochs < 1:
            raise ValueError("workers and centralized epochs must be >= 1")


def _spread(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, np.float64)
    return {
        "mean": float(array.mean()),
        "std": float(array.std()),
        "min": float(array.min()),
        "max": float(array.max()),
    }


def run_quality(options: QualityOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the chosen methods; returns the report (also written to `out/quality.json`)."""
    data = load_dataset(options.ratings)
    split = split_users(len(data.examples))
    models = ModelCache(options.models_dir)
    rounds, workers = options.rounds, options.workers
    report: dict[str, Any] = {
        "dataset": {"file": str(options.ratings), "users": len(data.examples), "items": data.num_items},
        "protocol": {
            "user_split_seed": 42,
            "users": {
                "train": len(split.train),
                "validation": len(split.validation),
                "test": len(split.test),
            },
            "rounds": rounds.rounds,
            "clients_per_round": rounds.clients_per_round,
            "sampling_seed": rounds.sampling_seed,
            "validation_every": rounds.evaluate_every,
            "workers": workers,
        },
        "methods": {},
    }
    results: dict[str, MethodResult] = report["methods"]
    started = time.perf_counter()

    def done(result: MethodResult) -> None:
        results[result.method] = result
        log(
            f"{result.method:<28} test RMSE {shown(result.test, result.intervals, 'rmse')}  "
            f"accuracy {shown(result.test, result.intervals, 'accuracy')}  "
            f"({result.seconds:.1f} s; {result.evaluated_on.split(',')[0]}; {ceiling_note(result.method)})"
        )

    chosen = set(options.methods)
    if "fedrecon" in chosen:
        done(run_fedrecon(data, split, FAITHFUL, rounds, models, workers))
    if "better" in chosen:
        done(run_fedrecon(data, split, options.better, rounds, models, workers, method="better"))
    if chosen & {"fedavg_standard_eval", "fedavg_recon_eval"}:
        for result in run_fedavg_stateful(data, split, rounds, models, workers):
            done(result)  # one training, both rows
    if "fedavg_shared_user" in chosen:
        done(run_shared_user(data, split, rounds, models, workers))
    if "centralized_recon_eval" in chosen:
        done(
            run_centralized_recon_eval(data, split, CENTRALIZED, options.centralized_epochs, models, workers)
        )
    if "centralized_better_recon_eval" in chosen:
        done(
            run_centralized_recon_eval(
                data,
                split,
                CENTRALIZED,
                options.centralized_epochs,
                models,
                workers,
                like=options.better,
                method="centralized_better_recon_eval",
            )
        )
    if "centralized_standard_eval" in chosen:
        done(
            run_centralized_standard_eval(
                data, split, CENTRALIZED, options.centralized_epochs, models, workers
            )
        )
    if "better_seeds" in chosen:
        runs: list[dict[str, Any]] = []
        per_seed = []
        for seed in options.split_seeds:
            result = run_fedrecon(
                data, split_users(len(data.examples), seed), options.better, rounds, models, workers
            )
            log(
                f"  better, user split seed {seed}: RMSE {shown(result.test, result.intervals, 'rmse')}, "
                f"accuracy {shown(result.test, result.intervals, 'accuracy')}"
            )
            runs.append({"split_seed": seed, **result.test, "intervals": result.intervals})
            per_seed.append(result.per_user)
        seeds: dict[str, Any] = {"runs": runs}
        report["better_split_seeds"] = seeds
        for metric in ("rmse", "accuracy"):
            # The mean over splits, its interval from each split's test users resampled on their own.
            seeds[metric] = {
                **_spread([r[metric] for r in runs]),
                "mean_95": mean_over_runs_interval(per_seed, metric),
            }
        log(
            f"  better over user split seeds {list(options.split_seeds)}: mean RMSE "
            f"{figure(seeds['rmse']['mean'], seeds['rmse']['mean_95'], '.4f')} (std "
            f"{seeds['rmse']['std']:.4f}), mean accuracy "
            f"{figure(seeds['accuracy']['mean'], seeds['accuracy']['mean_95'], '.2%')}"
        )
    if "kr_ablation" in chosen or "ku_ablation" in chosen:
        default = run_fedrecon(data, split, options.better, rounds, models, workers)
        if "kr_ablation" in chosen:
            report["kr_ablation"] = run_ablation(data, split, options, models, log, default)
        if "ku_ablation" in chosen:
            report["ku_ablation"] = run_ablation(data, split, options, models, log, default, update=True)
    if "staleness" in chosen:
        report["staleness"] = run_staleness(
            data.examples,
            split,
            options.staleness,
            models.get(whole_user_model(data.num_items)),
            workers,
            FAITHFUL.task,
            FURL.task,
            FAITHFUL.server,
            log,
        )
    if "dp_fedrecon" in chosen:
        report["dp_fedrecon"] = run_dp(data, split, options, models, log)
    if "secure_fedrecon" in chosen:
        report["secure_fedrecon"] = run_secure(data, split, options, models, log, results.get("fedrecon"))
    for source in ("movielens", "expressions"):
        if f"implicit_{source}" in chosen:
            fleet = (
                movielens_shares(options.ratings)
                if source == "movielens"
                else expression_fleet(SyntheticConfig())
            )
            found = run_implicit(source, fleet, rounds, models, workers)
            mine, popular, lift = found["fedrecon"], found["global_popularity"], found["lift"]
            hr, ndcg, gap = "hit_rate@10", "ndcg@10", lift["difference"]
            log(
                f"implicit {source:<19} HR@10 {figure(mine[hr], mine[f'{hr}_95'], '.2%')} vs "
                f"{figure(popular[hr], popular[f'{hr}_95'], '.2%')} global popularity (lift "
                f"{figure(lift[hr], lift.get(f'{hr}_95'), '+.1%')}); NDCG@10 "
                f"{figure(mine[ndcg], mine[f'{ndcg}_95'], '.4f')} vs "
                f"{figure(popular[ndcg], popular[f'{ndcg}_95'], '.4f')} (lift "
                f"{figure(lift[ndcg], lift.get(f'{ndcg}_95'), '+.1%')}); minus popularity: HR@10 "
                f"{figure(gap[hr], gap.get(f'{hr}_95'), '+.2%')}, NDCG@10 "
                f"{figure(gap[ndcg], gap.get(f'{ndcg}_95'), '+.4f')}; {found['devices_scored']} devices; "
                "95% over the devices; popularity is the floor, no ceiling is trained"
            )
            report.setdefault("implicit", {})[source] = found
    if results:
        log(quality_table(results))
    report["targets"] = check_targets(report, results)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["methods"] = {name: r.to_json() for name, r in results.items()}
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "quality.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_curves(options.out / "learning_curves.png", list(results.values()))
    if "staleness" in report:
        plot_staleness(options.out / "staleness.png", report["staleness"])
    return report


def run_ablation(
    data: Dataset,
    split: UserSplit,
    options: QualityOptions,
    models: ModelCache,
    log: Callable[[str], None],
    default: MethodResult,
    *,
    update: bool = False,
) -> dict[str, Any]:
    """The paper's Figure 3: test accuracy with at most `k_r` reconstruction steps (in training and
    evaluation), or at most `k_u` update steps (`update`), relative to the configuration's own
    bounds (150 and 100 steps for "better"); `default` is the run with those bounds."""
    base = options.better
    name, field_name, steps_tried = (
        ("k_u", "update_max_steps", UPDATE_ABLATION_STEPS)
        if update
        else ("k_r", "reconstruction_max_steps", ABLATION_STEPS)
    )
    rows = []
    for steps in steps_tried:
        task = TaskConfig.from_json({**base.task.to_json(), field_name: steps})
        settings = replace(base, task=task)
        result = run_fedrecon(data, split, settings, options.rounds, models, options.workers)
        relative = result.test["accuracy"] / default.test["accuracy"]
        # The same test users score both runs: resampled together (a paired interval).
        relative_95 = paired_interval(result.per_user, default.per_user, "accuracy", np.divide)
        log(
            f"  {name} = {steps:>2}: RMSE {shown(result.test, result.intervals, 'rmse')}, accuracy "
            f"{shown(result.test, result.intervals, 'accuracy')} ({figure(relative, relative_95, '.3f')} "
            "of the default)"
        )
        rows.append(
            {
                name: steps,
                **result.test,
                "intervals": result.intervals,
                "relative_accuracy": relative,
                "relative_accuracy_95": relative_95,
            }
        )
    log(
        f"  {name} = {getattr(base.task, field_name)} (the default): RMSE "
        f"{shown(default.test, default.intervals, 'rmse')}, accuracy "
        f"{shown(default.test, default.intervals, 'accuracy')}"
    )
    return {
        "settings": base.to_json(),
        "default": {name: getattr(base.task, field_name), **default.test, "intervals": default.intervals},
        "runs": rows,
    }


def run_dp(
    data: Dataset, split: UserSplit, options: QualityOptions, models: ModelCache, log: Callable[[str], None]
) -> dict[str, Any]:
    """DP-FedAvg on the protocol's FedRecon at each noise multiplier: test RMSE and accuracy against
    epsilon at delta 1e-5, with the training users as the whole population (sampling rate clients
    per round / 754), and the population that would give epsilon <= 5 with the same noise, clients
    per round and rounds (the noise on the mean, hence the quality, depends on those alone)."""
    population = len(split.train)
    per_round = min(options.rounds.clients_per_round, population)
    rows = []
    for z in options.dp_noise_multipliers:
        dp = DPConfig(options.dp_clip_norm, z, population, DP_DELTA)
        result = run_fedrecon(data, split, FAITHFUL, options.rounds, models, options.workers, "dp", dp)
        eps = epsilon(z, per_round / population, options.rounds.rounds, DP_DELTA)
        needed: int | None = None  # None: no finite population (no noise, or beyond 2^50 devices)
        if z > 0:
            with contextlib.suppress(ValueError):
                needed = population_size_for(DP_TARGET_EPSILON, z, per_round, options.rounds.rounds, DP_DELTA)
        log(
            f"  DP noise {z:g}, clip {options.dp_clip_norm:g}: RMSE "
            f"{shown(result.test, result.intervals, 'rmse')}, accuracy "
            f"{shown(result.test, result.intervals, 'accuracy')}, epsilon {eps:.4g} at {population} "
            "devices; epsilon "
            f"<= {DP_TARGET_EPSILON:g} needs {needed or 'no realistic number of'} devices "
            f"({result.seconds:.0f} s)"
        )
        rows.append(
            {
                "noise_multiplier": z,
                **result.test,
                "intervals": result.intervals,
                "epsilon": eps if math.isfinite(eps) else None,  # None: no noise, no guarantee
                "population_size_for_epsilon_5": needed,
                "seconds": round(result.seconds, 1),
                "validation_curve": result.curve,
            }
        )
    return {
        "settings": FAITHFUL.to_json(),
        "clip_norm": options.dp_clip_norm,
        "delta": DP_DELTA,
        "population_size": population,
        "clients_per_round": per_round,
        "rounds": options.rounds.rounds,
        "runs": rows,
    }


def run_secure(
    data: Dataset,
    split: UserSplit,
    options: QualityOptions,
    models: ModelCache,
    log: Callable[[str], None],
    weighted: MethodResult | None,
) -> dict[str, Any]:
    """The protocol's FedRecon under secure aggregation without noise, against plaintext with the
    same uniform weights and clip norm (the difference is quantization alone) and against the
    protocol's example-weighted plaintext (`weighted`, run here unless given). The clip norm is
    the DP one (a population's secure clip norm follows its DP clip norm)."""
    rounds, workers = options.rounds, options.workers
    per_round = min(rounds.clients_per_round, len(split.train))
    clip = options.dp_clip_norm
    secure = SecureQuantization(clip, options.secure_bits, math.ceil(per_round * SECURE_OVERSAMPLING))
    if weighted is None:
        weighted = run_fedrecon(data, split, FAITHFUL, rounds, models, workers)
    uniform_dp = DPConfig(clip, 0.0, len(split.train), DP_DELTA)  # no noise: clipping, uniform weights
    uniform = run_fedrecon(data, split, FAITHFUL, rounds, models, workers, "uniform", uniform_dp)
    quantized = run_fedrecon(data, split, FAITHFUL, rounds, models, workers, "secure", secure=secure)
    runs = {"plaintext_weighted": weighted, "plaintext_uniform": uniform, "secure_quantized": quantized}
    for name, result in runs.items():
        log(
            f"  {name:<20} RMSE {shown(result.test, result.intervals, 'rmse')}, accuracy "
            f"{shown(result.test, result.intervals, 'accuracy')} ({result.seconds:.0f} s)"
        )

    def difference(a: MethodResult, b: MethodResult) -> dict[str, Any]:
        """a - b, with the paired interval (the same test users resampled in both runs)."""
        keys = ("rmse", "accuracy")
        return {
            **{key: a.test[key] - b.test[key] for key in keys},
            "intervals": {key: paired_interval(a.per_user, b.per_user, key, np.subtract) for key in keys},
        }

    levels = secure.parameters(vector_length=1).levels  # levels do not depend on the length
    return {
        "settings": FAITHFUL.to_json(),
        "clip_norm": clip,
        "bits": secure.bits,
        "max_summands": secure.max_summands,
        "quantization_step": clip / levels,
        "runs": {
            name: {
                **result.test,
                "intervals": result.intervals,
                "seconds": round(result.seconds, 1),
                "validation_curve": result.curve,
            }
            for name, result in runs.items()
        },
        "quantization": difference(quantized, uniform),
        "uniform_weights_and_clipping": difference(uniform, weighted),
        "secure_vs_weighted_plaintext": difference(quantized, weighted),
    }
