"""Secure aggregation in buffered rounds: a buffer holds its cohorts' sums, never a device's update.

A buffered population with `aggregation: "secure"` trains in cohorts (`cohorts`): each an ordinary
secure round of the existing protocol (its roster, thresholds and phases; the devices' privacy
policy floors apply to it as to any secure round), whose devices all trained on the version current
when it opened. When a cohort's masked inputs are unmasked the server holds one thing: the sum of
its n survivors' clipped deltas. That sum goes into the buffer open then (`enter`) with the
cohort's staleness s (versions committed since the cohort opened) and counts as n reports of
weight f(s) each: one factor for the whole sum, since the server cannot weigh a device it cannot
see. A cohort more than `buffered.max_staleness` versions behind is abandoned and its sum discarded,
as a plaintext report that stale is refused.

The buffer commits at `buffer_size` reports' worth (it may hold more: a cohort's sum enters whole),
or at its deadline with `min_reports`, with the mean sum_c f(s_c) S_c / sum_c f(s_c) n_c (`take`),
through the population's secure pipeline (`SecureSum`). The sums are deleted in the transaction
that closes their buffer, unless `report_deltas` is "keep".
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import bindparam, delete, select
from sqlalchemy.orm import Session

from contracts.manifest import Manifest
from contracts.params import Params, decode_params, encode_params
from orchestrator.aggregation.staleness import staleness_weight
from orchestrator.db import CohortSum, Round
from orchestrator.populations.settings import PopulationSettings
from orchestrator.rounds import buffering
from orchestrator.rounds import counts as round_counts
from orchestrator.rounds import state as round_state
from orchestrator.rounds.secure.phases import UNMASKING, Commit

STALE = buffering.STALE  # what ended a cohort whose sum was too stale for the buffer
# A cohort's metrics once its sum entered a buffer: which one, and how many versions behind.
INTO_BUFFER, COHORT_STALENESS = "buffer_id", "staleness"

_SUMS = (
    select(CohortSum.members, CohortSum.factor, CohortSum.total)
    .where(CohortSum.buffer_id == bindparam("buffer_id"))
    .order_by(CohortSum.round_id)
    .execution_options(yield_per=4)
)
_FORGET = delete(CohortSum).where(CohortSum.buffer_id == bindparam("buffer_id"))


def enter(
    session: Session, settings: PopulationSettings, cohort: Round, buffer: Round | None, unmasked: Commit
) -> round_state.Closing | None:
    """Put the cohort's unmasked sum into `buffer` (the open one) and count it there; or the closing
    that abandons the cohort instead (no buffer open, or the sum too stale), its sum discarded."""
    members = unmasked.survivors
    if buffer is None:
        reason = "no buffer was open when the cohort's sum was unmasked (the population is paused or done)"
        return round_state.Closing(round_state.ABANDONED, reason, UNMASKING, members, None, None)
    staleness = buffer.base_version - cohort.base_version
    limit = settings.buffered.max_staleness
    if staleness > limit:
        reason = (
            f"the cohort trained on version {cohort.base_version}, {staleness} versions behind the current "
            f"{buffer.base_version}; this population adds sums at most {limit} versions stale: discarded"
        )
        return round_state.Closing(round_state.ABANDONED, reason, UNMASKING, members, None, STALE)
    factor = staleness_weight(settings.buffered.staleness_weighting, staleness)
    total = {
        name: (value.astype(np.float64) * members).astype(np.float32)
        for name, value in unmasked.mean_delta.items()
    }
    session.add(
        CohortSum(
            round_id=cohort.id,
            buffer_id=buffer.id,
            members=members,
            staleness=staleness,
            factor=factor,
            total=encode_params(total),
        )
    )
    # n reports' worth, each of weight f(s): the staleness histogram counts devices, as in plaintext.
    sums = {
        buffering.STALENESS_TOTAL: float(staleness * members),
        f"{buffering.STALENESS_COUNT}{staleness}": float(members),
    }
    counted = round_counts.count(
        session, buffer, round_state.Count({"reported": members, "total_weight": members * factor}, sums)
    )
    assert counted, f"buffer {buffer.id} closed under its population's lock"
    cohort.metrics = {**cohort.metrics, INTO_BUFFER: float(buffer.id), COHORT_STALENESS: float(staleness)}
    return None


def take(
    session: Session, settings: PopulationSettings, buffer: Round, manifest: Manifest
) -> tuple[Params, int]:
    """The buffer's mean delta over its cohorts' sums, weighted by their staleness factors, and the
    devices those sums hold; the sums are then forgotten (unless `report_deltas` is "keep")."""
    total = {s.name: np.zeros(s.shape, np.float64) for s in manifest.global_params}
    weight, members = 0.0, 0
    for count, factor, blob in session.execute(_SUMS, {"buffer_id": buffer.id}):
        for name, value in decode_params(blob, manifest.global_params, "cohort sum").items():
            total[name] += factor * value
        weight, members = weight + factor * count, members + count
    if members == 0:
        raise ValueError(f"buffer {buffer.id} holds no cohort's sum")
    if settings.report_deltas == "until_round_closes":
        session.execute(_FORGET, {"buffer_id": buffer.id})
    return {name: (value / weight).astype(np.float32) for name, value in total.items()}, members
