"""`simulate` for a classification or regression model with locals: its held-out figures beside
the same model without locals and the label baselines (`label_baselines`), paired.

The baseline is the trained globals with the initial (exported) locals, i.e. ReconEval with no
reconstruction step: what a device with no data of its own gets. Both are measured on the same
held-out devices' query examples, and their difference in each metric (accuracy, RMSE, the loss)
gets a paired 95% interval from one set of bootstrap resamples over the devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich import box
from rich.table import Table

from android_sim.intervals import INTERVAL, resample_rows
from android_sim.simulation.label_baselines import label_baselines
from android_sim.simulation.protocol import UserSplit
from android_sim.simulation.simulate import SimulationOptions, simulation_clients
from contracts.features import Examples
from contracts.manifest import load_manifest
from contracts.params import Params
from model_runtime.tflite_model import EvaluationSums

# A metric's sum in the evaluation -> its name as printed, and whether it is a root (RMSE).
SHOWN = {"loss": ("loss", False), "correct": ("accuracy", False), "squared_error": ("rmse", True)}


def held_out_sums(
    model_dir: Path,
    devices: Sequence[Examples],
    options: SimulationOptions,
    params: Params,
    test: Sequence[int],
) -> list[EvaluationSums]:
    """Each held-out device's evaluation sums with the globals `params`, as `options` measure
    them (the simulation's: ReconEval)."""
    pool = simulation_clients(model_dir, devices, options)
    try:
        pool.set_global(params)
        return list(pool.map("evaluation", test))
    finally:
        pool.close()


def without_locals(options: SimulationOptions) -> SimulationOptions:
    """The baseline's options: no reconstruction step, so the initial locals are measured."""
    return replace(options, task=replace(options.task, reconstruction_max_steps=0))


def compare(
    mine: Sequence[EvaluationSums], baseline: Sequence[EvaluationSums], seed: int = 0
) -> dict[str, dict[str, float]]:
    """Per metric: the model's figure, the baseline's, and the paired difference with its interval."""
    rows = resample_rows(len(mine), np.random.default_rng(seed))
    out: dict[str, dict[str, float]] = {}
    for key, (name, root) in SHOWN.items():
        if f"{key}_sum" not in mine[0].sums or f"{key}_sum" not in baseline[0].sums:
            continue

        def ratio(
            sums: Sequence[EvaluationSums], picked: np.ndarray | slice, key: str = key, root: bool = root
        ) -> np.ndarray:
            top = np.array([s.sums.get(f"{key}_sum", 0.0) for s in sums])[picked]
            weight = np.array([s.weight_sum for s in sums])[picked]
            value = np.asarray(top.sum(axis=-1) / np.maximum(weight.sum(axis=-1), 1e-12))
            return np.asarray(np.sqrt(value)) if root else value

        difference = ratio(mine, rows) - ratio(baseline, rows)
        low, high = np.percentile(difference, [2.5, 97.5])
        out[name] = {
            "model": float(ratio(mine, slice(None))),
            "without_locals": float(ratio(baseline, slice(None))),
            "difference": float(ratio(mine, slice(None)) - ratio(baseline, slice(None))),
            "difference_low": float(low),
            "difference_high": float(high),
        }
    return out


def prediction_table(
    found: dict[str, dict[str, float]], devices: int, baselines: dict[str, dict[str, dict[str, float]]]
) -> Table:
    """The model's held-out figures beside the model without locals and the label baselines, paired."""
    table = Table(
        title=f"held-out devices ({devices}), ReconEval against the model without locals and the "
        f"baselines [{INTERVAL}]",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for column in ("metric", "FedRecon", "against", "its figure", "FedRecon minus"):
        table.add_column(
            column, justify="right" if column in ("FedRecon", "its figure") else "left", no_wrap=True
        )
    against = {"global (no locals)": found, **baselines}
    for name in found:
        for label, comparison in against.items():
            f = comparison.get(name)
            if f is None:
                continue
            table.add_row(
                name,
                f"{f['model']:.4f}",
                label,
                f"{f['without_locals']:.4f}",
                f"{f['difference']:+.4f} [{f['difference_low']:+.4f}, {f['difference_high']:+.4f}]",
            )
    return table


def judge(
    model_dir: Path, devices: Sequence[Examples], options: SimulationOptions, params: Params, split: UserSplit
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict[str, float]]]]:
    """The model's held-out figures against the same model without locals, and against each label
    baseline (`label_baselines`: the comparison's "without_locals" is the baseline's figure), paired."""
    mine = held_out_sums(model_dir, devices, options, params, split.test)
    manifest = load_manifest(model_dir)
    baselines = label_baselines(devices, split.train, split.test, manifest, options.task)
    return (
        compare(mine, held_out_sums(model_dir, devices, without_locals(options), params, split.test)),
        {name: compare(mine, sums) for name, sums in baselines.items()},
    )
