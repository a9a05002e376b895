"""A buffered population's figures, read from the database: the open buffer's fill, the staleness
of the reports counted lately, what the finished participations came to, versions per hour.

Nothing here is kept apart: a buffer is a training round (its `reported` is its fill), its metric
sums hold its reports by staleness (`buffering.STALENESS_COUNT`), and an assignment's row says how
its participation finished. A report refused as too stale has its assignment dropped at once,
before the assignment's own deadline (`buffering.place`); one that never reported in time is
dropped at or after it (`buffering.drop_expired`): so a dropped assignment's `finished_at`
against its `deadline` tells the two apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from contracts.protocol import BufferView
from orchestrator.db import Assignment, Population, Round
from orchestrator.populations.config import population_settings
from orchestrator.rounds.buffering import TRAINING, staleness_histogram

WINDOW_VERSIONS = 20  # the staleness histogram and the counted share: the newest this many buffers
HOURS = 24  # versions per hour: the last this many hours
HOUR = 3600.0


def staleness_counts(histogram: dict[int, int]) -> list[int]:
    """A histogram by staleness as a list, item s the reports s versions stale (0 where none)."""
    if not histogram:
        return []
    counts = [0] * (max(histogram) + 1)
    for s, n in histogram.items():
        counts[s] += n
    return counts


def _window(session: Session, population_id: int) -> list[Round]:
    """The open buffer and the newest committed ones, newest first."""
    return list(
        session.scalars(
            select(Round)
            .where(
                Round.population_id == population_id,
                Round.kind == TRAINING,
                Round.status.in_(("open", "committed")),
            )
            .order_by(Round.id.desc())
            .limit(WINDOW_VERSIONS + 1)
        )
    )


def _finished(session: Session, population_id: int, since: float) -> dict[str, int]:
    """The population's training assignments finished since `since`, by how they finished."""
    dropped_early = (Assignment.status == "dropped") & (Assignment.finished_at < Assignment.deadline)
    outcome = case(
        (Assignment.status == "reported", "counted"),
        (dropped_early, "refused_stale"),
        (Assignment.status == "dropped", "expired"),
        else_="invalid",  # invalid or aborted
    )
    rows = session.execute(
        select(outcome, func.count())
        .join(Round, Round.id == Assignment.round_id)
        .where(
            Round.population_id == population_id,
            Round.kind == TRAINING,
            Assignment.status != "assigned",
            Assignment.finished_at >= since,
        )
        .group_by(outcome)
    ).tuples()
    return {name: int(count) for name, count in rows}


def versions_per_hour(closed_at: Sequence[float], now: float) -> tuple[float, list[int]]:
    """The start of the first of the last HOURS whole UTC hours (the current one last), and the
    commits in each."""
    start = (math.floor(now / HOUR) - (HOURS - 1)) * HOUR
    counts = [0] * HOURS
    for t in closed_at:
        hour = int((t - start) // HOUR)
        if 0 <= hour < HOURS:
            counts[hour] += 1
    return start, counts


def buffer_view(session: Session, population: Population, now: float) -> BufferView | None:
    """The figures of a buffered population; None for a synchronous one."""
    settings = population_settings(population)
    if not settings.buffered_training:
        return None
    window = _window(session, population.id)
    open_buffer = next((r for r in window if r.status == "open"), None)
    committed = [r for r in window if r.status == "committed"][:WINDOW_VERSIONS]
    shown = [r for r in (open_buffer, *committed) if r is not None]
    histogram: dict[int, int] = {}
    for r in shown:
        for s, n in staleness_histogram(r.metrics or {}).items():
            histogram[s] = histogram.get(s, 0) + n
    window_start = min((r.opened_at for r in shown), default=None)
    finished = _finished(session, population.id, window_start) if window_start is not None else {}
    closed = session.scalars(
        select(Round.closed_at).where(
            Round.population_id == population.id,
            Round.kind == TRAINING,
            Round.status == "committed",
            Round.closed_at >= now - HOURS * HOUR,
        )
    )
    start, per_hour = versions_per_hour([t for t in closed if t is not None], now)
    return BufferView(
        buffer_size=settings.buffered.buffer_size,
        open_round_id=open_buffer.id if open_buffer else None,
        open_reports=open_buffer.reported if open_buffer else 0,
        open_since=open_buffer.opened_at if open_buffer else None,
        window_versions=len(committed),
        window_start=window_start,
        staleness_counts=staleness_counts(histogram),
        counted=finished.get("counted", 0),
        refused_stale=finished.get("refused_stale", 0),
        expired=finished.get("expired", 0),
        invalid=finished.get("invalid", 0),
        hours_start=start,
        versions_per_hour=per_hour,
    )
