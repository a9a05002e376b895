"""What the dashboard's pages show, read from the database in one short transaction each."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contracts.protocol import PopulationView, RoundView
from orchestrator.db import Population, Round
from orchestrator.service.population_views import population_out, round_out

ROUNDS_SHOWN = 60  # the rounds over time chart and table: the newest this many
MAX_METRIC_CHARTS = 6
# The funnel's stages, in order: a device checks in, is accepted, reports.
FUNNEL = ("checked_in", "accepted", "reported")
# Where the others went (RoundView.counters' names).
LOST = ("rejected_capacity", "rejected_min_examples", "dropped", "late", "invalid", "aborted")
# A check-in is accepted or turned away: these add up to `checked_in` ("refused_otherwise": a
# device that already took part, a secure round's closed roster, a spent budget).
CHECKED_IN = ("accepted", "rejected_capacity", "rejected_min_examples", "refused_otherwise")
# An accepted device reports, is still in its task (an open round), was outrun (its round closed
# at its target first), dropped at the deadline, refused as invalid or aborted: these add up to
# `accepted`. A late report is one of the outrun or dropped, counted apart.
ACCEPTED = ("reported", "in_task", "outrun", "dropped", "invalid", "aborted")


@dataclass(frozen=True)
class Series:
    """One metric by model version: training rounds' (by the version they made) and evaluation
    rounds' (by the version they evaluated)."""

    name: str
    training: list[tuple[int, float]] = field(default_factory=list)
    evaluation: list[tuple[int, float]] = field(default_factory=list)
    # An evaluation round's 95% interval (`evaluation_intervals`), by the version it evaluated.
    intervals: dict[int, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class PopulationPage:
    population: PopulationView
    rounds: list[RoundView]  # newest first
    funnel: dict[str, int]  # summed over `rounds`
    why_abandoned: list[tuple[str, int]]  # "in <phase> by <cause>", how many, most first
    metrics: list[Series]
    idle_rounds: int = 0  # closed with no device checked in
    checked_in_parts: tuple[str, ...] = CHECKED_IN
    accepted_parts: tuple[str, ...] = ACCEPTED


def populations(factory: sessionmaker[Session], now: float) -> list[PopulationView]:
    with factory() as session:
        return [
            population_out(session, p, now)
            for p in session.scalars(select(Population).order_by(Population.id))
        ]


def population_page(factory: sessionmaker[Session], name: str, now: float) -> PopulationPage | None:
    with factory() as session:
        found = session.scalars(select(Population).where(Population.name == name)).first()
        if found is None:
            return None
        view = population_out(session, found, now)
        rounds = [
            round_out(r)
            for r in session.scalars(
                select(Round)
                .where(Round.population_id == found.id)
                .order_by(Round.id.desc())
                .limit(ROUNDS_SHOWN)
            )
        ]
    return PopulationPage(
        view,
        rounds,
        funnel(rounds),
        why_abandoned(rounds),
        metric_series(rounds),
        idle_rounds=sum(idle(r) for r in rounds),
    )


def funnel(rounds: list[RoundView]) -> dict[str, int]:
    """The counters summed over `rounds`, with the parts that make `checked_in` and `accepted`
    add up (CHECKED_IN, ACCEPTED)."""
    totals: Counter[str] = Counter()
    for r in rounds:
        c = r.counters
        totals.update({k: c.get(k, 0) for k in (*FUNNEL, *LOST)})
        refused = c.get("rejected_capacity", 0) + c.get("rejected_min_examples", 0)
        totals["refused_otherwise"] += max(0, c.get("checked_in", 0) - c.get("accepted", 0) - refused)
        finished = sum(c.get(k, 0) for k in ("reported", "dropped", "invalid", "aborted"))
        unfinished = max(0, c.get("accepted", 0) - finished)
        totals["in_task" if r.status == "open" else "outrun"] += unfinished
    return {k: totals[k] for k in dict.fromkeys((*FUNNEL, *LOST, *CHECKED_IN, *ACCEPTED))}


def idle(r: RoundView) -> bool:
    """A round that closed without a device checking in: no devices, not a failure."""
    return r.status == "abandoned" and not r.counters.get("checked_in", 0)


def why_abandoned(rounds: list[RoundView]) -> list[tuple[str, int]]:
    causes = Counter(
        f"in {r.stopped_phase or '?'} by {r.ended_by or '?'}"
        for r in rounds
        if r.status == "abandoned" and not idle(r)
    )
    return causes.most_common()


# The quality metrics first (training reports' losses, evaluation reports' loss, rmse and
# accuracy), then whatever else a model reports; counts and sums are not charted.
PREFERRED = ("update_loss", "reconstruction_loss", "loss", "rmse", "accuracy", "query_loss", "query_rmse")
COUNTS = ("num_", "correct", "squared_error", "outside_catalog", "weight")


def _shown_metric(name: str) -> bool:
    # The means, not the sums they come from, nor counts, nor the secure phases' timings.
    return (
        not name.endswith("_sum")
        and not name.startswith(COUNTS)
        and not name.removeprefix("query_").startswith(COUNTS)
        and not (name.startswith("secure_") and name.endswith("_seconds"))
        and not name.endswith(("_low", "_high"))  # an evaluation's intervals
        and name != "interval_groups"
    )


def _order(name: str) -> tuple[int, str]:
    return (PREFERRED.index(name) if name in PREFERRED else len(PREFERRED), name)


def metric_series(rounds: list[RoundView]) -> list[Series]:
    """Each metric's values by model version, oldest version first."""
    by_name: dict[str, Series] = {}
    for r in sorted(rounds, key=lambda r: r.id):
        if r.status != "committed":
            continue
        version = r.result_version if r.kind == "training" else r.base_version
        if version is None:
            continue
        for name, value in r.metrics.items():
            if _shown_metric(name):
                series = by_name.setdefault(name, Series(name))
                (series.training if r.kind == "training" else series.evaluation).append((version, value))
                low, high = r.metrics.get(f"{name}_low"), r.metrics.get(f"{name}_high")
                if r.kind != "training" and low is not None and high is not None:
                    series.intervals[version] = (low, high)
    return [by_name[name] for name in sorted(by_name, key=_order)][:MAX_METRIC_CHARTS]
