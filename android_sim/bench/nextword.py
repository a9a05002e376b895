"""`python -m android_sim.bench nextword`: the Federated Reconstruction paper's Table 2 on Shakespeare.

Next-word prediction with the OOV rows global (FedAvg, one shared OOV bucket) or local
(FedRecon, one or many buckets per device), for two vocabulary sizes, through the quality
benchmark's machinery (`android_sim.bench.federated`): every device step is the exported
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

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from android_sim.bench.federated import (
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
from android_sim.next_word import (
    MIN_ROLE_EXAMPLES,
    SEQ_LEN,
    SERVER,
    TASK,
    accuracies,
    model_args,
    parameter_bytes_per_round,
)
from android_sim.next_word import export as export_model
from android_sim.shakespeare import NextWordData, next_word_data, read_roles, time_split
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import TaskConfig
from model_runtime.support_query import num_steps, reconstruct_locals
from model_runtime.task_batches import TaskBatches, split_batches
from model_runtime.tflite_model import EvaluationSums, TFLiteModel
from orchestrator.aggregation import ServerOptimizerConfig


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
class Row:
    vocab_size: int
    method: str
    accuracy_without_oov: float
    accuracy_with_oov: float
    bytes_per_round: int
    seconds: float


def export(models_dir: Path, data: NextWordData, method: Method) -> Path:
    """The method's model, exported once into `models_dir` and reused."""
    # Local either way: FedAvg shares the OOV rows through the server (as the quality benchmark's
    # FedAvg shares the user vector), so one model serves both.
    args = model_args(data.vocabulary, data.seq_len, oov_local=True)
    return export_model(
        models_dir / f"nextword-v{len(data.vocabulary.words)}-b{method.num_oov_buckets}", args
    )


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


def run_method(
    data: NextWordData,
    model_dir: Path,
    method: Method,
    rounds: Rounds,
    workers: int,
    vocab_size: int,
    task: TaskConfig = TASK,
    server_optimizer: ServerOptimizerConfig = SERVER,
) -> Row:
    started = time.perf_counter()
    with Devices(model_dir, workers) as devices:
        manifest = devices.manifest
        per_item = per_item_names(manifest)
        clients = support_query(data.train, manifest)
        held_out = support_query(data.test, manifest)
        initial_model = TFLiteModel(model_dir)
        initial = initial_model.get_global()
        if method.oov_local:
            work = fedrecon_work(clients, task, per_item)
            evaluate = held_out_work(held_out, task, method.fine_tune)
        else:
            # The OOV rows are server parameters too: downloaded, trained and averaged.
            initial_model.reset_local()
            initial.update(initial_model.get_local())
            work = fedavg_work([pack(role, manifest) for role in data.train], task, per_item)
            evaluate = shared_locals_eval_work(held_out)
        server = Server(initial, server_optimizer)
        run = train_federated(devices, server, list(range(len(clients))), work, rounds, lambda params: {})
        devices.set_global(run.params)
        without_oov, with_oov = accuracies(devices.evaluate(evaluate, list(range(len(held_out)))).sums)
    return Row(
        vocab_size,
        method.name,
        without_oov,
        with_oov,
        parameter_bytes_per_round(manifest, shared_locals=not method.oov_local),
        time.perf_counter() - started,
    )


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
) -> list[Row]:
    roles = read_roles() if folder is None else read_roles(folder)
    rows = []
    for vocab_size in vocab_sizes:
        for method in methods(many_buckets):
            if method.fine_tune and not fine_tune:
                continue
            data = next_word_data(roles, vocab_size, method.num_oov_buckets, SEQ_LEN, MIN_ROLE_EXAMPLES)
            model_dir = export(models_dir, data, method)
            row = run_method(data, model_dir, method, rounds, workers, vocab_size, task, server_optimizer)
            print(
                f"  {vocab_size:>6,}  {row.method:<50}  {row.accuracy_without_oov:6.2%}  "
                f"{row.accuracy_with_oov:6.2%}  {row.bytes_per_round:>11,}  ({row.seconds:.0f} s)",
                flush=True,
            )
            rows.append(row)
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| vocabulary | method | accuracy without OOV | accuracy with OOV | bytes per round per device |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.vocab_size:,} | {r.method} | {r.accuracy_without_oov:.2%} | "
            f"{r.accuracy_with_oov:.2%} | {r.bytes_per_round:,} |"
        )
    return "\n".join(lines)
