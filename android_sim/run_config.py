"""What a fleet run is asked to do (`RunConfig`, checked as a whole), and what it left (`RunResult`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from android_sim.algorithm import algorithm_task, settings_problem
from android_sim.datasets import default_file
from android_sim.profiles import DEFAULT_MIX, DeviceClass
from android_sim.recommendations import HitRates
from android_sim.shakespeare import DEFAULT_FOLDER as DEFAULT_SHAKESPEARE
from contracts.mixing import MixingConfig, MixingError
from contracts.task_config import LocalState, TaskConfig
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.settings import admin_token_problem

DEFAULT_RATINGS = default_file("movielens-100k")
SHAKESPEARE = "shakespeare"
# Builder arguments of the next-word model that follow from the run's own options.
RUN_SETS_MODEL_ARGS = {
    "num_global_tokens": "--vocab-size",
    "num_oov_buckets": "--oov-buckets",
    "seq_len": "--seq-len",
}


class RunError(RuntimeError):
    """A problem the user can fix (bad input, no orchestrator, a stalled run); printed without a traceback."""


@dataclass(frozen=True)
class RunConfig:
    work_dir: Path
    # The user's model: an export (`model_dir`) or a builder `MODULE:FUNCTION` (`model`, with
    # `model_args`), and its per-device examples table (`examples`, CSV or Parquet). Without
    # them, a built-in data set with its model (`data`).
    model_dir: Path | None = None
    model: str | None = None
    examples: Path | None = None
    # "expressions" (synthetic, implicit), "movielens" (ratings, explicit) or "shakespeare"
    # (next-word prediction, `android_sim.builtin_next_word`)
    data: str = "expressions"
    ratings: Path = DEFAULT_RATINGS
    # --data shakespeare: the text's folder, the vocabulary's words, the local OOV buckets, the
    # window length, and further keyword arguments of the model's builder (as text, checked by it).
    shakespeare: Path = DEFAULT_SHAKESPEARE
    vocab_size: int = 1000
    oov_buckets: int = 100
    seq_len: int = 20
    model_args: dict[str, str] = field(default_factory=dict)
    devices: int | None = None  # expressions: users (default 1000); movielens: at most this many (all)
    expressions: int = 1000
    held_out_fraction: float = 0.15
    held_out: Path | None = None  # a user's table: the devices to hold out, one id a line (else drawn)
    held_out_column: str | None = None  # or a column of the table, 1 on a held-out device's rows
    initial_globals: Path | None = None  # the population starts from these globals (e.g. simulate's)
    rounds: int = 60
    target_reports: int = 40
    oversampling: float = 1.3
    min_examples: int = 3
    round_seconds: float = 10.0
    aggregation: str = "plaintext"  # or "secure": secure aggregation (README, "Privacy")
    # "buffered": FedBuff rounds (docs/concepts/buffered-rounds.md): a version every `buffer_size`
    # reports (default target_reports), `concurrency` devices training at once (default the
    # synchronous round's capacity, ceil(target_reports x oversampling)).
    rounds_mode: str = "synchronous"
    buffer_size: int | None = None
    concurrency: int | None = None
    max_staleness: int = 10
    staleness_weighting: str = "inverse_sqrt"
    # Deadline of the secure phases that need no training (share keys, consistency, unmasking).
    # A phase ends as soon as its devices have answered (a silent straggler is waited for at most
    # as long again as the others took), so the deadline binds only when too few answer in time:
    # at 2 s, a machine loaded with other work (load 9 on 2 cores) had every round abandoned at
    # share keys and the run gave up. Check-ins (advertising keys) close at capacity or after half
    # the round's time, and the masked-input phase (training) has the round's time.
    secure_phase_seconds: float = 10.0
    secure_clip_norm: float = 10.0  # L2 bound each device clips its delta to under secure aggregation
    evaluation_every: int = 10
    day_seconds: float = 60.0  # wall seconds per simulated day
    cooldown_hours: float = 2.0  # simulated hours a device rests after it took part
    orchestrator_url: str | None = None
    admin_token: str | None = None
    population: str | None = None
    device_mix: tuple[DeviceClass, ...] = DEFAULT_MIX
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    in_process: bool = False  # the orchestrator app in this process over ASGI (benchmarks)
    shards: int = 1  # >= 2: the devices sharded over this many Ray actors (android_sim/ray_fleet.py)
    ray_address: str | None = None  # with shards: an existing Ray cluster (None: local processes)
    stall_seconds: float = 120.0  # give up when no round commits for this long
    seed: int = 0
    show_devices: int = 3
    # The algorithm: task config fields over the data's defaults (split, reuse_below, steps and
    # learning rates, local_state, local_learning_rate, ...), and the server optimizer.
    task: dict[str, Any] = field(default_factory=dict)
    server_optimizer: dict[str, Any] = field(default_factory=dict)

    @property
    def stateful(self) -> bool:
        return self.task.get("local_state") == LocalState.KEEP.value

    # DP-FedAvg (on when clip_norm is set): devices clip to it, the server adds noise to the sum.
    clip_norm: float | None = None
    noise_multiplier: float | None = None
    population_size: int | None = None  # default: the fleet's training devices
    epsilon_budget: float | None = None
    # Default: the server's, min(1e-5, population_size^-1.1) (differential_privacy.target_delta_for).
    target_delta: float | None = None
    # Adaptive clipping: --clip-norm is then the first round's; the count's noise is reports / 20.
    target_unclipped_quantile: float | None = None
    # --rounds-mode buffered: the most buffers one device's reports may enter (default: --rounds).
    max_participations: int | None = None
    # Mixing centralized data (contracts.mixing): MixingConfig fields; {} = none. The centralized
    # dataset: `central_examples` public shares by popularity, plus the expressions no training
    # device holds (android_sim/central_data.py).
    mixing: dict[str, Any] = field(default_factory=dict)
    central_examples: int = 2000

    def __post_init__(self) -> None:
        problems = []
        try:
            MixingConfig.from_json(self.mixing)
        except (TypeError, MixingError) as e:
            problems.append(f"mixing: {e}")
        if self.data == SHAKESPEARE and self.mixing.get("strategy", "none") != "none":
            problems.append("mixing runs with the expression and MovieLens data, not with --data shakespeare")
        if self.central_examples < 1:
            problems.append(f"central_examples must be >= 1, got {self.central_examples}")
        try:
            algorithm_task({}, self.task)
        except (TypeError, ValueError) as e:
            problems.append(f"algorithm: {e}")
        if self.server_optimizer:
            try:
                ServerOptimizerConfig.from_json({"name": "sgd", **self.server_optimizer})
            except (TypeError, ValueError) as e:
                problems.append(f"algorithm: {e}")
        if self.data not in ("expressions", "movielens", SHAKESPEARE):
            problems.append(f"data must be 'expressions', 'movielens' or 'shakespeare', got {self.data!r}")
        if self.user_model:
            problems += self._user_model_problems()
        elif self.held_out is not None or self.held_out_column is not None:
            problems.append(
                "--held-out names devices of your table: with --examples and --model-dir or --model"
            )
        elif self.examples is not None:
            problems.append(
                "--examples needs the model they are for: --model-dir DIR or --model MODULE:FUNCTION"
            )
        elif self.data == SHAKESPEARE:
            problems += self._next_word_problems()
        elif self.model_args:
            problems.append(
                "--model-arg is for --model or --data shakespeare (the other data export their own model)"
            )
        if not 0 <= self.held_out_fraction < 1:
            problems.append(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        for name in ("rounds", "target_reports", "min_examples", "workers"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shards < 1:
            problems.append(f"shards must be >= 1, got {self.shards}")
        if not 0 < self.stall_seconds < math.inf:
            problems.append(f"--stall-seconds must be a number of seconds > 0, got {self.stall_seconds}")
        if self.shards > 1 and self.in_process:
            problems.append("a sharded fleet talks HTTP: not with the in-process transport")
        if self.ray_address and self.shards < 2:
            problems.append(
                "--address is the Ray cluster of a sharded fleet: give it with --shards 2 or more"
            )
        if self.aggregation not in ("plaintext", "secure"):
            problems.append(f"aggregation must be 'plaintext' or 'secure', got {self.aggregation!r}")
        if self.rounds_mode not in ("synchronous", "buffered"):
            problems.append(f"rounds_mode must be 'synchronous' or 'buffered', got {self.rounds_mode!r}")
        if self.rounds_mode == "buffered" and self.clip_norm is not None:
            if self.aggregation == "secure":
                problems.append(
                    "--rounds-mode buffered with --aggregation secure does not support --clip-norm"
                )
            if self.epsilon_budget is not None or self.target_unclipped_quantile is not None:
                problems.append(
                    "--rounds-mode buffered bounds epsilon by --max-participations: leave out "
                    "--epsilon-budget and --target-unclipped-quantile"
                )
        if self.max_participations is not None:
            if self.rounds_mode != "buffered" or self.clip_norm is None:
                problems.append("--max-participations needs --rounds-mode buffered and --clip-norm")
            elif self.max_participations < 1:
                problems.append(f"max_participations must be >= 1, got {self.max_participations}")
        for name in ("buffer_size", "concurrency"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            problems.append(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.aggregation == "secure" and self.target_reports < 6:
            problems.append("secure aggregation needs target_reports >= 6 (min_reports = target / 2 >= 3)")
        if self.devices is not None and self.devices < 2:
            problems.append(f"devices must be >= 2 (one to train, one held out), got {self.devices}")
        if self.expressions < 2:
            problems.append(f"expressions must be >= 2, got {self.expressions}")
        dp_options = (
            "noise_multiplier",
            "population_size",
            "epsilon_budget",
            "target_delta",
            "target_unclipped_quantile",
        )
        if self.clip_norm is None and any(getattr(self, name) is not None for name in dp_options):
            problems.append(
                "--noise-multiplier, --population-size, --epsilon-budget, --target-delta and "
                "--target-unclipped-quantile need --clip-norm"
            )
        if self.clip_norm is not None and self.noise_multiplier is None:
            problems.append("--clip-norm needs --noise-multiplier (0 for clipping without noise)")
        if self.orchestrator_url and not self.admin_token:
            problems.append(
                "an orchestrator URL needs its admin token ($ORCHESTRATOR_ADMIN_TOKEN, "
                "--admin-token-file or --admin-token)"
            )
        if self.admin_token is not None and not self.orchestrator_url:
            # The local orchestrator's token: the server would refuse to start with a weak one.
            problem = admin_token_problem(self.admin_token, "the admin token")
            if problem:
                problems.append(problem)
        if not problems:
            # The round and DP settings as the server will check them, now: a combination it
            # would refuse must stop the run before anything is exported or started. (Without
            # --population-size the population is the fleet's, checked once the data is read.)
            settings = round_settings(self, TaskConfig(), {"name": "sgd"}, self.population_size or 0)
            if self.population_size is None:
                settings["differential_privacy"] = None
            problem = settings_problem(settings)
            if problem:
                problems.append(problem)
        if problems:
            raise RunError("; ".join(problems))

    @property
    def user_model(self) -> bool:
        return self.model_dir is not None or self.model is not None

    def _user_model_problems(self) -> list[str]:
        problems = []
        if self.model_dir is not None and self.model is not None:
            problems.append("give --model-dir (an export) or --model (a builder to export), not both")
        if self.model_args and self.model is None:
            problems.append("--model-arg is for --model (an export in --model-dir is already built)")
        if self.model is not None and ":" not in self.model:
            problems.append(f"--model takes MODULE:FUNCTION, e.g. my_pkg.my_model:build; got {self.model!r}")
        if self.examples is None:
            problems.append(
                "a model of your own needs its per-device examples: --examples TABLE (CSV or Parquet)"
            )
        if self.data != "expressions":
            problems.append(
                f"--data {self.data} is a built-in data set with its own model; not with --model-dir/--model"
            )
        if self.devices is not None:
            problems.append(
                "--devices is for the built-in data sets: your table's devices are its device ids"
            )
        if self.held_out is not None and self.held_out_column is not None:
            problems.append("give the held-out devices once: --held-out FILE or --held-out-column NAME")
        if (self.held_out is not None or self.held_out_column is not None) and self.stateful:
            problems.append(
                "--held-out is for held-out devices; a stateful fleet evaluates on its seen devices"
            )
        if self.mixing.get("strategy", "none") != "none":
            problems.append(
                "mixing draws on a built-in data set's public examples; not with --model-dir/--model"
            )
        return problems

    def _next_word_problems(self) -> list[str]:
        problems = [
            f"{name} must be >= 1, got {getattr(self, name)}"
            for name in ("vocab_size", "oov_buckets", "seq_len")
            if getattr(self, name) < 1
        ]
        for key in sorted(set(self.model_args) & set(RUN_SETS_MODEL_ARGS)):
            problems.append(f"--model-arg {key} is set by the run: use {RUN_SETS_MODEL_ARGS[key]}")
        if self.stateful:
            problems.append(
                "--local-state keep is not available with --data shakespeare: its evaluation is on "
                "held-out roles, which a stateful population does not have"
            )
        return problems


@dataclass
class RunResult:
    report_path: Path
    plots: list[Path]
    rounds_committed: int
    final_evaluation: dict[str, float]
    hit_rates: HitRates | None
    seconds: float
    summary: dict[str, Any] = field(default_factory=dict)


def check_fleet_size(config: RunConfig, training_devices: int) -> None:
    """Refuse, before anything starts, a fleet whose rounds could never commit: a training round
    needs half of `target_reports` (at least 3 under secure aggregation) from distinct devices."""
    needed = max(1, config.target_reports // 2)
    if training_devices < needed:
        raise RunError(
            f"a training round needs {needed} reports (half of --target-reports {config.target_reports}) "
            f"from distinct devices, but the fleet has {training_devices} training devices: "
            f"use more --devices or --target-reports <= {2 * training_devices + 1}"
            + (" (secure aggregation needs at least 6)" if config.aggregation == "secure" else "")
        )
    # The round and DP settings with the fleet's population, as the server will check them: before
    # a built-in model is exported or a server started.
    problem = settings_problem(round_settings(config, TaskConfig(), {"name": "sgd"}, training_devices))
    if problem:
        raise RunError(problem)


def training_count(config: RunConfig, devices: int) -> int:
    """The devices that train: all of them in a stateful population, else all but the held-out ones."""
    fraction = 0.0 if config.stateful else config.held_out_fraction
    return devices - round(fraction * devices)


def differential_privacy(config: RunConfig, training_devices: int) -> dict[str, Any] | None:
    """The population's DP settings from the run's flags; None without --clip-norm."""
    if config.clip_norm is None:
        return None
    settings: dict[str, Any] = {
        "clip_norm": config.clip_norm,
        "noise_multiplier": config.noise_multiplier,
        "population_size": config.population_size or training_devices,
    }
    if config.epsilon_budget is not None:
        settings["epsilon_budget"] = config.epsilon_budget
    if config.target_delta is not None:
        settings["target_delta"] = config.target_delta
    if config.rounds_mode == "buffered":
        # A device is in one report per buffer at most, so --rounds buffers bound it already.
        settings["max_participations"] = config.max_participations or config.rounds
    if config.target_unclipped_quantile is not None:
        settings["target_unclipped_quantile"] = config.target_unclipped_quantile
        # Andrew et al.'s suggestion: the count's noise at a twentieth of the reports per round.
        settings["clipped_count_stddev"] = config.target_reports / 20
    return settings


# How many synchronous rounds' time (--round-seconds) a buffered run gives a device to report.
BUFFERED_TASK_ROUNDS = 6


def round_settings(
    config: RunConfig, task: TaskConfig, optimizer: dict[str, Any], training_devices: int
) -> dict[str, Any]:
    """A population's settings from the run's round options, whatever the model: `task` is what
    the devices do, `optimizer` the server optimizer."""
    buffer_size = config.buffer_size or config.target_reports
    buffered = {
        "rounds": "buffered",
        "buffered": {
            "buffer_size": buffer_size,
            "concurrency": config.concurrency or math.ceil(config.target_reports * config.oversampling),
            "max_staleness": config.max_staleness,
            "staleness_weighting": config.staleness_weighting,
        },
    }
    return {
        **(buffered if config.rounds_mode == "buffered" else {}),
        "target_reports": config.target_reports,
        "oversampling": config.oversampling,
        "min_reports": max(1, min(config.target_reports, buffer_size) // 2),
        # A buffered device has no round to keep up with: its report counts until it is
        # `max_staleness` versions old or BUFFERED_TASK_ROUNDS rounds' time has passed.
        "round_duration_seconds": config.round_seconds
        * (BUFFERED_TASK_ROUNDS if config.rounds_mode == "buffered" else 1),
        "min_examples": config.min_examples,
        "retry_after_seconds": 2.0,
        # The server stops at --rounds: a fleet that stops its devices at the count would still
        # see the round open then commit from the reports already in flight.
        "max_training_rounds": config.rounds,
        "server_optimizer": optimizer,
        "task_config": task.to_json(),
        "evaluation_every": config.evaluation_every,
        "evaluation_target_reports": config.target_reports,
        # The server's floor (5) unless the run's rounds are smaller: half a round, as min_reports.
        "min_evaluation_reports": min(5, max(1, config.target_reports // 2)),
        "evaluation_round_duration_seconds": config.round_seconds,
        "aggregation": config.aggregation,
        "secure": {
            "clip_norm": config.secure_clip_norm,
            "advertise_seconds": config.round_seconds / 2,
            # A roster still short of min_reports then waits as long again: a round's check-in
            # time, like a plaintext round's, before it is abandoned.
            "advertise_patience_seconds": config.round_seconds,
            "share_keys_seconds": config.secure_phase_seconds,
            "masked_input_seconds": config.round_seconds,
            "unmasking_seconds": config.secure_phase_seconds,
        },
        "differential_privacy": differential_privacy(config, training_devices),
    }
