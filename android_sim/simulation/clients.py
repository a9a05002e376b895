"""A simulation's client tasks: what each device does in each kind of task (train, validate,
held-out ReconEval, kept locals' StandardEval), packed from its own examples, and where they run
in this process (`LocalClients`; `ray_clients.RayClients` runs them on Ray workers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import numpy as np

from android_sim.simulation.protocol import PROTOCOL_SEED, time_split
from android_sim.simulation.rounds import (
    ClientPool,
    ClientWork,
    Devices,
    EvaluationWork,
    PrivateLocals,
    SupportQuery,
    fedrecon_task,
    fedrecon_work,
    furl_work,
    per_item_names,
    private_locals_eval_work,
    recon_eval_work,
)
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.task_examples import shuffled
from model_runtime.support_query import (
    add_negatives,
    negative_weights,
    not_negatives,
    shares,
    split_support_query,
    support_negatives,
    with_support_negatives,
)
from model_runtime.task_batches import TaskBatches
from model_runtime.tflite_model import EvaluationSums, TFLiteModel


def evaluation_task(task: TaskConfig) -> TaskConfig:
    """ReconEval's split (alternating support and query batches), whatever split training uses:
    reconstructing on the query would measure on what the locals were fitted to."""
    return replace(task, split=SplitPolicy.ALTERNATE, reuse_below=0)


def selected(examples: Examples, config: TaskConfig) -> Examples:
    """What a device's task takes from its examples (newest first): the newest `max_examples`, shuffled."""
    return shuffled(examples.select(slice(None, config.max_examples)), PROTOCOL_SEED)


def support_query(
    examples: Examples,
    manifest: Manifest,
    config: TaskConfig,
    rng: np.random.Generator | None = None,
    weights: np.ndarray | None = None,
) -> SupportQuery:
    """One device's batches as its task selects and splits them; `rng` samples its negatives
    (drawn by `weights`, `negative_weights`; None: uniformly)."""
    chosen = selected(examples, config)
    own = shares(chosen, manifest) if rng is not None and manifest.task.negative_sampling else None
    if rng is not None:
        chosen = add_negatives(
            chosen, manifest, config.negatives_per_positive, rng, not_negatives(config), weights
        )
    support, query = split_support_query(chosen, manifest, config)
    if rng is not None:
        support = with_support_negatives(support, manifest, config, rng, not_negatives(config, own), weights)
    return SupportQuery(TaskBatches.pack(support, manifest), TaskBatches.pack(query, manifest))


def samples_negatives(manifest: Manifest, config: TaskConfig) -> bool:
    negatives = max(config.negatives_per_positive, support_negatives(config))
    return manifest.task.negative_sampling and negatives > 0


def packed_clients(
    devices: Mapping[int, Examples], manifest: Manifest, config: TaskConfig
) -> dict[int, SupportQuery]:
    """Every device's batches packed once (negatives, if any, drawn once per device, seeded by it)."""
    negatives = samples_negatives(manifest, config)
    return {
        i: support_query(
            e, manifest, config, np.random.default_rng((PROTOCOL_SEED, i)) if negatives else None
        )
        for i, e in devices.items()
    }


def fresh_negatives_work(
    devices: Mapping[int, Examples], manifest: Manifest, config: TaskConfig
) -> ClientWork:
    """FedRecon's task with negatives sampled anew at each participation, as a device does."""
    per_item = per_item_names(manifest)
    participations: dict[int, int] = {}  # a device is in at most one task at a time

    def work(model: TFLiteModel, params: Params, user: int) -> Any:
        count = participations.get(user, 0)
        participations[user] = count + 1
        rng = np.random.default_rng((0, user, count))
        client = support_query(
            devices[user], manifest, config, rng, negative_weights(manifest, config, params)
        )
        return fedrecon_task(model, params, client.support, client.query, config, per_item)

    return work


# The kinds of client tasks a simulation runs: a training round's, the learning curve's
# validation, the held-out devices' ReconEval, the kept locals' StandardEval on the newest 10%.
WorkKind = Literal["train", "validation", "evaluation", "seen"]


@dataclass(frozen=True)
class ClientWorks:
    """What a device does in each kind of task, built from the devices' own examples where they
    live: every device in this process, or a Ray worker's shard of them (`ray_clients`).
    A device's state (kept locals, its count of negative draws) stays with its examples."""

    train: ClientWork
    validation: EvaluationWork
    evaluation: EvaluationWork
    seen: EvaluationWork | None

    def of(self, kind: WorkKind) -> Callable[[TFLiteModel, Params, int], Any]:
        work = getattr(self, kind)
        if work is None:
            raise ValueError(f"no {kind!r} task in this simulation")
        return work  # type: ignore[no-any-return]


def client_works(devices: Mapping[int, Examples], manifest: Manifest, task: TaskConfig) -> ClientWorks:
    """The tasks of `devices` (device index -> its examples, newest first), packed once."""
    eval_task = evaluation_task(task)
    held_out = packed_clients(devices, manifest, eval_task)
    evaluation = recon_eval_work(held_out, task)
    if task.local_state is LocalState.KEEP:
        users = {i: time_split(e, manifest) for i, e in devices.items()}
        kept = PrivateLocals(manifest)
        return ClientWorks(
            furl_work(users, kept, task, per_item_names(manifest)),
            private_locals_eval_work(users, kept, "validation"),
            evaluation,
            private_locals_eval_work(users, kept, "test"),
        )
    if samples_negatives(manifest, task):
        work = fresh_negatives_work(devices, manifest, task)
    else:
        clients = held_out if eval_task == task else packed_clients(devices, manifest, task)
        work = fedrecon_work(clients, task, per_item_names(manifest))
    return ClientWorks(work, evaluation, evaluation, None)


class SimulationClients(ClientPool[WorkKind], Protocol):
    """Where a simulation's client tasks run, named by kind: `LocalClients` (this process's
    threads) or `ray_clients.RayClients` (Ray worker processes, each with its shard of the devices)."""

    manifest: Manifest

    def evaluate(self, kind: WorkKind, users: Sequence[int]) -> EvaluationSums: ...

    def close(self) -> None: ...


class LocalClients:
    """Every device's tasks on this process's interpreter threads."""

    def __init__(self, devices: Devices, works: ClientWorks) -> None:
        self.devices = devices
        self.works = works
        self.manifest = devices.manifest

    def set_global(self, params: Params) -> None:
        self.devices.set_global(params)

    def map(self, kind: WorkKind, users: Sequence[int]) -> list[Any]:
        return self.devices.map(self.works.of(kind), users)

    def evaluate(self, kind: WorkKind, users: Sequence[int]) -> EvaluationSums:
        return self.devices.evaluate(self.works.of(kind), users)

    def close(self) -> None:
        self.devices.close()
