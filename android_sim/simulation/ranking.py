"""`simulate` judges a ranking model by what it is for: held-out devices' top-10s on their newest shares.

A held-out device (the user's `--held-out` list, or drawn by the split seed) keeps its newest
fifth of shares aside, trains nothing and, after training, serves as a phone does: its own
example store, the trained globals, its locals reconstructed on it (`recommendations.score_held_out`,
the fleet's own scoring), ranked in the context of its first kept-aside share. Beside it: the
same model without locals in that context (global), most-shared, and the ceilings the table
gives (item co-occurrence, the centralized MF, the group rule over `--item-groups`), each with
its hit rate@10 and NDCG@10 and the model's paired difference (`android_sim.hit_rates`).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from rich import box
from rich.table import Table

from android_sim.hit_rates import Evaluation
from android_sim.intervals import Interval
from android_sim.recommendations import METHODS, HitRates, score_held_out
from android_sim.run import future_count, write_store
from android_sim.simulation.protocol import UserSplit, split_users
from android_sim.workload import Workload, split_newest
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import LocalState, TaskConfig
from device_runtime.examples_table import DeviceExamples, store_path
from model_runtime.tflite_model import TFLiteModel


def read_held_out(path: Path, device_ids: Sequence[str]) -> set[int]:
    """The indices of the devices `path` names, one device id a line (blank lines ignored)."""
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --held-out {path}: {e}") from None
    index = {d: i for i, d in enumerate(device_ids)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ValueError(
            f"--held-out {path}: {len(unknown)} device ids not in the examples (with enough examples), "
            f"e.g. {unknown[0]!r}; expected one device id of the table a line"
        )
    if not names:
        raise ValueError(f"--held-out {path} names no device; expected one device id a line")
    return {index[n] for n in names}


def read_item_groups(path: Path, manifest: Manifest) -> np.ndarray:
    """Each catalog row's group from a CSV of two columns (the catalog feature, its group)."""
    size = manifest.catalog_size
    groups = np.full(size, -1, np.int64)
    try:
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --item-groups {path}: {e}") from None
    for line, row in enumerate(rows[1:], 2):
        try:
            item, group = int(row[0]), int(row[1])
        except (IndexError, ValueError):
            raise ValueError(
                f"--item-groups {path}, line {line}: expected two integers (catalog row, group), got {row!r}"
            ) from None
        if not 0 <= item < size or group < 0:
            raise ValueError(
                f"--item-groups {path}, line {line}: catalog row {item} must be in [0, {size}) and "
                f"group {group} >= 0"
            )
        groups[item] = group
    if (groups < 0).any():
        raise ValueError(
            f"--item-groups {path}: no group for {int((groups < 0).sum())} of the {size} catalog rows, "
            f"e.g. row {int(np.flatnonzero(groups < 0)[0])}"
        )
    return groups


def ranking_split(count: int, held_out: set[int] | None, seed: int) -> UserSplit:
    """80/10/10 (`split_users`), or the named held-out devices and the rest 8:1 into training and
    validation, shuffled by `seed`."""
    if held_out is None:
        return split_users(count, seed)
    rest = [i for i in np.random.RandomState(seed).permutation(count).tolist() if i not in held_out]
    validation = max(1, round(len(rest) / 9))
    if len(rest) - validation < 1:
        raise ValueError(f"--held-out leaves {len(rest)} devices: too few to train and validate on")
    return UserSplit(rest[validation:], rest[:validation], sorted(held_out))


@dataclass(frozen=True)
class Held:
    """A held-out device as `score_held_out` reads it: its index, store and examples stored."""

    index: int
    store_path: Path
    num_examples: int


def keep_future(
    devices: list[DeviceExamples], test: Sequence[int]
) -> tuple[list[DeviceExamples], dict[int, Examples]]:
    """The devices with each held-out one's newest fifth of shares set aside (`run.future_count`)."""
    past = list(devices)
    future: dict[int, Examples] = {}
    for i in test:
        count = future_count(devices[i].examples.num_examples)
        if count:
            past[i], future[i] = split_newest(devices[i], count)
    return past, future


def score(
    workload: Workload,
    devices: list[DeviceExamples],
    split: UserSplit,
    future: dict[int, Examples],
    params: Params,
    task: TaskConfig,
    store_dir: Path,
    item_groups: np.ndarray | None,
    ceilings: bool = True,
) -> HitRates | None:
    """The held-out devices' top-10s from their own stores (written to `store_dir`), scored
    (with the ceilings unless not `ceilings`)."""
    model = TFLiteModel(workload.model_dir)
    scored_on = replace(workload, devices=devices)
    held = []
    store_dir.mkdir(parents=True, exist_ok=True)
    for i in split.test:
        path = store_path(store_dir, devices[i].device_id)
        write_store(path, devices[i], scored_on)
        held.append(Held(i, path, devices[i].examples.num_examples))
    found, _ = score_held_out(
        model, params, "simulated", held, future, scored_on, split.train, 0, task, None, item_groups, ceilings
    )
    return found


def model_label(manifest: Manifest, task: TaskConfig) -> str:
    """What ran, for the model's row: FedRecon, FURL (held-out devices reconstruct) or no locals."""
    if not manifest.local_params:
        return "the model (no locals)"
    if task.local_state is LocalState.KEEP:
        return "FURL (reconstructed)"
    return "FedRecon"


def labels(evaluation: Evaluation, manifest: Manifest, task: TaskConfig) -> dict[str, str]:
    names = {**METHODS, "personalized": model_label(manifest, task), "global": "global (no locals)"}
    return {m: names[m] for m in evaluation.methods}


def ranking_table(hit_rates: HitRates, manifest: Manifest, task: TaskConfig) -> Table:
    """Each method's hit rate@10 and NDCG@10 on the newest shares, and the model's paired difference."""
    e = hit_rates.evaluation
    names = labels(e, manifest, task)
    model = names["personalized"]
    table = Table(
        title=f"held-out devices' newest shares ({e.devices_with_future} devices), in % [{e.interval}]",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption=_caption(hit_rates),
        caption_justify="left",
    )
    table.add_column("top-10", no_wrap=True)
    table.add_column("hit rate@10", justify="right", overflow="fold")
    table.add_column(f"{model} minus", justify="right", overflow="fold")
    table.add_column("NDCG@10", justify="right", overflow="fold")
    table.add_column(f"{model} minus", justify="right", overflow="fold")
    for method, found in e.methods.items():
        if method == "global" and not manifest.local_params:
            continue  # the model itself
        diff = e.differences.get(method, {})
        table.add_row(
            names[method],
            cell(found.newest),
            cell(diff.get("newest"), "+"),
            cell(found.ndcg),
            cell(diff.get("ndcg"), "+"),
        )
    return table


def _caption(hit_rates: HitRates) -> str:
    """The starred rows' footnote: the generator's rows (built-in synthetic data) are said apart."""
    caption = "* ceilings: they see every training device's shares on one server"
    truth = [METHODS[m].rstrip(" *") for m in ("bayes", "oracle") if m in hit_rates.evaluation.methods]
    if truth:
        caption += f"; {' and '.join(truth)}: the data generator's truth"
    if hit_rates.bayes is not None and "bayes" in hit_rates.evaluation.methods:
        ess = hit_rates.bayes.ess
        caption += f" (Bayes's effective sample size min {ess.min():,.0f}, median {np.median(ess):,.0f})"
    return caption


def cell(figure: Interval | None, sign: str = "") -> str:
    if figure is None:
        return "-"
    return f"{100 * figure.value:{sign}.1f} [{100 * figure.low:{sign}.1f},{100 * figure.high:{sign}.1f}]"


def summary(hit_rates: HitRates, manifest: Manifest, task: TaskConfig) -> dict[str, object]:
    """simulation.json's "ranking": each method's figures and the model's paired differences."""
    e = hit_rates.evaluation

    def figures(found: Interval | None) -> dict[str, float] | None:
        return None if found is None else {"value": found.value, "low": found.low, "high": found.high}

    return {
        "evaluated_on": "held-out devices' newest fifth of shares (at least one), at the first one's context",
        "interval": e.interval,
        "devices": e.devices_with_future,
        "labels": labels(e, manifest, task),
        "methods": {
            m: {"hit_rate_at_10": figures(s.newest), "ndcg_at_10": figures(s.ndcg)}
            for m, s in e.methods.items()
        },
        "model_minus": {
            m: {"hit_rate_at_10": figures(d.get("newest")), "ndcg_at_10": figures(d.get("ndcg"))}
            for m, d in e.differences.items()
        },
        "bayes_ceiling": None if hit_rates.bayes is None else hit_rates.bayes.to_json(),
    }
