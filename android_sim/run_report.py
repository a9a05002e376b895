"""The run report, whatever the model: report.json, the plots, and the summary it prints.

The metrics are the model's own (its `evaluate`'s, as the evaluation rounds aggregated them); a
ranking model's report adds its held-out hit rates and a few devices' top-k tables."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from android_sim import report
from android_sim.fleet import Fleet
from android_sim.hit_rates import HISTORY_BUCKETS
from android_sim.intervals import Interval
from android_sim.recommendations import METHODS, HitRates, top_k_table
from android_sim.run_config import RunConfig, RunResult
from android_sim.workload import Workload
from contracts.manifest import Manifest


def write_report(
    config: RunConfig,
    mixing: dict[str, Any] | None,
    workload: Workload,
    fleet: Fleet,
    status: dict[str, Any],
    rounds: list[dict[str, Any]],
    final: dict[str, Any] | None,
    served: Any,
    started: float,
    console: Console,
) -> RunResult:
    """`served`: what the data's own report served (`workload.report`), else a ranking model's
    (hit rates, top-k examples), else nothing."""
    hit_rates, examples = (None, []) if workload.report is not None or served is None else served
    work = config.work_dir
    plots = [work / "metrics.png", work / "funnel.png"]
    if workload.report is not None:
        workload.report.plot(plots[0], rounds)
    else:
        report.plot_metrics(plots[0], rounds, primary_metric(workload.manifest))
    report.plot_funnel(plots[1], rounds)
    training = [r for r in rounds if r["kind"] == "training" and r["status"] == "committed"]
    seconds = time.monotonic() - started
    header = report_header(config, status, fleet, _evaluation_name(config, workload.manifest))
    body = {
        "config": header.pop("config"),
        "data": {
            "source": workload.source,
            "devices": len(workload.devices),
            "examples": workload.num_examples,
        },
        "model": model_summary(workload.manifest),
        **header,
        "mixing": _mixing_summary(mixing, fleet),
        "rounds": rounds,
        "final_evaluation": final,
        "hit_rates": hit_rates.to_json() if hit_rates else None,
        "recommendations": examples,
        "seconds": seconds,
    }
    if workload.report is not None:
        section = workload.report.section(served, fleet, rounds, final)
        body = {**body, **section, "data": {**body["data"], **section.get("data", {})}}
    report_path = work / "report.json"
    report.write_json(report_path, body)
    result = RunResult(
        report_path, plots, len(training), (final or {}).get("metrics", {}), hit_rates, seconds, body
    )
    _print_summary(result, config, workload, examples, console)
    privacy = status.get("privacy")
    if privacy:
        console.print(f"differential privacy: {privacy['message']}")
    mixed = cast(dict[str, Any] | None, body["mixing"])
    if mixed:
        extra, count = mixed["central_bytes_per_assignment"], mixed["assignments_with_central_download"]
        console.print(
            f"mixing {mixed['mixing']['strategy']}: {extra:,.0f} extra bytes per training assignment "
            f"(median over {count})"
        )
    return result


def primary_metric(manifest: Manifest) -> str:
    """The metric a run's curves show: RMSE for a model of explicit values, else the loss."""
    has_rmse = any(m.name == "squared_error" for m in manifest.metrics)
    return "rmse" if has_rmse and not manifest.task.negative_sampling else "loss"


def model_summary(manifest: Manifest) -> dict[str, Any]:
    """What the report says of the model: its task, features, parameters (by name) and metrics."""
    return {
        "sha256": manifest.model_sha256,
        "task": manifest.task.to_json(),
        "features": [f.to_json() for f in manifest.features],
        "global_params": [p.name for p in manifest.global_params],
        "local_params": [p.name for p in manifest.local_params],
        "metrics": [m.name for m in manifest.metrics],
        "config": manifest.config,
    }


def shown_metrics(manifest: Manifest) -> list[str]:
    """The model's metrics by name: the loss, then each of its own (RMSE for a squared error,
    accuracy for a `correct`)."""
    named = {"squared_error": "rmse", "correct": "accuracy"}
    return ["loss", *(named.get(m.name, m.name) for m in manifest.metrics)]


def _mixing_summary(mixing: dict[str, Any] | None, fleet: Fleet) -> dict[str, Any] | None:
    """The mixing strategy, its dataset, and the extra bytes each training assignment downloaded."""
    if mixing is None:
        return None
    sizes = fleet.stats.central_bytes
    return {
        **mixing,
        "assignments_with_central_download": len(sizes),
        "central_bytes_per_assignment": float(np.median(sizes)) if sizes else 0.0,
        "central_bytes_total": int(sum(sizes)),
    }


def report_header(config: RunConfig, status: dict[str, Any], fleet: Fleet, evaluation: str) -> dict[str, Any]:
    """What every run's report starts with, whatever the model: the configuration, the population,
    the fleet's counters and the algorithm (`evaluation` names how the model was evaluated)."""
    classes: dict[str, int] = {}
    for device in fleet.devices:
        classes[device.profile.device_class.name] = classes.get(device.profile.device_class.name, 0) + 1
    return {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(config).items()
            if k != "admin_token"  # a secret; never in a report
        },
        "population": {
            k: status[k] for k in ("name", "current_version", "training_rounds_committed", "artifact_sha256")
        },
        "privacy": status.get("privacy"),
        "fleet": {
            "device_classes": classes,
            "device_side_outcomes": {
                f"{role}/{s}": n for (role, s), n in sorted(fleet.stats.outcomes.items())
            },
            # The ten commonest reasons, most frequent first.
            "left_because": [
                {"status": status, "reason": why, "count": n}
                for (status, why), n in fleet.stats.left_because.most_common(10)
            ],
            "median_task_seconds": float(np.median(fleet.stats.task_seconds))
            if fleet.stats.task_seconds
            else None,
            "switched_off": fleet.stats.switched_off,
            "checkins_timed": sum(fleet.stats.checkin_ms.values()),
            "checkin_p50_ms": fleet.stats.checkin_percentile(50),
            "checkin_p99_ms": fleet.stats.checkin_percentile(99),
            "event_loop_lag_p50_ms": fleet.stats.loop_lag_percentile(50),
            "event_loop_lag_p99_ms": fleet.stats.loop_lag_percentile(99),
        },
        "algorithm": {
            "local_state": status["settings"]["task_config"]["local_state"],
            "evaluation": evaluation,
            "task_config": status["settings"]["task_config"],
            "server_optimizer": status["settings"]["server_optimizer"],
        },
    }


def with_interval(final: dict[str, float], name: str) -> str:
    """`accuracy 0.9081 [0.8990, 0.9172]`, or the bare figure when there is no interval."""
    low, high = final.get(f"{name}_low"), final.get(f"{name}_high")
    interval = f" [{low:.4f}, {high:.4f}]" if low is not None and high is not None else ""
    return f"{name} {final[name]:.4f}{interval}"


def _evaluation_name(config: RunConfig, manifest: Manifest) -> str:
    if config.stateful:
        return "StandardEval on seen devices (their kept locals, on their newest 10% of examples)"
    if not manifest.local_params:
        return "evaluation on held-out devices (no local parameters to reconstruct)"
    return "ReconEval on held-out devices"


def _print_summary(
    result: RunResult,
    config: RunConfig,
    workload: Workload,
    examples: list[dict[str, Any]],
    console: Console,
) -> None:
    rounds = f"{result.rounds_committed} training round{'' if result.rounds_committed == 1 else 's'}"
    console.print(f"\n[bold]{rounds} committed in {result.seconds:.0f} s[/]")
    left = result.summary["fleet"]["left_because"][:3]
    if left:
        console.print(
            "participations that ended short of a report, commonest first (report.json: "
            "fleet.left_because): " + "; ".join(f"{e['count']} {e['status']}, {e['reason']}" for e in left)
        )
    algorithm = result.summary["algorithm"]
    console.print(
        f"local parameters: {algorithm['local_state']} "
        f"(local learning rate {algorithm['task_config']['local_learning_rate']}); "
        f"server optimizer {algorithm['server_optimizer']['name']} "
        f"{algorithm['server_optimizer']['learning_rate']}"
    )
    final = result.final_evaluation
    if workload.report is not None:
        workload.report.print(result.summary, console)
    elif final:
        shown = ", ".join(with_interval(final, k) for k in shown_metrics(workload.manifest) if k in final)
        name = _evaluation_name(config, workload.manifest)
        groups = final.get("interval_groups")
        spread = (
            f"; 95% intervals from {groups:.0f} groups of devices"
            if groups
            else "; no interval: too few devices for two groups of the evaluation's floor"
        )
        console.print(f"final {name}: {shown} (weight {final.get('weight_sum', 0):.0f}{spread})")
    else:
        console.print(
            "final evaluation: none released (fewer held-out devices than its floor reported in time, "
            "or the privacy budget is spent)"
        )
    if result.hit_rates:
        console.print(hit_rate_table(result.hit_rates))
        console.print(history_table(result.hit_rates))
    for example in examples:
        table = top_k_table(example, workload.label)
        console.print(table)
    console.print(f"report: {result.report_path}")
    console.print("plots: " + ", ".join(str(p) for p in result.plots))


CEILINGS = "* ceilings: the rules and the centralized MF see every share; the oracle, the generator's truth"


def hit_rate_table(hit_rates: HitRates) -> Table:
    """Every method's held-out hit rate@10 with its interval; the model's paired difference to each.
    The expected hit rate (and the oracle's part of the footnote) only where a generator's truth
    exists: a user's table has its newest shares and nothing else."""
    e, label = hit_rates.evaluation, hit_rates.model_label
    truth = any(score.expected is not None for score in e.methods.values())
    kind = hit_rates.headline
    if truth:
        title = (
            f"held-out hit rate@10 in % [{e.interval}]: expected (the true probability mass in "
            f"the top-10; {e.devices} devices), over the newest shares ({e.devices_with_future} devices), "
            f"and {label}'s paired difference in the expected one"
        )
    else:
        title = (
            f"held-out hit rate@10 in % [{e.interval}] over each device's newest shares "
            f"({e.devices_with_future} devices), and {label}'s paired difference"
        )
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption=_ceilings_caption(hit_rates, truth),  # the footnote only under rows it explains
        caption_justify="left",
    )
    table.add_column("top-10", no_wrap=True)
    if truth:
        table.add_column("expected", justify="right", overflow="fold")
    table.add_column("newest shares", justify="right", overflow="fold")
    table.add_column(f"{label} minus", justify="right", overflow="fold")
    for method, score in e.methods.items():
        diff = _cell(e.differences.get(method, {}).get(kind), "+")
        cells = [_cell(score.expected)] if truth else []
        table.add_row(_method_name(method, label), *cells, _cell(score.newest), diff)
    return table


def _method_name(method: str, model_label: str) -> str:
    return model_label if method == "personalized" else METHODS[method]


def _ceilings_caption(hit_rates: HitRates, truth: bool) -> str | None:
    """The footnote of the starred rows, when there are any (the oracle's part only with a truth;
    the Bayes ceiling's, with how well it was estimated, when it was)."""
    methods = hit_rates.evaluation.methods
    if not any(METHODS[m].endswith("*") for m in methods):
        return None
    if not truth:
        return "* ceilings: the rules and the centralized MF see every share"
    bayes = hit_rates.bayes
    if bayes is None or "bayes" not in methods:
        return CEILINGS
    return (
        f"{CEILINGS};\n  Bayes, the best top-10 from the history alone: the posterior predictive under the "
        f"generator's prior and items, by importance sampling (effective sample size min "
        f"{bayes.ess.min():,.0f}, median {np.median(bayes.ess):,.0f} over {len(bayes.ess)} devices)"
    )


def history_table(hit_rates: HitRates) -> Table:
    """The hit rates by the examples a held-out device holds (its reconstruction's data)."""
    e = hit_rates.evaluation
    kind = hit_rates.headline
    table = Table(
        title=f"{kind} hit rate@10 in % by the examples a held-out device holds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("top-10", no_wrap=True)
    first = e.methods["personalized"].by_history
    for bucket in HISTORY_BUCKETS:
        found = first[bucket][kind]
        devices = found.devices if found else 0
        table.add_column(f"{bucket} ({devices} devices)", justify="right", overflow="fold")
    for method, score in e.methods.items():
        table.add_row(
            _method_name(method, hit_rates.model_label),
            *(_cell(score.by_history[b][kind]) for b in HISTORY_BUCKETS),
        )
    return table


def _cell(figure: Interval | None, sign: str = "") -> str:
    """A figure in percentage points with its interval, e.g. `25.9 [24.1,27.8]`."""
    if figure is None:
        return "-"
    return f"{100 * figure.value:{sign}.1f} [{100 * figure.low:{sign}.1f},{100 * figure.high:{sign}.1f}]"
