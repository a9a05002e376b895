"""Fast in-process simulation of any exported model on per-device examples.

`python -m android_sim simulate` (and the quality benchmark's FedRecon rows) run here: the
devices are split 80/10/10 into training, validation and held-out devices (`protocol.split_users`);
every round samples training devices, runs their tasks through the export's `.tflite`
signatures (`bench.federated.Devices`) and commits the round with the orchestrator's aggregation
and server optimizer (`bench.federated.Server`). What a device does follows its task config:

- `local_state: reconstruct` (FedRecon): fresh locals fitted on support, globals trained on query;
  the learning curve is ReconEval on the validation devices, the result ReconEval on the held-out.
- `local_state: keep` (FURL): each training device keeps its locals across rounds and trains them
  with the globals on its oldest 80%; the curve and the result are StandardEval on its next and
  newest 10%, plus ReconEval on the held-out devices.
- A ranking model with sampled negatives gets fresh negatives at each participation, as a device.

The metrics are the model's own (`evaluate`'s sums, weighted by examples).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from android_sim.bench.federated import (
    ClientPool,
    ClientWork,
    Devices,
    EvaluationWork,
    PrivateLocals,
    Rounds,
    Server,
    SupportQuery,
    fedrecon_task,
    fedrecon_work,
    furl_work,
    per_item_names,
    private_locals_eval_work,
    recon_eval_work,
    train_federated,
)
from android_sim.bench.protocol import PROTOCOL_SEED, UserSplit, split_users, time_split
from android_sim.intervals import metric_intervals
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import LocalState, SplitPolicy, TaskConfig
from device_runtime.client_task import shuffled
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
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig

HELD_OUT = "held-out devices, ReconEval (reconstruct on support, measure on query)"
SEEN = "training devices' newest 10% of examples, StandardEval (their kept locals)"


@dataclass(frozen=True)
class SimulationOptions:
    """How the simulated population trains: the rounds, the devices' task, the server optimizer."""

    rounds: Rounds = field(default_factory=Rounds)
    task: TaskConfig = field(default_factory=TaskConfig)
    server: ServerOptimizerConfig = field(default_factory=lambda: ServerOptimizerConfig("sgd", 1.0))
    aggregation: RobustAggregation | None = None  # None: the weighted mean; else the robust one
    workers: int = 2  # interpreter threads, or Ray worker processes
    split_seed: int = PROTOCOL_SEED  # which devices train, validate and are held out
    backend: Literal["threads", "ray"] = "threads"  # ray: the clients sharded over Ray workers
    ray_address: str | None = None  # an existing Ray cluster (None: local worker processes)

    @property
    def stateful(self) -> bool:
        return self.task.local_state is LocalState.KEEP


@dataclass
class SimulationResult:
    held_out: dict[str, float]  # ReconEval on the held-out devices (with `devices`)
    seen: dict[str, float] | None  # kept locals: StandardEval on the training devices' newest 10%
    curve: list[dict[str, float]]  # the validation metrics by round
    seconds: float
    refused: int  # diverged updates the server left out
    params: Params = field(repr=False)
    split: UserSplit = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "held_out": {"evaluated_on": HELD_OUT, **self.held_out},
            "seen": None if self.seen is None else {"evaluated_on": SEEN, **self.seen},
            "learning_curve": self.curve,
            "seconds": round(self.seconds, 2),
            "refused_updates": self.refused,
            "devices": {
                "training": len(self.split.train),
                "validation": len(self.split.validation),
                "held_out": len(self.split.test),
            },
        }


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
    live: every device in this process, or a Ray worker's shard of them (`android_sim.ray_clients`).
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


def simulation_clients(
    model_dir: Path, devices: Sequence[Examples], options: SimulationOptions
) -> SimulationClients:
    """The backend `options` asks for, holding `devices`' tasks."""
    if options.backend == "ray":
        from android_sim.ray_clients import RayClients  # Ray is an optional extra

        return RayClients(model_dir, devices, options.task, options.workers, options.ray_address)
    pool = Devices(model_dir, options.workers)
    return LocalClients(pool, client_works(dict(enumerate(devices)), pool.manifest, options.task))


def _with_intervals(per_device: Sequence[EvaluationSums]) -> dict[str, float]:
    """The devices' example-weighted metrics, each with its 95% interval over the devices."""
    total = sum(per_device, EvaluationSums.zero())
    return {**total.metrics(), **metric_intervals([d.as_dict() for d in per_device])}


def simulate(
    model_dir: Path,
    devices: Sequence[Examples],
    options: SimulationOptions,
    make_server: Callable[[Params, Manifest], Server] | None = None,
    split: UserSplit | None = None,
) -> SimulationResult:
    """Train the export in `model_dir` on `devices` (each one's examples, newest first) and evaluate it.
    `make_server` builds the server from the initial globals (default: `options`' optimizer and
    aggregation; the quality benchmark passes DP or secure aggregation's arithmetic); `split`
    (default: `split_users` with `options.split_seed`) says which devices train, validate, are held out."""
    if len(devices) < 10:
        raise ValueError(
            "a simulation needs at least 10 devices (80/10/10 to train, validate, hold out), "
            f"got {len(devices)}"
        )
    split = split or split_users(len(devices), options.split_seed)
    pool = simulation_clients(model_dir, devices, options)
    try:
        initial = TFLiteModel(model_dir).get_global()
        server = (
            make_server(initial, pool.manifest)
            if make_server is not None
            else Server(initial, options.server, options.aggregation)
        )
        # A kept-locals population validates on its training devices' next 10%.
        validate_on = split.train if options.stateful else split.validation

        def validate(params: Params) -> dict[str, float]:
            pool.set_global(params)
            return pool.evaluate("validation", validate_on).metrics()

        train: WorkKind = "train"
        run = train_federated(pool, server, split.train, train, options.rounds, validate)
        pool.set_global(run.params)
        test = _with_intervals(pool.map("evaluation", split.test))
        seen: dict[str, float] | None = None
        if options.stateful:
            seen = {**_with_intervals(pool.map("seen", split.train)), "devices": len(split.train)}
    finally:
        pool.close()
    return SimulationResult(
        {**test, "devices": len(split.test)}, seen, run.curve, run.seconds, run.refused, run.params, split
    )
