"""`orchestrator_rounds_total`, read from the database when /metrics is scraped.

Every round is a row that is never deleted, and its status moves once, from open to committed or
abandoned, in the transaction that closes it; so the rows counted by population, kind and status
are the transitions, as the database committed them. A counter in memory, bumped after each
commit, could disagree with the database a scrape later reads (the issue-49 test saw 7 committed
against 6 listed); this one cannot, and it is the same whichever server process answers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Population, Round

Counts = dict[tuple[str, str, str], int]  # (population, kind, transition) -> rounds

_BY_STATUS = (
    select(Population.name, Round.kind, Round.status, func.count())
    .join(Population, Population.id == Round.population_id)
    .group_by(Population.name, Round.kind, Round.status)
)


def round_counts(factory: sessionmaker[Session]) -> Counts:
    """Rounds opened (every round), committed and abandoned, by population and kind."""
    counts: Counts = {}
    with factory() as session:
        for population, kind, status, rounds in session.execute(_BY_STATUS).tuples():
            opened = (population, kind, "opened")
            counts[opened] = counts.get(opened, 0) + rounds
            if status != "open":
                counts[(population, kind, status)] = rounds
    return counts


class _Rounds(Collector):
    def __init__(self, counts: Mapping[tuple[str, str, str], int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "orchestrator_rounds",
            "Round transitions (opened, committed, abandoned), by population and round kind, as the "
            "database has them",
            labels=["population", "kind", "transition"],
        )
        for labels, rounds in sorted(self.counts.items()):
            family.add_metric(list(labels), rounds)
        yield family


def exposition(counts: Mapping[tuple[str, str, str], int]) -> bytes:
    """The counts in the Prometheus text format."""
    registry = CollectorRegistry()
    registry.register(_Rounds(counts))
    return generate_latest(registry)
