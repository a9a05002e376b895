"""Buffered rounds' metrics, read from the database when /metrics is scraped (as round_counter.py
reads `orchestrator_rounds_total`): the staleness histogram of the reports counted into buffers,
and each buffered population's open buffer's fill.

A buffer's metric sums hold its reports by staleness (`buffering.STALENESS_COUNT`) and are only
ever added to, in the transaction that counts a report; its row is never deleted. So the
histogram summed over a population's buffers is what the database committed, whichever server
process answers the scrape, and it never goes back. An in-memory histogram observed after each
commit could disagree with the rounds listing a scrape later reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db import Population, Round
from orchestrator.populations.config import population_settings
from orchestrator.rounds.buffering import TRAINING, staleness_histogram

# The histogram's upper bounds in versions (le); +Inf is added.
BUCKETS = (0, 1, 2, 3, 5, 10, 20, 50, 100)


@dataclass(frozen=True)
class BufferReading:
    """One buffered population's figures: reports counted by staleness, the open buffer's fill."""

    staleness: dict[int, int] = field(default_factory=dict)  # versions stale -> reports
    open_reports: int = 0
    buffer_size: int = 0


Readings = dict[str, BufferReading]  # population name -> its reading


def buffer_readings(factory: sessionmaker[Session]) -> Readings:
    """Every buffered population's reading (archived ones too: their counts stay)."""
    readings: Readings = {}
    with factory() as session:
        buffered = {
            p.id: (p.name, population_settings(p).buffered.buffer_size)
            for p in session.scalars(select(Population))
            if population_settings(p).buffered_training
        }
        if not buffered:
            return readings
        staleness: dict[int, dict[int, int]] = {i: {} for i in buffered}
        fill = dict.fromkeys(buffered, 0)
        rows = session.execute(
            select(Round.population_id, Round.status, Round.reported, Round.metrics).where(
                Round.population_id.in_(buffered), Round.kind == TRAINING
            )
        ).tuples()
        for population_id, status, reported, sums in rows:
            by = staleness[population_id]
            for s, n in staleness_histogram(sums or {}).items():
                by[s] = by.get(s, 0) + n
            if status == "open":
                fill[population_id] = reported
    for i, (name, size) in buffered.items():
        readings[name] = BufferReading(staleness[i], fill[i], size)
    return readings


def histogram_buckets(staleness: dict[int, int]) -> tuple[list[tuple[str, float]], float]:
    """The cumulative buckets (le, count) of a histogram by staleness, +Inf last, and its sum."""
    buckets = [(str(float(le)), float(sum(n for s, n in staleness.items() if s <= le))) for le in BUCKETS]
    buckets.append(("+Inf", float(sum(staleness.values()))))
    return buckets, float(sum(s * n for s, n in staleness.items()))


class _Buffers(Collector):
    def __init__(self, readings: Readings) -> None:
        self.readings = readings

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        staleness = HistogramMetricFamily(
            "orchestrator_report_staleness_versions",
            "Buffered rounds: reports counted into a buffer by their staleness (the versions committed "
            "between their download and their arrival), as the database has them",
            labels=["population"],
        )
        fill = GaugeMetricFamily(
            "orchestrator_buffer_reports",
            "Buffered rounds: reports in the population's open buffer (0: none open)",
            labels=["population"],
        )
        size = GaugeMetricFamily(
            "orchestrator_buffer_size_reports",
            "Buffered rounds: the reports a buffer commits at (buffered.buffer_size)",
            labels=["population"],
        )
        for name, reading in sorted(self.readings.items()):
            buckets, total = histogram_buckets(reading.staleness)
            staleness.add_metric([name], buckets, total)
            fill.add_metric([name], reading.open_reports)
            size.add_metric([name], reading.buffer_size)
        yield staleness
        yield fill
        yield size


def exposition(readings: Readings) -> bytes:
    """The readings in the Prometheus text format."""
    registry = CollectorRegistry()
    registry.register(_Buffers(readings))
    return generate_latest(registry)
