"""Staleness: FedRecon against FURL (kept user vectors) as participation gets rarer.

The FedRecon paper's argument against stateful private parameters in cross-device training:
a device's kept user vector was fitted to the global model of the last round it took part
in, and the rarer its turns, the more the global model has moved since. Here both methods
train the same training users on the same number of client tasks (example visits), with
100, 20 or 5 clients per round, so a user takes part as often in each setting but the items
move about 754 / clients-per-round server steps between two of its turns. Measured on:

- seen users (the training users' newest 10% of ratings): FedRecon reconstructs the user
  vector from the user's training ratings with the final globals; FURL uses the kept one;
- unseen users (held-out test users, query batches): FedRecon by ReconEval; FURL with the
  model's initial user vector (what a FURL device that never trained has), and FURL's items
  with a reconstruction (FedAvg + ReconEval).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from android_sim.simulation.protocol import UserSplit, pack_support_query, seen_support_query, time_split
from android_sim.simulation.rounds import (
    Devices,
    PrivateLocals,
    Rounds,
    Server,
    fedrecon_work,
    furl_work,
    initial_locals_eval_work,
    per_item_names,
    private_locals_eval_work,
    recon_eval_work,
    seen_recon_eval_work,
    train_federated,
)
from benchmarks.figures import with_intervals
from contracts.features import Examples
from contracts.params import Params
from contracts.task_config import TaskConfig
from model_runtime.tflite_model import TFLiteModel
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig


@dataclass(frozen=True)
class StalenessOptions:
    participations: int = 30_000  # client tasks per run, the same for every participation level
    clients_per_round: tuple[int, ...] = (100, 20, 5)
    sampling_seed: int = 0
    # False: the server's learning rate as configured at every level, so the items move
    # 100 / clients-per-round times further per example visit (and between a user's turns).
    # True: scaled by clients-per-round / 100, so every example visit moves the items as far
    # at every level and only how often the server steps (the granularity) changes.
    scale_server_learning_rate: bool = False

    def __post_init__(self) -> None:
        if self.participations < 1 or not self.clients_per_round or min(self.clients_per_round) < 1:
            raise ValueError("staleness needs participations >= 1 and clients per round >= 1")


# Each figure's ceiling: the quality bench's centralized row on the same users and ratings (seen:
# the training users' newest 10%; unseen: the held-out users' query batches).
CEILINGS = {
    "fedrecon_seen": "centralized_standard_eval",
    "furl_seen": "centralized_standard_eval",
    "fedrecon_unseen": "centralized_recon_eval",
    "furl_unseen_initial_locals": "centralized_recon_eval",
    "furl_unseen_reconstructed": "centralized_recon_eval",
}


def _accuracy(figures: dict[str, Any]) -> str:
    """Accuracy with its 95% interval, e.g. `41.65% [38.9, 44.3]`."""
    low, high = figures["intervals"]["accuracy"]
    return f"{figures['accuracy']:.2%} [{100 * low:.1f}, {100 * high:.1f}]"


def _no_validation(params: Params) -> dict[str, float]:
    return {}  # only the final model is measured here


def run_staleness(
    examples: Sequence[Examples],
    split: UserSplit,
    options: StalenessOptions,
    model_dir: Path,
    workers: int,
    fedrecon: TaskConfig,
    furl: TaskConfig,
    server: ServerOptimizerConfig,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One FedRecon and one FURL run per participation level; test metrics on seen and unseen users."""
    initial = TFLiteModel(model_dir).get_global()
    rows = []
    with Devices(model_dir, workers) as devices:
        manifest = devices.manifest
        per_item = per_item_names(manifest)
        users = [time_split(e, manifest) for e in examples]
        seen_batches = [seen_support_query(e, manifest, fedrecon) for e in examples]
        held_out = pack_support_query(examples, manifest, fedrecon)
        for per_round in options.clients_per_round:
            count = max(1, options.participations // per_round)
            rounds = Rounds(count, per_round, evaluate_every=count, sampling_seed=options.sampling_seed)
            step = server
            if options.scale_server_learning_rate:
                step = replace(server, learning_rate=server.learning_rate * per_round / 100)
            started = time.perf_counter()
            run = train_federated(
                devices,
                Server(initial, step),
                split.train,
                fedrecon_work(seen_batches, fedrecon, per_item),
                rounds,
                _no_validation,
            )
            devices.set_global(run.params)
            fedrecon_seen = devices.map(seen_recon_eval_work(users, fedrecon, "test"), split.train)
            fedrecon_unseen = devices.map(recon_eval_work(held_out, fedrecon), split.test)
            fedrecon_seconds = time.perf_counter() - started
            started = time.perf_counter()
            kept = PrivateLocals(manifest)
            run = train_federated(
                devices,
                Server(initial, step),
                split.train,
                furl_work(users, kept, furl, per_item),
                rounds,
                _no_validation,
            )
            devices.set_global(run.params)
            furl_seen = devices.map(private_locals_eval_work(users, kept, "test"), split.train)
            furl_unseen = devices.map(initial_locals_eval_work(held_out), split.test)
            furl_unseen_recon = devices.map(recon_eval_work(held_out, fedrecon), split.test)
            row: dict[str, Any] = {
                "clients_per_round": per_round,
                "rounds": count,
                "participations": count * per_round,
                "server_learning_rate": step.learning_rate,
                "rounds_between_turns": len(split.train) / per_round,
                "users_never_sampled": len(split.train) - len(kept.snapshot()),
                # Each with its 95% intervals over the evaluated users (`intervals`).
                "fedrecon_seen": with_intervals(fedrecon_seen),
                "furl_seen": with_intervals(furl_seen),
                "fedrecon_unseen": with_intervals(fedrecon_unseen),
                "furl_unseen_initial_locals": with_intervals(furl_unseen),
                "furl_unseen_reconstructed": with_intervals(furl_unseen_recon),
                "seconds": {"fedrecon": fedrecon_seconds, "furl": time.perf_counter() - started},
            }
            log(
                f"  {per_round:>3} clients/round x {count} rounds: seen users accuracy FedRecon "
                f"{_accuracy(row['fedrecon_seen'])} / FURL {_accuracy(row['furl_seen'])}; unseen "
                f"FedRecon {_accuracy(row['fedrecon_unseen'])} / FURL (initial locals) "
                f"{_accuracy(row['furl_unseen_initial_locals'])} / FURL items + reconstruction "
                f"{_accuracy(row['furl_unseen_reconstructed'])}"
            )
            rows.append(row)
    log(f"  ceilings (run them with --methods): {CEILINGS}")
    return {
        "ceilings": CEILINGS,
        "participations": options.participations,
        "training_users": len(split.train),
        "fedrecon_task": fedrecon.to_json(),
        "furl_task": furl.to_json(),
        "server_optimizer": server.to_json(),
        "scale_server_learning_rate": options.scale_server_learning_rate,
        "runs": rows,
    }


def plot_staleness(path: Path, staleness: dict[str, Any]) -> None:
    """Seen and unseen users' accuracy and RMSE against clients per round, FedRecon and FURL."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    runs = staleness["runs"]
    xs = [r["clients_per_round"] for r in runs]
    series = (
        ("FedRecon, seen users", "fedrecon_seen", "o-"),
        ("FURL (kept), seen users", "furl_seen", "s-"),
        ("FedRecon, unseen users", "fedrecon_unseen", "o--"),
        ("FURL, unseen users (initial locals)", "furl_unseen_initial_locals", "s--"),
        ("FURL items + reconstruction, unseen", "furl_unseen_reconstructed", "^:"),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, metric in zip(axes, ("accuracy", "rmse"), strict=True):
        for label, key, style in series:
            ax.plot(xs, [r[key][metric] for r in runs], style, label=label)
        ax.set_xscale("log")
        if metric == "rmse":
            ax.set_yscale("log")  # a run that diverged would flatten the others
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.invert_xaxis()  # rarer participation to the right
        ax.set_xlabel(f"clients per round ({staleness['participations']:,} client tasks in every run)")
        ax.set_ylabel(f"test {metric}")
        ax.legend(fontsize=7)
    scaled = " (server rate scaled with clients per round)" if staleness["scale_server_learning_rate"] else ""
    fig.suptitle(f"Staleness: FedRecon vs FURL as participation gets rarer (MovieLens){scaled}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
