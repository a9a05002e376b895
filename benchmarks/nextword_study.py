"""`python -m benchmarks.nextword`: the Federated Reconstruction paper's Table 2 on Shakespeare.

Next-word prediction with the OOV rows global (FedAvg, one shared OOV bucket) or local
(FedRecon, one or many buckets per device), for two vocabulary sizes, through the quality
benchmark's machinery (`android_sim.simulation.rounds`): every device step is the exported
`.tflite` model's signatures (`model_export.models.next_word:build`), the server is the
orchestrator's weighted mean and server optimizer, the transport a function call.

Roles are devices; the held-out (test) roles are evaluated as FedRecon evaluates: the locals
are reconstructed on the older half of a role's windows and the accuracy is measured on the
newer half (FedAvg, with nothing local, is measured on the same newer half). "+ fine-tuning"
also trains the globals on the older half (on the device, not reported) before measuring.
Accuracy excludes or includes OOV targets (`model_export.models.next_word.example_metrics`).
Bytes per round per device: the global parameters downloaded and their delta uploaded, float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from android_sim.intervals import Interval, bootstrap_ratio, resample_rows
from android_sim.next_word import (
    MIN_ROLE_EXAMPLES,
    SEQ_LEN,
    SERVER,
    TASK,
    model_args,
    parameter_bytes_per_round,
)
from android_sim.next_word import export as export_model
from android_sim.shakespeare import PAD, NextWordData, next_word_data, read_roles, time_split
from android_sim.simulation.rounds import (
    Devices,
    EvaluationWork,
    Rounds,
    Server,
    SupportQuery,
    fedavg_work,
    fedrecon_work,
    per_item_names,
    shared_locals_eval_work,
    train_federated,
)
from benchmarks.nextword_ceiling import (
    CENTRAL_EPOCHS,
    CENTRAL_LEARNING_RATE,
    Accuracies,
    accuracies_with_intervals,
    train_centrally,
)
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from model_runtime.support_query import num_steps, reconstruct_locals
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import EvaluationSums, TFLiteModel
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig


@dataclass(frozen=True)
class Method:
    name: str
    num_oov_buckets: int
    oov_local: bool
    fine_tune: bool = False


def methods(many_buckets: int) -> tuple[Method, ...]:
    return (
        Method("FedAvg, 1 shared OOV bucket", 1, False),
        Method("FedRecon, 1 local OOV bucket", 1, True),
        Method(f"FedRecon, {many_buckets} local OOV buckets", many_buckets, True),
        Method(f"FedRecon, {many_buckets} local OOV buckets + fine-tuning", many_buckets, True, True),
    )


@dataclass(frozen=True)
class ModelShape:
    """The exported model's sizes; None leaves a size at its default (the builder's
    `NextWordConfig` for the layers, `android_sim.next_word`'s 8 x 8 windows per task)."""

    embedding_dim: int | None = None
    lstm_units: int | None = None
    batch_size: int | None = None  # windows per batch
    max_batches: int | None = None  # batches per task: a task reads at most batch_size x max_batches windows

    def __post_init__(self) -> None:
        for name, value in self.builder_args().items():
            if value < 1:
                raise ValueError(f"{name} is {value}; expected at least 1 (or unset for the default)")

    def builder_args(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Row:
    vocab_size: int
    method: str
    accuracy_without_oov: float
    accuracy_with_oov: float
    bytes_per_round: int
    seconds: float
    baseline: tuple[float, float]  # (without, with OOV) of `most_frequent_baseline`
    # 95% intervals over the held-out roles (`nextword_ceiling.accuracies_with_intervals`).
    interval_without_oov: tuple[float, float] = (math.nan, math.nan)
    interval_with_oov: tuple[float, float] = (math.nan, math.nan)
    # The floor's intervals over the same roles ((without OOV), (with OOV)).
    baseline_intervals: tuple[tuple[float, float], tuple[float, float]] = (
        (math.nan, math.nan),
        (math.nan, math.nan),
    )
    # Per held-out role: (correct, in-vocabulary targets) of the row and of the floor, without OOV.
    role_counts: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    floor_counts: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())


CEILING = "ceiling: the same network trained centrally"


def _row(
    vocab_size: int,
    method: str,
    found: Accuracies,
    bytes_per_round: int,
    seconds: float,
    floor: Floor,
) -> Row:
    return Row(
        vocab_size,
        method,
        found.without_oov.value,
        found.with_oov.value,
        bytes_per_round,
        seconds,
        (floor.without_oov.value, floor.with_oov.value),
        (found.without_oov.low, found.without_oov.high),
        (found.with_oov.low, found.with_oov.high),
        ((floor.without_oov.low, floor.without_oov.high), (floor.with_oov.low, floor.with_oov.high)),
        (found.correct_in_vocab, found.in_vocab),
        floor.counts,
    )


def task_config(
    update_learning_rate: float,
    reconstruction_learning_rate: float,
    update_epochs: int,
    reconstruction_epochs: int,
    max_batches: int,
) -> TaskConfig:
    """`TASK` with these rates and epochs. Steps are bounded by the epochs alone: every pass over
    a task's (at most `max_batches`) batches runs, none is cut by `TaskConfig`'s step caps."""
    if update_epochs < 1:
        raise ValueError(f"update epochs is {update_epochs}; expected at least 1 (0 would train nothing)")
    return replace(
        TASK,
        update_learning_rate=update_learning_rate,
        reconstruction_learning_rate=reconstruction_learning_rate,
        update_max_epochs=update_epochs,
        update_max_steps=update_epochs * max_batches,
        reconstruction_max_epochs=reconstruction_epochs,
        reconstruction_max_steps=reconstruction_epochs * max_batches,
    )


def export(models_dir: Path, data: NextWordData, method: Method, shape: ModelShape = ModelShape()) -> Path:
    """The method's model, exported once into `models_dir` (a folder per vocabulary, buckets
    and shape) and reused."""
    # Local either way: FedAvg shares the OOV rows through the server (as the quality benchmark's
    # FedAvg shares the user vector), so one model serves both.
    sizes = shape.builder_args()
    args = model_args(data.vocabulary, data.seq_len, oov_local=True, **sizes)
    name = f"nextword-v{len(data.vocabulary.words)}-b{method.num_oov_buckets}"
    name += "".join(f"-{k}{v}" for k, v in sorted(sizes.items()))
    return export_model(models_dir / name, args)


def most_frequent_baseline(data: NextWordData, windows_per_task: int) -> tuple[float, float]:
    """The floor a trained model must clear: accuracy on the held-out roles' scored windows (the
    newer half, its first `windows_per_task`) of always predicting one token, the training roles'
    most frequent target. Without OOV, the most frequent target among the vocabulary's tokens
    (predicting a bucket would always be wrong there); with OOV, the most frequent of all, which
    can be an OOV bucket."""
    floor = floor_with_intervals(data, windows_per_task)
    return floor.without_oov.value, floor.with_oov.value


@dataclass(frozen=True)
class Floor:
    """`most_frequent_baseline` with 95% intervals over the held-out roles, and its per-role
    counts without OOV (right, in-vocabulary targets)."""

    without_oov: Interval
    with_oov: Interval
    counts: tuple[tuple[float, ...], tuple[float, ...]]


def floor_with_intervals(data: NextWordData, windows_per_task: int, seed: int = 0) -> Floor:
    """The floor over the held-out roles, each role's counts kept apart so that the interval
    resamples roles (the same resamples as the rows' `accuracies_with_intervals`)."""
    train_targets = np.concatenate([role["targets"].ravel() for role in data.train])
    counts = np.bincount(train_targets[train_targets != PAD], minlength=data.vocabulary.num_tokens)
    num_global = data.vocabulary.num_global_tokens
    top_word, top_any = np.argmax(counts[:num_global]), np.argmax(counts)
    right_word, words, right_any, targets = [], [], [], []
    for role in data.test:
        scored = time_split(role)[1]["targets"][:windows_per_task].ravel()
        scored = scored[scored != PAD]
        in_vocab = scored[scored < num_global]
        right_word.append(float(np.sum(in_vocab == top_word)))
        words.append(float(in_vocab.size))
        right_any.append(float(np.sum(scored == top_any)))
        targets.append(float(scored.size))
    rows = resample_rows(len(data.test), np.random.default_rng(seed))

    def interval(right: list[float], total: list[float]) -> Interval:
        if sum(total) <= 0:
            return Interval(math.nan, math.nan, math.nan, len(total))
        return bootstrap_ratio(np.asarray(right), np.asarray(total), rows)

    return Floor(interval(right_word, words), interval(right_any, targets), (tuple(right_word), tuple(words)))


def pack(columns: Mapping[str, np.ndarray], manifest: Manifest) -> TaskBatches:
    """The first `max_batches` batches of a role's windows (oldest first)."""
    batches = split_batches(Examples(dict(columns)), manifest.batch_size)[: manifest.max_batches]
    return TaskBatches.pack(batches, manifest)


def support_query(roles: Sequence[Mapping[str, np.ndarray]], manifest: Manifest) -> list[SupportQuery]:
    """Per role: the older half to reconstruct on, the newer half to train or score."""
    out = []
    for role in roles:
        support, query = time_split(role)
        out.append(SupportQuery(pack(support, manifest), pack(query, manifest)))
    return out


def held_out_work(clients: Sequence[SupportQuery], config: TaskConfig, fine_tune: bool) -> EvaluationWork:
    """Reconstruct the locals on the older half (if any), optionally fine-tune the globals there
    too, and score the newer half."""

    def work(model: TFLiteModel, params: Params, user: int) -> EvaluationSums:
        client = clients[user]
        if model.manifest.local_params:
            reconstruct_locals(model, client.support, config)
        if not fine_tune:
            return model.evaluate(client.query)
        steps = num_steps(client.support.num_batches, config.update_max_epochs, config.update_max_steps)
        update = model.update(
            client.support,
            steps,
            config.update_learning_rate,
            local_learning_rate=config.reconstruction_learning_rate,
        )
        own = {k: v for k, v in params.items() if k in update.delta}
        model.set_global({k: v + update.delta[k] for k, v in own.items()})
        try:
            return model.evaluate(client.query)
        finally:
            model.set_global(own)  # the next task on this thread starts from the server's globals

    return work


def run_methods(
    data: NextWordData,
    model_dir: Path,
    methods: Sequence[Method],
    rounds: Rounds,
    workers: int,
    vocab_size: int,
    task: TaskConfig = TASK,
    server_optimizer: ServerOptimizerConfig = SERVER,
) -> list[Row]:
    """Train once, then a row per method: `methods` must train alike (same buckets, OOV rows
    local or not) and differ only in the held-out evaluation (fine-tuning or not). A row's
    seconds are the training's plus its own evaluation's."""
    trainings = {(m.num_oov_buckets, m.oov_local) for m in methods}
    if len(trainings) != 1:
        raise ValueError(
            f"methods {[m.name for m in methods]} train differently; expected the same OOV buckets and "
            "locality, differing only in fine-tuning"
        )
    oov_local = methods[0].oov_local
    started = time.perf_counter()
    rows = []
    with Devices(model_dir, workers) as devices:
        manifest = devices.manifest
        per_item = per_item_names(manifest)
        clients = support_query(data.train, manifest)
        held_out = support_query(data.test, manifest)
        initial_model = TFLiteModel(model_dir)
        initial = initial_model.get_global()
        if oov_local:
            work = fedrecon_work(clients, task, per_item)
        else:
            # The OOV rows are server parameters too: downloaded, trained and averaged.
            initial_model.reset_local()
            initial.update(initial_model.get_local())
            work = fedavg_work([pack(role, manifest) for role in data.train], task, per_item)
        server = Server(initial, server_optimizer)
        run = train_federated(devices, server, list(range(len(clients))), work, rounds, lambda params: {})
        trained = time.perf_counter() - started
        devices.set_global(run.params)
        baseline = floor_with_intervals(data, manifest.batch_size * manifest.max_batches)
        for method in methods:
            evaluating = time.perf_counter()
            evaluate = (
                held_out_work(held_out, task, method.fine_tune)
                if oov_local
                else shared_locals_eval_work(held_out)
            )
            found = accuracies_with_intervals(devices, evaluate, range(len(held_out)))
            rows.append(
                _row(
                    vocab_size,
                    method.name,
                    found,
                    parameter_bytes_per_round(manifest, shared_locals=not oov_local),
                    trained + time.perf_counter() - evaluating,
                    baseline,
                )
            )
    return rows


def run_ceiling(
    data: NextWordData,
    model_dir: Path,
    workers: int,
    vocab_size: int,
    task: TaskConfig = TASK,
    epochs: int = CENTRAL_EPOCHS,
    learning_rate: float = CENTRAL_LEARNING_RATE,
) -> Row:
    """The ceiling row: `model_dir`'s network trained centrally (`train_centrally`), then scored
    on the held-out roles as the FedRecon rows are (OOV rows reconstructed on the older half)."""
    started = time.perf_counter()
    params, _ = train_centrally(TFLiteModel(model_dir), data, epochs, learning_rate)
    with Devices(model_dir, workers) as devices:
        manifest = devices.manifest
        devices.set_global(params)
        held_out = support_query(data.test, manifest)
        found = accuracies_with_intervals(devices, held_out_work(held_out, task, False), range(len(held_out)))
        baseline = floor_with_intervals(data, manifest.batch_size * manifest.max_batches)
    return _row(vocab_size, CEILING, found, 0, time.perf_counter() - started, baseline)


def share_of_the_way(row: Row, ceiling: Row) -> float:
    """How far `row` is from the most frequent token to the ceiling (without OOV): 0 at the
    floor, 1 at the ceiling; the issue's target is 0.5."""
    floor = row.baseline[0]
    span = ceiling.accuracy_without_oov - floor
    return (row.accuracy_without_oov - floor) / span if span > 0 else math.nan


def share_interval(row: Row, ceiling: Row, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of `share_of_the_way`: the row, the ceiling and the floor are scored on the
    same held-out roles, so the same roles are resampled in all three (NaN without the counts)."""
    right, total = (np.asarray(c) for c in row.role_counts)
    top_right, top_total = (np.asarray(c) for c in ceiling.role_counts)
    floor_right, floor_total = (np.asarray(c) for c in row.floor_counts)
    if not (len(right) == len(top_right) == len(floor_right) > 0):
        return (math.nan, math.nan)
    rows = resample_rows(len(right), np.random.default_rng(seed))

    def draws(numerators: np.ndarray, denominators: np.ndarray) -> np.ndarray:
        result: np.ndarray = numerators[rows].sum(axis=1) / np.maximum(denominators[rows].sum(axis=1), 1e-12)
        return result

    floor = draws(floor_right, floor_total)
    span = draws(top_right, top_total) - floor
    shares = (draws(right, total) - floor) / np.where(span > 0, span, np.nan)
    if np.isnan(shares).mean() > 0.025:  # the ceiling not above the floor in too many resamples
        return (math.nan, math.nan)
    low, high = np.nanpercentile(shares, [2.5, 97.5])
    return (float(low), float(high))


def run(
    models_dir: Path,
    vocab_sizes: Sequence[int],
    many_buckets: int,
    rounds: Rounds,
    workers: int,
    fine_tune: bool,
    task: TaskConfig = TASK,
    server_optimizer: ServerOptimizerConfig = SERVER,
    folder: Path | None = None,
    shape: ModelShape = ModelShape(),
    ceiling: bool = True,
    central_epochs: int = CENTRAL_EPOCHS,
    central_learning_rate: float = CENTRAL_LEARNING_RATE,
) -> list[Row]:
    """Every method at every vocabulary size; a method and its fine-tuned variant share one
    training. With `ceiling`, each vocabulary's last model (the most OOV buckets) is also trained
    centrally (`run_ceiling`), and every row of that vocabulary says how far it went toward it."""
    roles = read_roles() if folder is None else read_roles(folder)
    wanted = [m for m in methods(many_buckets) if fine_tune or not m.fine_tune]
    groups: dict[tuple[int, bool], list[Method]] = {}
    for method in wanted:
        groups.setdefault((method.num_oov_buckets, method.oov_local), []).append(method)
    rows = []
    for vocab_size in vocab_sizes:
        for i, group in enumerate(groups.values()):
            data = next_word_data(roles, vocab_size, group[0].num_oov_buckets, SEQ_LEN, MIN_ROLE_EXAMPLES)
            model_dir = export(models_dir, data, group[0], shape)
            found = run_methods(data, model_dir, group, rounds, workers, vocab_size, task, server_optimizer)
            if ceiling and i == len(groups) - 1:
                found.append(
                    run_ceiling(
                        data, model_dir, workers, vocab_size, task, central_epochs, central_learning_rate
                    )
                )
            for row in found:
                print(f"  {line(row)}", flush=True)
                rows.append(row)
    return rows


def rows_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The rows for `--out`: each figure with its 95% interval over the held-out roles, the row
    that is its vocabulary's ceiling, and the share of the way to it with its interval."""
    ceilings = {r.vocab_size: r for r in rows if r.method == CEILING}
    out = []
    for r in rows:
        row: dict[str, Any] = {
            "vocab_size": r.vocab_size,
            "method": r.method,
            "accuracy_without_oov": r.accuracy_without_oov,
            "accuracy_without_oov_95": list(r.interval_without_oov),
            "accuracy_with_oov": r.accuracy_with_oov,
            "accuracy_with_oov_95": list(r.interval_with_oov),
            "most_frequent_token": list(r.baseline),
            "most_frequent_token_95": [list(i) for i in r.baseline_intervals],
            "bytes_per_round": r.bytes_per_round,
            "seconds": round(r.seconds, 1),
            "ceiling": None if r.method == CEILING else (CEILING if r.vocab_size in ceilings else None),
        }
        top = ceilings.get(r.vocab_size)
        if top is not None and r is not top:
            row["share_of_the_way"] = share_of_the_way(r, top)
            row["share_of_the_way_95"] = list(share_interval(r, top))
        out.append(row)
    return out


def line(row: Row) -> str:
    return (
        f"{row.vocab_size:>6,}  {row.method:<50}  "
        f"{_with_interval(row.accuracy_without_oov, row.interval_without_oov)}  "
        f"{_with_interval(row.accuracy_with_oov, row.interval_with_oov)}  {row.bytes_per_round:>11,}  "
        f"({row.seconds:.0f} s; most frequent token {_floor(row)})"
    )


def _with_interval(value: float, interval: tuple[float, float]) -> str:
    return f"{value:6.2%} [{100 * interval[0]:.2f}, {100 * interval[1]:.2f}]"


def _floor(row: Row) -> str:
    without, with_oov = row.baseline_intervals
    return (
        f"{_with_interval(row.baseline[0], without).strip()} / "
        f"{_with_interval(row.baseline[1], with_oov).strip()}"
    )


def table(rows: Sequence[Row]) -> str:
    """The rows as Markdown, with 95% intervals over the held-out roles and, beside each row, its
    share of the way from the most frequent token to its vocabulary's ceiling (without OOV; target
    0.5), the ceiling's row named `CEILING`."""
    ceilings = {r.vocab_size: r for r in rows if r.method == CEILING}
    lines = [
        "| vocabulary | method | accuracy without OOV [95%] | accuracy with OOV [95%] | "
        "most frequent token (without / with OOV) [95%] | share of the way to the ceiling [95%] | "
        "bytes per round per device |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        top = ceilings.get(r.vocab_size)
        if top is None:
            share = "(no ceiling run)"
        elif r is top:
            share = "(the ceiling)"
        else:
            low, high = share_interval(r, top)
            share = f"{share_of_the_way(r, top):.2f} [{low:.2f}, {high:.2f}]"
        lines.append(
            f"| {r.vocab_size:,} | {r.method} | "
            f"{_with_interval(r.accuracy_without_oov, r.interval_without_oov)} | "
            f"{_with_interval(r.accuracy_with_oov, r.interval_with_oov)} | "
            f"{_floor(r)} | {share} | {r.bytes_per_round:,} |"
        )
    return "\n".join(lines)
