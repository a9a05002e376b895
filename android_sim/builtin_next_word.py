"""Tiny Shakespeare as a workload: next-word prediction (NWP) on the generic fleet run.

Each speaking role is a phone whose examples are its windows of tokens (`android_sim.shakespeare`);
the roles of the protocol's training split train, those of its test split are the held-out
devices (they never train; the validation roles take no part). The model is the benchmark's
(`android_sim.next_word`): an LSTM whose `--oov-buckets` OOV rows are local, so a device's rare
words never leave it.

The report adds next-word accuracy on the held-out roles without OOV (OOV targets do not
count, predicting a bucket is wrong) and with OOV (predicting the target's bucket is right),
as the Federated Reconstruction paper's Table 2: from the evaluation rounds (the devices that
reported in time, aggregated by the server), and, after the last round, from every held-out
device evaluating the final model on itself (ReconEval by the same client task). Bytes per
round per device: the parameters a task downloads and uploads, and what the devices' links
carried per reported task (check-ins, parameters, reports, retries).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from android_sim import report
from android_sim.fleet import HELD_OUT, TRAINING, Fleet
from android_sim.intervals import bootstrap_ratio, resample_rows
from android_sim.next_word import (
    MIN_ROLE_EXAMPLES,
    SERVER,
    TASK,
    accuracies,
    model_args,
    parameter_bytes_per_round,
)
from android_sim.next_word import export as export_model
from android_sim.run_config import SHAKESPEARE, RunConfig, RunError
from android_sim.shakespeare import PAD, NextWordData, Vocabulary, next_word_data, read_roles
from android_sim.workload import Workload
from contracts.features import Examples
from contracts.manifest import Manifest, load_manifest
from contracts.params import decode_params
from contracts.task_config import TaskConfig
from device_runtime.client_task import Outcome, Task, run_evaluation_task
from device_runtime.example_store import ExampleStore
from device_runtime.examples_table import DeviceExamples
from device_runtime.task_environment import Environment
from device_runtime.task_examples import prepare
from model_runtime.support_query import reconstruct_locals
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import TFLiteModel

# Reports per round when the run's options do not say (`--target-reports`): the 142 training roles
# are far fewer phones than the recommender's 1,000, and about a third are eligible at a time.
TARGET_REPORTS = 10
EXAMPLE_PREDICTIONS = 3  # predictions shown per held-out device in the summary


def load_data(config: RunConfig) -> NextWordData:
    """The roles, the protocol's split and the training roles' vocabulary."""
    try:
        return next_word_data(
            read_roles(config.shakespeare),
            config.vocab_size,
            config.oov_buckets,
            config.seq_len,
            MIN_ROLE_EXAMPLES,
        )
    except ValueError as e:
        raise RunError(f"shakespeare: {e}") from None


def export(config: RunConfig, data: NextWordData) -> Path:
    """The benchmark's model for this vocabulary and window, with the run's further builder arguments."""
    args = model_args(data.vocabulary, data.seq_len, **config.model_args)
    try:
        return export_model(config.work_dir / "model", args)
    except RuntimeError as e:
        raise RunError(str(e)) from None


def check_model(manifest: Manifest, data: NextWordData) -> None:
    """The export takes the data's windows: `tokens` and `targets` of the vocabulary's ids."""
    for name in ("tokens", "targets"):
        feature = manifest.feature(name)
        if feature.shape != (data.seq_len,) or feature.value_range != (0, data.vocabulary.num_tokens - 1):
            raise RunError(
                f"the exported model's {name!r} is {feature.to_json()}; the data has windows of "
                f"{data.seq_len} ids in [0, {data.vocabulary.num_tokens - 1}]"
            )


@dataclass(frozen=True)
class HeldOutAccuracy:
    """Every held-out device's ReconEval of the final model, on the device, summed."""

    devices: int  # that evaluated (the others had too few examples)
    tokens: float
    in_vocab_tokens: float
    accuracy_without_oov: float
    accuracy_with_oov: float
    loss: float  # the mean over windows of a window's mean cross-entropy
    # 95% intervals over the devices (`android_sim.intervals`).
    interval_without_oov: tuple[float, float] = (math.nan, math.nan)
    interval_with_oov: tuple[float, float] = (math.nan, math.nan)


@dataclass(frozen=True)
class Prediction:
    device: int
    context: list[str]
    predicted: list[str]  # best first
    actual: str


async def evaluate_held_out(
    fleet: Fleet, population: str, status: dict[str, Any], vocabulary: Vocabulary, show: int
) -> tuple[HeldOutAccuracy | None, list[Prediction]]:
    """Each held-out device downloads the final globals and evaluates them on its own store with
    the population's task config; a few show their next-word predictions."""
    held_out = [d for d in fleet.devices if d.role == HELD_OUT and d.device_id]
    if not held_out:
        return None, []
    client = held_out[0].client
    model_dir = await client.population_model(population, status["artifact_sha256"], fleet.cache_dir)
    blob = await client.global_params_at(population, int(status["current_version"]))
    config = TaskConfig.from_json(status["settings"]["task_config"])

    def evaluate() -> tuple[HeldOutAccuracy | None, list[Prediction]]:
        model = TFLiteModel(model_dir)
        params = decode_params(blob, model.manifest.global_params, "global parameters")
        sums: dict[str, float] = {}
        each: list[dict[str, float]] = []
        shown: list[Prediction] = []
        for device in held_out:
            with ExampleStore(device.store_path) as store:
                result = run_evaluation_task(
                    model, Environment.of(store), params, Task(config, seed=device.index)
                )
                if result.outcome is Outcome.COMPLETED:
                    each.append(dict(result.metrics))
                    for k, v in result.metrics.items():
                        sums[k] = sums.get(k, 0.0) + v
                if len(shown) < show * EXAMPLE_PREDICTIONS:
                    shown += predictions(model, store, params, config, vocabulary, device.index)
        if not each:
            return None, shown
        without_oov, with_oov = accuracies(sums)
        weight = sums.get("weight_sum", 0.0)
        accuracy = HeldOutAccuracy(
            len(each),
            sums.get("tokens_sum", 0.0),
            sums.get("in_vocab_tokens_sum", 0.0),
            without_oov,
            with_oov,
            sums.get("loss_sum", math.nan) / weight if weight else math.nan,
            _interval(each, "correct_in_vocab_tokens_sum", "in_vocab_tokens_sum"),
            _interval(each, "correct_tokens_sum", "tokens_sum"),
        )
        return accuracy, shown

    return await asyncio.to_thread(evaluate)


def _interval(each: list[dict[str, float]], correct: str, total: str) -> tuple[float, float]:
    """A token accuracy's 95% interval over the devices (a bootstrap of their counts)."""
    denominators = np.array([m.get(total, 0.0) for m in each])
    if denominators.sum() <= 0:
        return math.nan, math.nan
    numerators = np.array([m.get(correct, 0.0) for m in each])
    found = bootstrap_ratio(numerators, denominators, resample_rows(len(each), np.random.default_rng(0)))
    return found.low, found.high


def predictions(
    model: TFLiteModel,
    store: ExampleStore,
    params: dict[str, np.ndarray],
    config: TaskConfig,
    vocabulary: Vocabulary,
    device: int,
) -> list[Prediction]:
    """The device's top-3 next words after the first half of a few of its newest windows, with its
    locals reconstructed from its store, as it would predict while its user types."""
    windows = store.examples().select(slice(0, EXAMPLE_PREDICTIONS))  # newest first
    if not windows.num_examples:
        return []
    data = prepare(store, model.manifest, config, seed=device)
    model.set_global(params)
    try:
        if data.support:  # none for a model without locals: nothing to reconstruct
            reconstruct_locals(model, TaskBatches.pack(data.support, model.manifest), config)
        tokens = windows["tokens"].copy()
        actual = []
        for row, targets in zip(tokens, windows["targets"], strict=True):
            cut = max(1, int((row != PAD).sum()) // 2)
            row[cut:] = PAD  # `infer` predicts after the last token that is not padding
            actual.append(int(targets[cut - 1]))
        top = model.predict(Examples({"tokens": tokens, "targets": windows["targets"]}))["top_classes"]
    finally:
        model.reset_local()
    return [
        Prediction(
            device, words(vocabulary, row[row != PAD]), words(vocabulary, best), words(vocabulary, [a])[0]
        )
        for row, best, a in zip(tokens, top, actual, strict=True)
    ]


def words(vocabulary: Vocabulary, ids: Any) -> list[str]:
    """Ids as words; an OOV bucket is shown as `<oov n>` (the bucket, not the word, is predicted)."""
    names = ["<pad>", "<s>", "</s>", *vocabulary.words]
    return [names[i] if i < len(names) else f"<oov {i - len(names)}>" for i in np.asarray(ids).tolist()]


def round_accuracies(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each committed round's next-word accuracies, from the token counts the server summed: the
    held-out devices' ReconEval in evaluation rounds, the training devices' query sets before
    their update in training rounds."""
    out = []
    for r in rounds:
        if r["status"] != "committed":
            continue
        prefix = "" if r["kind"] == "evaluation" else "query_"
        sums = {k.removeprefix(prefix): v for k, v in r["metrics"].items() if k.startswith(prefix)}
        if "tokens_sum" not in sums:
            continue  # e.g. a secure round: no per-device metrics
        without_oov, with_oov = accuracies(sums)
        out.append(
            {
                "round": r["id"],
                "kind": r["kind"],
                "reported": r["counters"]["reported"],
                "accuracy_without_oov": without_oov,
                "accuracy_with_oov": with_oov,
            }
        )
    return out


def link_bytes(fleet: Fleet) -> dict[str, float | int]:
    """What the training devices' links carried, per training task they reported."""
    training = [d for d in fleet.devices if d.role == TRAINING]
    reported = sum(d.outcomes["reported"] for d in training)
    down, up = sum(d.bytes_down for d in training), sum(d.bytes_up for d in training)
    return {
        "training_reports": reported,
        "downloaded": down,
        "uploaded": up,
        "per_report": (down + up) / reported if reported else math.nan,
    }


def role_examples(index: int, examples: Mapping[str, np.ndarray]) -> DeviceExamples:
    """A role's windows as a device's examples, in the order they are spoken (the time is the
    window's index)."""
    columns = Examples({"tokens": examples["tokens"], "targets": examples["targets"]})
    return DeviceExamples(f"device-{index:05d}", columns, np.arange(columns.num_examples, dtype=np.float64))


def next_word_workload(
    config: RunConfig, console: Console, check_training: Callable[[int], None]
) -> Workload:
    """The roles as devices (training roles, then the held-out test roles) of the benchmark's LSTM."""
    data = load_data(config)
    vocabulary = data.vocabulary
    console.print(
        f"data: Tiny Shakespeare: {len(data.train)} training roles, {len(data.test)} held-out (test) roles; "
        f"vocabulary {len(vocabulary.words):,} words + {vocabulary.num_oov_buckets} OOV buckets, "
        f"windows of {data.seq_len}"
    )
    check_training(len(data.train))
    t0 = time.monotonic()
    model_dir = export(config, data)
    manifest = load_manifest(model_dir)
    check_model(manifest, data)
    console.print(
        f"model: next-word LSTM, {len(manifest.global_params)} global and {len(manifest.local_params)} local "
        f"tensors, sha256 {manifest.model_sha256[:12]}... ({time.monotonic() - t0:.1f} s)"
    )
    roles = [*data.train, *data.test]
    return Workload(
        source="Tiny Shakespeare (one role, one device)",
        name=SHAKESPEARE,
        model_dir=model_dir,
        manifest=manifest,
        devices=[role_examples(i, role) for i, role in enumerate(roles)],
        task={**TASK.to_json(), "reuse_below": 0},
        server_optimizer=SERVER.to_json(),
        held_out=frozenset(range(len(data.train), len(roles))),
        report=NextWordReport(data, manifest, config.show_devices),
    )


class NextWordReport:
    """Table 2's figures: the held-out roles' accuracy, per round and on every held-out device."""

    def __init__(self, data: NextWordData, manifest: Manifest, show: int) -> None:
        self.data, self.manifest, self.show = data, manifest, show

    async def serve(self, fleet: Fleet, population: str, status: dict[str, Any], show: int) -> Any:
        return await evaluate_held_out(fleet, population, status, self.data.vocabulary, show)

    def section(
        self, served: Any, fleet: Fleet, rounds: list[dict[str, Any]], final: dict[str, Any] | None
    ) -> dict[str, Any]:
        held_out, shown = served
        final_without, final_with = accuracies((final or {}).get("metrics", {}))
        vocabulary = self.data.vocabulary
        return {
            "data": {
                "training_roles": len(self.data.train),
                "held_out_roles": len(self.data.test),
                "vocabulary_words": len(vocabulary.words),
                "oov_buckets": vocabulary.num_oov_buckets,
                "seq_len": self.data.seq_len,
            },
            "next_word": {
                "final_evaluation_round": {
                    "reported": (final or {}).get("counters", {}).get("reported", 0),
                    "accuracy_without_oov": final_without,
                    "accuracy_with_oov": final_with,
                    "interval_without_oov": _released_interval(final, "in_vocab_tokens_accuracy"),
                    "interval_with_oov": _released_interval(final, "tokens_accuracy"),
                },
                "held_out_on_device": asdict(held_out) if held_out else None,
                "accuracy_by_round": round_accuracies(rounds),
                "bytes_per_round_per_device": {
                    "parameters": parameter_bytes_per_round(self.manifest),
                    "link": link_bytes(fleet),
                },
                "predictions": [asdict(p) for p in shown],
            },
        }

    def plot(self, path: Path, rounds: list[dict[str, Any]]) -> None:
        report.plot_next_word(path, rounds, round_accuracies(rounds))

    def print(self, body: dict[str, Any], console: Console) -> None:
        nwp = body["next_word"]
        last = nwp["final_evaluation_round"]
        if last["reported"]:
            console.print(
                f"final evaluation round ({last['reported']} held-out devices reported): next-word accuracy "
                f"{_percent(last['accuracy_without_oov'], last.get('interval_without_oov'))} without OOV, "
                f"{_percent(last['accuracy_with_oov'], last.get('interval_with_oov'))} with OOV "
                f"({INTERVALS_FROM_GROUPS if last.get('interval_with_oov') else NO_INTERVAL})"
            )
        held_out = nwp["held_out_on_device"]
        if held_out:
            without, within = held_out["interval_without_oov"], held_out["interval_with_oov"]
            console.print(
                f"all held-out roles on their devices ({held_out['devices']} devices, "
                f"{held_out['tokens']:,.0f} target tokens): next-word accuracy "
                f"{_percent(held_out['accuracy_without_oov'], without)} without OOV, "
                f"{_percent(held_out['accuracy_with_oov'], within)} with OOV "
                f"(95% bootstrap intervals over the devices; the same network trained centrally: "
                f"`python -m benchmarks.nextword`)"
            )
        sizes = nwp["bytes_per_round_per_device"]
        console.print(
            f"bytes per round per device: {sizes['parameters']:,} of parameters (download + upload); "
            f"{sizes['link']['per_report']:,.0f} over the links per reported training task"
        )
        for p in nwp["predictions"]:
            console.print(
                f"  device {p['device']}: ... {' '.join(p['context'][-6:])} -> {' | '.join(p['predicted'])} "
                f"(said: {p['actual']})"
            )


INTERVALS_FROM_GROUPS = "95% intervals from the server's groups of devices"
NO_INTERVAL = "too few devices for an interval"


def _released_interval(final: dict[str, Any] | None, name: str) -> list[float] | None:
    """The evaluation round's interval of `name` as the server released it, if it did."""
    metrics = (final or {}).get("metrics", {})
    low, high = metrics.get(f"{name}_low"), metrics.get(f"{name}_high")
    return None if low is None or high is None else [low, high]


def _percent(value: float, interval: Any) -> str:
    """`11.23% [10.42, 12.34]`, or the bare figure without an interval."""
    if not interval or any(math.isnan(x) for x in interval):
        return f"{value:.2%}"
    return f"{value:.2%} [{100 * interval[0]:.2f}, {100 * interval[1]:.2f}]"
