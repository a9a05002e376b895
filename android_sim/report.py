"""The run report: JSON with every round's counters and metrics, and PNG plots of both."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

FUNNEL = (
    ("checked_in", "checked in"),
    ("accepted", "accepted"),
    ("reported", "reported"),
    ("dropped", "dropped (deadline)"),
    ("aborted", "aborted"),
    ("rejected_min_examples", "filtered (too few examples)"),
    ("rejected_capacity", "turned away (round full)"),
)


def _pyplot() -> ModuleType:
    """matplotlib, imported when a plot is drawn: it is ~0.9 s of every command's start."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def _closed(rounds: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Closed rounds of `kind`, leaving out those abandoned with nobody checked in (e.g. the round
    that was open when the run stopped its training devices)."""
    return [
        r
        for r in rounds
        if r["kind"] == kind
        and (r["status"] == "committed" or (r["status"] == "abandoned" and r["counters"]["checked_in"]))
    ]


def plot_metrics(path: Path, rounds: list[dict[str, Any]], metric: str) -> None:
    """Training clients' query `metric` before their update, and held-out devices' ReconEval."""
    training = [r for r in _closed(rounds, "training") if f"query_{metric}" in r["metrics"]]
    evaluation = [r for r in _closed(rounds, "evaluation") if metric in r["metrics"]]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left, right = axes
    left.plot(
        range(1, len(training) + 1),
        [r["metrics"][f"query_{metric}"] for r in training],
        marker=".",
        label=f"training devices: query {metric} (after reconstruction, before the update)",
    )
    left.set_xlabel("training round")
    left.set_ylabel(metric)
    left.set_title("training rounds")
    left.legend(fontsize=8, loc="upper left")
    private = [
        (i, r["metrics"]["dp_epsilon"]) for i, r in enumerate(training, 1) if "dp_epsilon" in r["metrics"]
    ]
    if private:  # DP-FedAvg: the privacy spent so far, next to what it bought
        twin = left.twinx()
        twin.plot(*zip(*private, strict=True), "r--", label="epsilon spent (DP-FedAvg)")
        twin.set_ylabel("epsilon")
        twin.legend(fontsize=8, loc="upper right")
    if evaluation:
        xs = [_trained_rounds_before(rounds, r) for r in evaluation]
        right.plot(xs, [r["metrics"][metric] for r in evaluation], marker="o", label=f"ReconEval {metric}")
        right.set_ylabel(metric)
        right.legend(loc="upper left", fontsize=8)
        if any("accuracy" in r["metrics"] for r in evaluation):
            twin = right.twinx()
            twin.plot(
                xs,
                [r["metrics"].get("accuracy", float("nan")) for r in evaluation],
                "g--",
                marker="s",
                label="accuracy",
            )
            twin.set_ylabel("accuracy")
            twin.legend(loc="upper right", fontsize=8)
    right.set_xlabel("training rounds committed before the evaluation")
    right.set_title("held-out devices (evaluation rounds)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _trained_rounds_before(rounds: list[dict[str, Any]], evaluation: dict[str, Any]) -> int:
    return sum(
        1
        for r in rounds
        if r["kind"] == "training" and r["status"] == "committed" and r["id"] < evaluation["id"]
    )


def plot_funnel(path: Path, rounds: list[dict[str, Any]]) -> None:
    """Per training round: how many devices checked in, were accepted, reported, dropped, were filtered."""
    training = _closed(rounds, "training")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5), constrained_layout=True)
    xs = range(1, len(training) + 1)
    for key, label in FUNNEL:
        ax.plot(xs, [r["counters"].get(key, 0) for r in training], marker=".", label=label)
    ax.set_xlabel("training round")
    ax.set_ylabel("devices")
    ax.set_title("participation funnel per training round")
    ax.legend(fontsize=8, ncol=2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_next_word(path: Path, rounds: list[dict[str, Any]], accuracy: list[dict[str, Any]]) -> None:
    """Next-word prediction: the training devices' query loss per round, and next-word accuracy
    without and with OOV per round (`accuracy`: training devices' query sets before their update,
    held-out devices' ReconEval in evaluation rounds)."""
    training = [r for r in _closed(rounds, "training") if "query_loss" in r["metrics"]]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left, right = axes
    left.plot(
        range(1, len(training) + 1),
        [r["metrics"]["query_loss"] for r in training],
        marker=".",
        label="training devices: query loss (after reconstruction, before the update)",
    )
    left.set_xlabel("training round")
    left.set_ylabel("cross-entropy")
    left.set_title("training rounds")
    left.legend(fontsize=8, loc="upper right")
    by_id = {r["id"]: r for r in rounds}
    for kind, style in (("training", "-"), ("evaluation", "o-")):
        points = [a for a in accuracy if a["kind"] == kind]
        xs = [_trained_rounds_before(rounds, by_id[a["round"]]) + (kind == "training") for a in points]
        who = "training devices' query" if kind == "training" else "held-out ReconEval"
        for key, label in (("accuracy_without_oov", "without OOV"), ("accuracy_with_oov", "with OOV")):
            right.plot(xs, [a[key] for a in points], style, markersize=4, label=f"{who}, {label}")
    right.set_xlabel("training rounds committed")
    right.set_ylabel("next-word accuracy")
    right.set_title("next-word accuracy")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_learning_curve(path: Path, curve: list[dict[str, float]], metric: str, label: str) -> None:
    """A simulation's validation `metric` by round (and accuracy, when the model has it)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    rounds = [point["round"] for point in curve]
    ax.plot(
        rounds, [point.get(metric, float("nan")) for point in curve], marker="o", label=f"{label}: {metric}"
    )
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.legend(loc="upper left", fontsize=8)
    if any("accuracy" in point for point in curve):
        twin = ax.twinx()
        twin.plot(
            rounds,
            [point.get("accuracy", float("nan")) for point in curve],
            "g--",
            marker="s",
            label="accuracy",
        )
        twin.set_ylabel("accuracy")
        twin.legend(loc="upper right", fontsize=8)
    ax.set_title("learning curve")
    fig.savefig(path, dpi=110)
    plt.close(fig)
