"""Fast in-process simulation of any exported model on per-device examples.

`python -m android_sim simulate` (and the quality benchmark's FedRecon rows) run here: the
devices are split 80/10/10 into training, validation and held-out devices (`protocol.split_users`);
every round samples training devices, runs their tasks through the export's `.tflite`
signatures (`rounds.Devices`) and commits the round with the orchestrator's aggregation
and server optimizer (`rounds.Server`). What a device does follows its task config:

- `local_state: reconstruct` (FedRecon): fresh locals fitted on support, globals trained on query;
  the learning curve is ReconEval on the validation devices, the result ReconEval on the held-out.
- `local_state: keep` (FURL): each training device keeps its locals across rounds and trains them
  with the globals on its oldest 80%; the curve and the result are StandardEval on its next and
  newest 10%, plus ReconEval on the held-out devices.
- A ranking model with sampled negatives gets fresh negatives at each participation, as a device.

The metrics are the model's own (`evaluate`'s sums, weighted by examples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from android_sim.intervals import metric_intervals
from android_sim.simulation.buffered import Buffering, train_buffered
from android_sim.simulation.clients import LocalClients, SimulationClients, WorkKind, client_works
from android_sim.simulation.protocol import PROTOCOL_SEED, UserSplit, split_users
from android_sim.simulation.rounds import (
    Devices,
    Rounds,
    Server,
    train_federated,
)
from contracts.features import Examples
from contracts.manifest import Manifest
from contracts.params import Params
from contracts.task_config import LocalState, TaskConfig
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
    buffering: Buffering | None = None  # buffered rounds (FedBuff); None: synchronous rounds

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
    buffered: dict[str, Any] | None = None  # buffered rounds: what the buffers took (BufferedStats)

    def to_json(self) -> dict[str, Any]:
        return {
            "held_out": {"evaluated_on": HELD_OUT, **self.held_out},
            "seen": None if self.seen is None else {"evaluated_on": SEEN, **self.seen},
            "learning_curve": self.curve,
            "seconds": round(self.seconds, 2),
            "refused_updates": self.refused,
            "buffered": self.buffered,
            "devices": {
                "training": len(self.split.train),
                "validation": len(self.split.validation),
                "held_out": len(self.split.test),
            },
        }


def simulation_clients(
    model_dir: Path, devices: Sequence[Examples], options: SimulationOptions
) -> SimulationClients:
    """The backend `options` asks for, holding `devices`' tasks."""
    if options.backend == "ray":
        from android_sim.simulation.ray_clients import RayClients  # Ray is an optional extra

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
        buffered: dict[str, Any] | None = None
        if options.buffering is None:
            run = train_federated(pool, server, split.train, train, options.rounds, validate)
        else:
            run, stats = train_buffered(
                pool, server, split.train, train, options.rounds, options.buffering, validate
            )
            buffered = stats.to_json()
        pool.set_global(run.params)
        test = _with_intervals(pool.map("evaluation", split.test))
        seen: dict[str, float] | None = None
        if options.stateful:
            seen = {**_with_intervals(pool.map("seen", split.train)), "devices": len(split.train)}
    finally:
        pool.close()
    return SimulationResult(
        {**test, "devices": len(split.test)},
        seen,
        run.curve,
        run.seconds,
        run.refused,
        run.params,
        split,
        buffered,
    )
