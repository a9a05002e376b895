"""The privacy accountant for buffered (FedBuff) rounds: no sampling amplification.

Pure functions, `dp_accounting` only. The settings refuse what the analysis does not cover
(`buffered_dp_problems`); the check-in refuses a device past its cap and a report refuses a
second one of a device in one buffer (`rounds.buffered_caps`); a buffer commits through the same
DP stage as a synchronous round (equal weights, Gaussian noise on the sum, divided by the count of
reports, which the schedule fixes).

The analysis (docs/concepts/buffered-rounds.md, "Differential privacy"):

- Adjacency is replace-one user-level (DP-FTRL, Kairouz et al. 2021): one device's data
  replaced by any other. Buffered rounds take reports from whoever checks in, so the schedule
  (who reports when, where buffers end) depends on availability, not on data, and is the same
  for both neighbouring data sets; it is therefore treated as public, and nothing is sampled.
- Each report is clipped to L2 <= C, and a buffer's noised SUM is what is released: the mean
  must divide it by a fixed K (the buffer size), not by a data-dependent count or weight total.
  Staleness weights are <= 1, so a weighted report still moves the sum by at most C under
  add/remove, and by at most 2C under replace-one; the noise stddev z*C then gives noise
  multiplier z for add/remove and z/2 for replace-one (`replace_one_noise_multiplier`).
- A device contributes to at most one report per buffer and to at most m buffers
  (`max_participations`). Each buffer it is in is a Gaussian mechanism; buffers it is not in
  do not depend on its data. So its loss is at most the m-fold composition of the Gaussian
  mechanism, whatever the schedule: `SelfComposedDpEvent(GaussianDpEvent(z), m)`.
- Without the cap no finite bound holds (a device could be in every buffer), and a setting
  that releases something unaccounted (adaptive clipping's noised unclipped count, with the
  delta's noise raised as in the synchronous path, is sound only if accounted the same way)
  must be refused: `buffered_dp_problems`.
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.aggregation.differential_privacy import DPConfig, PrivacySpent


def replace_one_noise_multiplier(noise_multiplier: float) -> float:
    """z for replace-one adjacency: replacing a device's clipped report moves the sum by up to 2C
    (from +C to -C), so the same noise z*C is a Gaussian mechanism with multiplier z / 2."""
    return noise_multiplier / 2


def buffered_epsilon(noise_multiplier: float, participations: int, delta: float) -> float:
    """Epsilon at `delta` of a device that was in `participations` buffers, each released as
    sum + N(0, (noise_multiplier * C)^2) with sensitivity C (inf without noise)."""
    if participations <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    # Imported here: dp_accounting pulls in scipy (~2 s), which only DP populations need.
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(
        dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), participations)
    )
    return float(accountant.get_epsilon(delta))


def closed_form_epsilon(
    noise_multiplier: float, participations: int, delta: float, orders: np.ndarray
) -> float:
    """The same bound by hand: m Gaussian releases have RDP m * alpha / (2 z^2) at order alpha,
    converted with the conversion dp_accounting uses (Canonne, Kamath and Steinke 2020,
    Proposition 12), minimised over `orders`. The tests check `buffered_epsilon` equals it."""
    alpha = np.asarray(orders, dtype=np.float64)
    rdp = participations * alpha / (2 * noise_multiplier**2)
    eps = rdp + np.log1p(-1 / alpha) - (math.log(delta) + np.log(alpha)) / (alpha - 1)
    return float(max(0.0, float(np.min(eps))))


def buffered_privacy_spent(config: DPConfig, buffers: int) -> PrivacySpent:
    """Where a buffered population stands after `buffers` committed buffers: a device is in at
    most one report of each, and in at most `max_participations` of them."""
    cap = config.max_participations
    if cap is None:
        raise ValueError("buffered differential privacy needs differential_privacy.max_participations")
    return PrivacySpent(
        rounds=buffers,
        epsilon=buffered_epsilon(config.noise_multiplier, min(buffers, cap), config.target_delta),
        delta=config.target_delta,
        sampling_rate=1.0,  # nothing is sampled: no amplification
        epsilon_budget=None,
        rounds_within_budget=None,
        max_participations=cap,
    )


def buffered_dp_problems(max_participations: int | None, adaptive_clipping: bool) -> list[str]:
    """Why a buffered population's DP settings would not have a sound guarantee (empty: sound)."""
    problems = []
    if max_participations is None:
        problems.append(
            "differential_privacy.max_participations is required with rounds: buffered: without a cap a "
            "device may be in every buffer and no epsilon bounds it (there is no sampling to amplify)"
        )
    elif (
        isinstance(max_participations, bool)
        or not isinstance(max_participations, int)
        or max_participations < 1
    ):
        problems.append(
            f"differential_privacy.max_participations must be an integer >= 1, got {max_participations!r}"
        )
    if adaptive_clipping:
        problems.append(
            "differential_privacy.target_unclipped_quantile (adaptive clipping) is not supported with "
            "rounds: buffered: its noised unclipped count per buffer is a release this accountant "
            "does not count; use a fixed clip_norm"
        )
    return problems
