"""The privacy floors of a simulated fleet or a test: rounds of a few dozen devices, never a real app.

A device's production `PrivacyPolicy()` refuses secure sums of fewer than 1,000 devices; a fleet
of a few dozen simulated phones (and the tests' handfuls) would never take part. These floors are
set by the harness from outside, as a real app sets its own.
"""

from __future__ import annotations

from device_runtime.privacy_policy import PrivacyPolicy


def simulation_policy(
    *aggregation: str,
    min_summands: int = 3,
    min_threshold: float = 0.25,
    max_participations_per_day: int = 10_000,
    certified_roster: bool = False,
) -> PrivacyPolicy:
    """Small floors for fleets of a few dozen devices and for tests (never for a real app)."""
    return PrivacyPolicy(
        frozenset(aggregation or ("secure",)),
        plaintext_evaluation=True,
        min_summands=min_summands,
        min_threshold=min_threshold,
        max_participations_per_day=max_participations_per_day,
        max_device_participations_per_day=max_participations_per_day,
        certified_roster=certified_roster,
    )
