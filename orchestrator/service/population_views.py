"""A population and its rounds as the admin API, the dashboard and `status` show them: the
contract's views (contracts.protocol), read inside the caller's transaction."""

from __future__ import annotations

import math
import time
from typing import cast

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from contracts.protocol import (
    DevicesSeenView,
    ModelVersionView,
    PopulationView,
    PrivacyView,
    RoundKind,
    RoundView,
)
from orchestrator import devices
from orchestrator.db import Population, Round
from orchestrator.populations import model_versions
from orchestrator.populations.config import population_settings
from orchestrator.rounds import idle_backoff
from orchestrator.rounds.lifecycle import open_rounds, summarize_metrics
from orchestrator.service.buffer_figures import buffer_view

COUNTERS = (
    "checked_in",
    "accepted",
    "rejected_capacity",
    "rejected_min_examples",
    "reported",
    "dropped",
    "late",
    "invalid",
    "aborted",
)
RECENT_ROUNDS = 5


def round_out(r: Round) -> RoundView:
    return RoundView(
        id=r.id,
        kind=cast(RoundKind, r.kind),  # a round is of one of the three kinds
        status=r.status,
        base_version=r.base_version,
        result_version=r.result_version,
        target=r.target,
        capacity=r.capacity,
        min_reports=r.min_reports,
        opened_at=r.opened_at,
        deadline=r.deadline,
        closed_at=r.closed_at,
        counters={c: getattr(r, c) for c in COUNTERS},
        total_weight=r.total_weight,
        metrics=summarize_metrics(r),
        close_reason=r.close_reason,
        stopped_phase=r.stopped_phase,
        devices_had=r.devices_had,
        devices_needed=r.devices_needed,
        ended_by=r.ended_by,
        checkin_window=r.checkin_window,
    )


def privacy_out(p: Population) -> PrivacyView | None:
    settings = population_settings(p)
    if settings.dp() is None:
        return None
    spent = settings.privacy_spent(p.training_rounds_committed)
    return PrivacyView(
        epsilon=spent.epsilon if math.isfinite(spent.epsilon) else None,
        delta=spent.delta,
        sampling_rate=spent.sampling_rate,
        training_rounds=spent.rounds,
        epsilon_budget=spent.epsilon_budget,
        rounds_within_budget=spent.rounds_within_budget,
        budget_spent=spent.budget_spent,
        message=spent.message(),
    )


def population_out(session: Session, p: Population, now: float | None = None) -> PopulationView:
    now = time.time() if now is None else now
    return PopulationView(
        name=p.name,
        current_version=p.current_version,
        training_rounds_committed=p.training_rounds_committed,
        artifact_sha256=p.artifact_sha256,
        settings=p.settings,
        open_rounds=[round_out(r) for r in open_rounds(session, p).values()],
        privacy=privacy_out(p),
        recent_rounds=[round_out(r) for r in session.scalars(_recent_rounds(p.id))],
        idle_rounds=p.idle_rounds,
        next_round_at=p.next_round_at,
        backing_off=idle_backoff.describe(p, now),
        paused_at=p.paused_at,
        settings_version=p.settings_version,
        archived_at=p.archived_at,
        devices_seen=DevicesSeenView(*devices.seen(session, p.id, now)),
        model_versions=[ModelVersionView(*kept) for kept in model_versions.kept(session, p)],
        buffer=buffer_view(session, p, now),
    )


def _recent_rounds(population_id: int) -> Select[tuple[Round]]:
    return (
        select(Round)
        .where(Round.population_id == population_id, Round.status != "open")
        .order_by(Round.id.desc())
        .limit(RECENT_ROUNDS)
    )
