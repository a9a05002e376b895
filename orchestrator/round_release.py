"""What a round's figures may release to the operator (the status, the admin routes, the console,
the dashboard), and when a round may not run at all because it would release too much.

- **Evaluation rounds** report each device's metric sums in plaintext. A round's sums are released
  only once it commits with at least `min_evaluation_reports` devices' reports (its `min_reports`):
  while it is open the running sums are one device's after its first report, so nothing is shown;
  a round that falls short is abandoned at its deadline and its sums are erased. Report rows keep
  no evaluation sums (`round_reports`). Its figures' 95% intervals come from groups of at
  least the floor's devices each (`evaluation_intervals`); the groups' own sums are never shown.
- **Differential privacy**: evaluation sums are not noised, so once a population's budget is spent
  no evaluation round opens (schedule or admin API) and an open one is abandoned. A DP round's raw
  count of devices within the clip norm (`dp_within_clip`, one device's bit after its first report)
  is never shown; only its noised share (`dp_unclipped_share`) is, after the commit.
"""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator.aggregation.private import WITHIN_CLIP
from orchestrator.db import Population, Round
from orchestrator.populations.config import privacy_budget_spent
from orchestrator.rounds.evaluation_intervals import is_group_sum
from orchestrator.rounds.state import ABANDONED, COMMITTED, PRIVACY_BUDGET, Closing

EVALUATION = "evaluation"
BUDGET_SPENT_REASON = (
    "the population's privacy budget is spent: an evaluation round's sums are not noised, so none "
    "runs any more"
)
BUDGET_SPENT = Closing(ABANDONED, BUDGET_SPENT_REASON, ended_by=PRIVACY_BUDGET)


def may_open_evaluation(population: Population) -> str | None:
    """Why no evaluation round may open now (one sentence), or None."""
    if privacy_budget_spent(population):
        return BUDGET_SPENT_REASON
    return None


def released(round_: Round) -> dict[str, float]:
    """The round's metric sums that may be shown: an evaluation round's only once committed (with
    at least its floor of reports), never a raw within-clip count."""
    if round_.kind == EVALUATION and not (
        round_.status == COMMITTED and round_.reported >= round_.min_reports
    ):
        return {}
    return {k: v for k, v in round_.metrics.items() if k != WITHIN_CLIP and not is_group_sum(k)}


def kept_after_abandon(kind: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """What an abandoned round keeps of its metrics: an evaluation round nothing (its sums are of
    fewer devices than its floor), a training round all but the raw within-clip count."""
    if kind == EVALUATION:
        return {}
    return {k: v for k, v in metrics.items() if k != WITHIN_CLIP}
